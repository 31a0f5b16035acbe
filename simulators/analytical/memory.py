"""Peak memory of one rank class, swept over its simulated timeline.

A tensor is live from the start of its producer call (from the start of the step when it has none) to the end
of its consumer call (to the end of the step when it has none); every call also holds its block's working
memory while it runs. Pricing liveness on the timeline rather than on issue order is what makes 1F1B hold
fewer micro-batches of activations than GPipe.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dse.fields import GiB
from dse.lru import MIB, ByteBoundedLru
from dse.system import AcceleratorSpec
from dse.workload import (
    TENSOR_KIND_CODE,
    TENSOR_KINDS,
    Block,
    CallShape,
    Program,
    TableTensors,
    TensorColumns,
    TensorKind,
    columns_of,
)
from simulators.analytical.calls import call_array, shape_array

_TEMPORARY = TENSOR_KIND_CODE[TensorKind.TEMPORARY]


def peak_memory(
    program: Program, blocks: Sequence[Block], call_start: Sequence[float], call_end: Sequence[float]
) -> tuple[float, dict[str, float]]:
    """The peak bytes and, at the moment of the peak, the bytes by tensor kind (block working memory counts as
    temporary). Frees at an instant go before allocations at that instant: a call that starts as another ends
    reuses the memory the other released."""
    events = _liveness(program, blocks)
    return events.peak(events.times(np.asarray(call_start, dtype=float), np.asarray(call_end, dtype=float)))


@dataclass(frozen=True, slots=True)
class Liveness:
    """A program's allocation and free events, apart from when they happen: each event's time is a call's start or
    end (`times`), so one program's events serve every timeline of it (`batch` sweeps many at once)."""

    at_start: np.ndarray
    """Per event, the call whose start it happens at (-1: at the step's start), or -1 if it happens at an end."""
    at_end: np.ndarray
    """Per event, the call whose end it happens at, or -1."""
    deltas: np.ndarray
    kinds: np.ndarray

    @classmethod
    def of(cls, program: Program, blocks: Sequence[Block]) -> "Liveness":
        return cls.from_columns(columns_of(program.tensors), call_array(program, "block"), blocks)

    @classmethod
    def from_columns(cls, tensors: TensorColumns, call_blocks: np.ndarray, blocks: Sequence[Block]) -> "Liveness":
        """The events of a program's tensors and calls (the block of each call)."""
        producer, consumer, kind, size = tensors
        freed = consumer >= 0
        block_temp = np.fromiter((block.temp_bytes for block in blocks), float, len(blocks))
        temp = block_temp[call_blocks]
        held = np.flatnonzero(temp)
        frees, temps = int(freed.sum()), len(held)
        nowhere = np.full(max(len(producer), frees, temps), -1, dtype=np.intp)
        return cls(
            at_start=np.concatenate((producer, nowhere[:frees], held, nowhere[:temps])).astype(np.intp),
            at_end=np.concatenate((nowhere[: len(producer)], consumer[freed], nowhere[:temps], held)).astype(np.intp),
            deltas=np.concatenate((size, -size[freed], temp[held], -temp[held])),
            kinds=np.concatenate((kind, kind[freed], np.full(2 * len(held), _TEMPORARY, dtype=np.intp))),
        )

    @property
    def nbytes(self) -> int:
        """The arrays' own bytes: what a cache keeping these events holds."""
        return self.at_start.nbytes + self.at_end.nbytes + self.deltas.nbytes + self.kinds.nbytes

    def times(self, call_start: np.ndarray, call_end: np.ndarray) -> np.ndarray:
        """Each event's time, from the calls' times: arrays by call, or (calls x timelines) for many timelines."""
        times = np.zeros((len(self.deltas), *call_start.shape[1:]))
        starts, ends = self.at_start >= 0, self.at_end >= 0
        times[starts] = call_start[self.at_start[starts]]
        times[ends] = call_end[self.at_end[ends]]
        return times

    def order(self, times: np.ndarray) -> np.ndarray:
        """The events in sweep order. Instants closer than a nanosecond are one: a free and an allocation that the
        schedule puts at the same time must not be ordered by floating-point noise (a steady form's repeats add
        the same durations to different times); at one instant frees go first."""
        return np.lexsort((self.deltas > 0, np.round(times, 9)))

    def peak(self, times: np.ndarray, order: np.ndarray | None = None) -> tuple[float, dict[str, float]]:
        """The peak bytes and the bytes by kind at its moment, for one timeline's event times."""
        at_peak = dict.fromkeys((kind.value for kind in TENSOR_KINDS), 0.0)
        if not len(times):
            return 0.0, at_peak
        order = self.order(times) if order is None else order
        level = np.cumsum(self.deltas[order])
        peak = int(np.argmax(level))
        if level[peak] <= 0:
            return 0.0, at_peak
        upto = order[: peak + 1]
        by_kind = np.bincount(self.kinds[upto], weights=self.deltas[upto], minlength=len(TENSOR_KINDS))
        for kind, held_bytes in zip(TENSOR_KINDS, by_kind, strict=True):
            at_peak[kind.value] = float(held_bytes)
        return float(level[peak]), at_peak


LIVENESS_BYTES = 128 * MIB
"""Events of about 2,500 pipeline stages of GPT-3 175B on 1,024 GPUs (~50 KB each, the arrays' own bytes, as a
steady form schedules them): every stage of issue 36's study of 96 configurations, whole steps of those priced
without a steady form included (~64 MB in all), which a second pass over them prices again. A budget short of a
pass's stages keeps none of them for the next pass (least recently used out first)."""
_LIVENESS: ByteBoundedLru[tuple, tuple[TableTensors, CallShape, Liveness]] = ByteBoundedLru(
    "liveness", LIVENESS_BYTES, lambda entry: entry[2].nbytes
)


def _liveness(program: Program, blocks: Sequence[Block]) -> Liveness:
    """The program's events, kept while its tensors are a generator's untouched table and its calls its shape's: a
    workload priced again (on another system, or the steady form's programs on a second visit) reuses them."""
    tensors, shape = program.tensors, program.call_shape()
    if not isinstance(tensors, TableTensors) or not tensors.unmade or shape is None:
        return Liveness.of(program, blocks)
    key = (id(tensors), id(shape), tuple([block.temp_bytes for block in blocks]))
    entry = _LIVENESS.get(key)
    if entry is not None and entry[0] is tensors and entry[1] is shape:
        return entry[2]
    events = Liveness.from_columns(tensors.columns(), shape_array(shape, "block"), blocks)
    _LIVENESS.put(key, (tensors, shape, events))
    return events


def working_set(programs: Sequence[Program], blocks: Sequence[Block], accelerator: AcceleratorSpec) -> float:
    """The step's peak bytes as placed in a tiered memory (`AcceleratorSpec.seconds_per_byte`): the largest rank
    class's peak with its runtime reserve and fragmentation, its calls run one after another. Issue order rather
    than the simulated timeline, because the timeline is what the placement prices: the two differ only by what
    overlapping streams hold at once."""
    peaks = [0.0]
    for program in programs:
        events = Liveness.of(program, blocks)
        calls = np.arange(len(program.calls), dtype=float)
        peak, at_peak = events.peak(events.times(calls, calls + 1))
        peaks.append(with_runtime_reserve(peak, at_peak, accelerator))
    return max(peaks)


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
