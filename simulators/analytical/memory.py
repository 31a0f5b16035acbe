"""Peak memory of one rank class, swept over its simulated timeline.

A tensor is live from the start of its producer call (from the start of the step when it has none) to the end
of its consumer call (to the end of the step when it has none); every call also holds its block's working
memory while it runs. Pricing liveness on the timeline rather than on issue order is what makes 1F1B hold
fewer micro-batches of activations than GPipe.
"""

from collections.abc import Sequence

import numpy as np

from dse.spec import AcceleratorSpec, GiB
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
    block_temp = np.fromiter((block.temp_bytes for block in blocks), float, len(blocks))
    temp = block_temp[np.fromiter((call.block for call in program.calls), int, len(program.calls))]
    held = np.flatnonzero(temp)
    starts, ends = np.asarray(call_start, dtype=float)[held], np.asarray(call_end, dtype=float)[held]
    times_all = np.concatenate((np.asarray(times, dtype=float), starts, ends))
    deltas_all = np.concatenate((np.asarray(deltas, dtype=float), temp[held], -temp[held]))
    kinds_all = np.concatenate((np.asarray(kinds, dtype=int), np.full(2 * len(held), _TEMPORARY, dtype=int)))
    at_peak = dict.fromkeys((kind.value for kind in _KINDS), 0.0)
    if not len(times_all):
        return 0.0, at_peak
    # Instants closer than a nanosecond are one: a free and an allocation that the schedule puts at the same
    # time must not be ordered by floating-point noise (the fast path shifts cached times by its t0).
    order = np.lexsort((deltas_all > 0, np.round(times_all, 9)))
    level = np.cumsum(deltas_all[order])
    peak = int(np.argmax(level))
    if level[peak] <= 0:
        return 0.0, at_peak
    upto = order[: peak + 1]
    by_kind = np.bincount(kinds_all[upto], weights=deltas_all[upto], minlength=len(_KINDS))
    for kind, held_bytes in zip(_KINDS, by_kind, strict=True):
        at_peak[kind.value] = float(held_bytes)
    return float(level[peak]), at_peak


RESERVE, FRAGMENTATION = "reserve", "fragmentation"


def with_runtime_reserve(peak: float, at_peak: dict[str, float], accelerator: AcceleratorSpec) -> float:
    """The peak plus what the runtime takes besides the step's tensors, both added to the breakdown.

    reserve: the CUDA context, cuBLAS workspaces and NCCL buffers, allocated before the step and fixed.
    fragmentation: the caching allocator's blocks that are reserved but not usable for the next request, a share
    of what the step allocates (the share torch.cuda.memory_reserved exceeds memory_allocated by at the peak).
    """
    reserve = accelerator.runtime_reserve_GiB * GiB
    fragmentation = accelerator.fragmentation * peak
    at_peak[RESERVE] = reserve
    at_peak[FRAGMENTATION] = fragmentation
    return peak + reserve + fragmentation
