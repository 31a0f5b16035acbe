"""Peak memory of one rank class, swept over its simulated timeline.

A tensor is live from the start of its producer call (from the start of the step when it has none) to the end
of its consumer call (to the end of the step when it has none); every call also holds its block's working
memory while it runs. Pricing liveness on the timeline rather than on issue order is what makes 1F1B hold
fewer micro-batches of activations than GPipe.
"""

from collections.abc import Sequence

import numpy as np

from dse.workload import Block, Program, TensorKind

_KINDS = list(TensorKind)
_KIND_INDEX = {kind: i for i, kind in enumerate(_KINDS)}
_TEMPORARY = _KIND_INDEX[TensorKind.TEMPORARY]


def peak_memory(
    program: Program, blocks: Sequence[Block], call_start: Sequence[float], call_end: Sequence[float]
) -> tuple[float, dict[str, float]]:
    """The peak bytes and, at the moment of the peak, the bytes by tensor kind (block working memory counts as
    temporary). Frees at an instant go before allocations at that instant: a call that starts as another ends
    reuses the memory the other released."""
    times: list[float] = []
    deltas: list[float] = []
    kinds: list[int] = []
    for tensor in program.tensors:
        kind = _KIND_INDEX[tensor.kind]
        times.append(0.0 if tensor.producer is None else call_start[tensor.producer])
        deltas.append(tensor.bytes)
        kinds.append(kind)
        if tensor.consumer is not None:
            times.append(call_end[tensor.consumer])
            deltas.append(-tensor.bytes)
            kinds.append(kind)
    for c, call in enumerate(program.calls):
        temp = blocks[call.block].temp_bytes
        if temp:
            times += [call_start[c], call_end[c]]
            deltas += [temp, -temp]
            kinds += [_TEMPORARY, _TEMPORARY]
    at_peak = dict.fromkeys((kind.value for kind in _KINDS), 0.0)
    if not times:
        return 0.0, at_peak
    delta = np.asarray(deltas)
    order = np.lexsort((delta > 0, np.asarray(times)))
    level = np.cumsum(delta[order])
    peak = int(np.argmax(level))
    if level[peak] <= 0:
        return 0.0, at_peak
    upto = order[: peak + 1]
    by_kind = np.bincount(np.asarray(kinds)[upto], weights=delta[upto], minlength=len(_KINDS))
    for kind, held in zip(_KINDS, by_kind, strict=True):
        at_peak[kind.value] = float(held)
    return float(level[peak]), at_peak
