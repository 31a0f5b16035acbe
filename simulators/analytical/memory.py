"""Peak memory of one rank class, swept over its simulated timeline.

A tensor is live from the start of its producer call (from the start of the step when it has none) to the end
of its consumer call (to the end of the step when it has none); every call also holds its block's working
memory while it runs. Pricing liveness on the timeline rather than on issue order is what makes 1F1B hold
fewer micro-batches of activations than GPipe.
"""

from collections.abc import Sequence

import numpy as np

from dse.fields import GiB
from dse.system import AcceleratorSpec
from dse.workload import TENSOR_KIND_CODE, TENSOR_KINDS, Block, Program, TensorKind, columns_of
from simulators.analytical.calls import call_array

_TEMPORARY = TENSOR_KIND_CODE[TensorKind.TEMPORARY]


def peak_memory(
    program: Program, blocks: Sequence[Block], call_start: Sequence[float], call_end: Sequence[float]
) -> tuple[float, dict[str, float]]:
    """The peak bytes and, at the moment of the peak, the bytes by tensor kind (block working memory counts as
    temporary). Frees at an instant go before allocations at that instant: a call that starts as another ends
    reuses the memory the other released."""
    producer, consumer, kind, size = columns_of(program.tensors)
    call_start = np.asarray(call_start, dtype=float)
    call_end = np.asarray(call_end, dtype=float)
    made = producer >= 0
    allocated = np.zeros(len(producer))
    allocated[made] = call_start[producer[made]]
    freed = consumer >= 0
    block_temp = np.fromiter((block.temp_bytes for block in blocks), float, len(blocks))
    temp = block_temp[call_array(program, "block")]
    held = np.flatnonzero(temp)
    times_all = np.concatenate((allocated, call_end[consumer[freed]], call_start[held], call_end[held]))
    deltas_all = np.concatenate((size, -size[freed], temp[held], -temp[held]))
    kinds_all = np.concatenate((kind, kind[freed], np.full(2 * len(held), _TEMPORARY, dtype=np.intp)))
    at_peak = dict.fromkeys((kind.value for kind in TENSOR_KINDS), 0.0)
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
    by_kind = np.bincount(kinds_all[upto], weights=deltas_all[upto], minlength=len(TENSOR_KINDS))
    for kind, held_bytes in zip(TENSOR_KINDS, by_kind, strict=True):
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
