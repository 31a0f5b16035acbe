"""Peak memory of one rank class, swept over its simulated timeline.

A tensor is live from the start of its producer call (from the start of the step when it has none) to the end
of its consumer call (to the end of the step when it has none); every call also holds its block's working
memory while it runs. Pricing liveness on the timeline rather than on issue order is what makes 1F1B hold
fewer micro-batches of activations than GPipe.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from numba import njit

from dse.fields import GiB
from dse.system import AcceleratorSpec
from dse.workload import (
    TENSOR_KIND_CODE,
    TENSOR_KINDS,
    Block,
    Program,
    TensorColumns,
    TensorKind,
    columns_of,
)
from simulators.analytical.calls import call_array

_TEMPORARY = TENSOR_KIND_CODE[TensorKind.TEMPORARY]
T = TypeVar("T", float, np.ndarray)


def peak_memory(
    program: Program, blocks: Sequence[Block], call_start: Sequence[float], call_end: Sequence[float]
) -> tuple[float, dict[str, float]]:
    """The peak bytes and, at the moment of the peak, the bytes by tensor kind (block working memory counts as
    temporary). Frees at an instant go before allocations at that instant: a call that starts as another ends
    reuses the memory the other released.

    Swept in one compiled pass over the program's columns (`_sweep`): the events `Liveness` would list, in the
    order `Liveness.order` gives them, with `Liveness.peak`'s float operations; timelines that are not finite
    take `Liveness`'s own path. Nothing is kept between points: the pass costs less than building a program's
    `Liveness` did (0.45 against 0.95 ms a point of issue 36's GPT-3 study, first visits)."""
    tensors = columns_of(program.tensors)
    temp = np.fromiter((block.temp_bytes for block in blocks), float, len(blocks))
    start, end = np.asarray(call_start, dtype=float), np.asarray(call_end, dtype=float)
    by_kind = np.zeros(len(TENSOR_KINDS))
    peak, swept = _sweep(*tensors, call_array(program, "block"), temp, start, end, _TEMPORARY, by_kind)
    if not swept:
        events = Liveness.from_columns(tensors, call_array(program, "block"), blocks)
        return events.peak(events.times(start, end))
    return peak, dict(zip((kind.value for kind in TENSOR_KINDS), by_kind.tolist(), strict=True))


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


@njit(cache=True)
def _sweep(
    producer: np.ndarray,
    consumer: np.ndarray,
    kind: np.ndarray,
    size: np.ndarray,
    call_blocks: np.ndarray,
    block_temp: np.ndarray,
    call_start: np.ndarray,
    call_end: np.ndarray,
    temporary: int,
    by_kind: np.ndarray,
) -> tuple[float, bool]:
    """`Liveness.from_columns`, `times`, `order` and `peak` in one pass: the peak bytes, with the bytes by kind at
    its moment written into `by_kind` (zeros), and whether the timeline and sizes were finite and the calls the
    program's (if not, nothing is written and the caller sweeps with `Liveness`).

    Every event happens at a moment: the step's start (0), a call's start (1 + call) or its end (1 + calls +
    call). Sorting the moments, not the events, gives the sweep order: the moments are bucketed with their events
    in event order, sorted by their rounded times (each call's start and end mostly follow the calls' order, so
    an insertion sort of each is close to one pass), and the moments of one rounded instant give their frees, then
    their allocations, each in event order: `Liveness.order`'s stable lexsort, without sorting the events."""
    calls, tensors = len(call_start), len(size)
    temp = np.empty(calls)
    held = freed = 0
    for c in range(calls):
        temp[c] = block_temp[call_blocks[c]]
        held += temp[c] != 0
    for t in range(tensors):
        if producer[t] >= calls or consumer[t] >= calls:  # not a call of the program: Liveness raises
            return 0.0, False
        freed += consumer[t] >= 0
    events = tensors + freed + 2 * held
    moment = np.empty(events, dtype=np.int64)
    delta = np.empty(events)
    code = np.empty(events, dtype=np.int64)
    e = 0
    for t in range(tensors):  # Liveness.from_columns's order: allocations, frees, working memory's both
        moment[e], delta[e], code[e] = 1 + producer[t] if producer[t] >= 0 else 0, size[t], kind[t]
        e += 1
    for t in range(tensors):
        if consumer[t] >= 0:
            moment[e], delta[e], code[e] = 1 + calls + consumer[t], -size[t], kind[t]
            e += 1
    for side in range(2):
        for c in range(calls):
            if temp[c] != 0:
                moment[e], delta[e], code[e] = 1 + c + side * calls, -temp[c] if side else temp[c], temporary
                e += 1
    moments = 2 * calls + 1
    split = 0
    ptr = np.zeros(moments + 1, dtype=np.int64)
    for e in range(events):
        if not np.isfinite(delta[e]):
            return 0.0, False
        ptr[moment[e] + 1] += 1
    for m in range(moments):
        ptr[m + 1] += ptr[m]
    bucket = np.empty(events, dtype=np.int64)
    fill = ptr[:-1].copy()
    for e in range(events):
        bucket[fill[moment[e]]] = e
        fill[moment[e]] += 1
    when = np.empty(moments)  # np.round(time, 9): rint(time * 10**9) / 10**9, for the moments with events
    used = np.empty(moments, dtype=np.int64)
    count = 0
    if ptr[1] > 0:
        when[0], used[0], count = 0.0, 0, 1
    for m in range(1, moments):
        if ptr[m + 1] > ptr[m]:
            time = call_start[m - 1] if m <= calls else call_end[m - 1 - calls]
            if not np.isfinite(time):
                return 0.0, False
            when[m] = np.rint(time * 1e9) / 1e9
            used[count] = m
            count += 1
        if m == calls:
            split = count
    _sort_run(when, used, 0, split)
    _sort_run(when, used, split, count)
    ordered = _merged_runs(when, used, split, count)
    order = np.empty(events, dtype=np.int64)
    spare = np.empty(events, dtype=np.int64)
    placed = i = 0
    while i < count:  # one instant's moments: its frees, then its allocations, each in event order
        j = i + 1
        while j < count and when[ordered[j]] == when[ordered[i]]:
            j += 1
        frees = allocations = 0
        for k in range(i, j):
            for b in range(ptr[ordered[k]], ptr[ordered[k] + 1]):
                if delta[bucket[b]] > 0:
                    spare[allocations] = bucket[b]
                    allocations += 1
                else:
                    order[placed + frees] = bucket[b]
                    frees += 1
        if j - i > 1:  # a call starting as another ends: mostly one gives the frees, the other the allocations
            for e in range(placed + 1, placed + frees):
                if order[e] < order[e - 1]:
                    _sort_events(order, placed, placed + frees)
                    break
            for e in range(1, allocations):
                if spare[e] < spare[e - 1]:
                    _sort_events(spare, 0, allocations)
                    break
        for a in range(allocations):
            order[placed + frees + a] = spare[a]
        placed += frees + allocations
        i = j
    if not events:
        return 0.0, True
    level = peak = delta[order[0]]
    at = 0
    for p in range(1, events):  # np.cumsum, then np.argmax's first largest
        level += delta[order[p]]
        if level > peak:
            peak, at = level, p
    if peak <= 0:
        return 0.0, True
    for p in range(at + 1):  # np.bincount's running sum per kind
        by_kind[code[order[p]]] += delta[order[p]]
    return peak, True


@njit(cache=True)
def _sort_run(keys: np.ndarray, items: np.ndarray, lo: int, hi: int) -> None:
    """items[lo:hi] sorted by keys[item], in place: an insertion sort, one pass where they are nearly in order;
    where they are not (it has moved them further than a few places each), numpy's mergesort of the rest."""
    budget = 8 * (hi - lo)
    for i in range(lo + 1, hi):
        item, key = items[i], keys[items[i]]
        j = i
        while j > lo and keys[items[j - 1]] > key:
            items[j] = items[j - 1]
            j -= 1
        items[j] = item
        budget -= i - j
        if budget < 0:
            rest = items[lo:hi].copy()
            items[lo:hi] = rest[np.argsort(keys[rest], kind="mergesort")]
            return


@njit(cache=True)
def _sort_events(events: np.ndarray, lo: int, hi: int) -> None:
    """events[lo:hi] sorted in place: an insertion sort for the few events of an instant (numba's np.sort of a
    slice costs more), np.sort for many. Called only where they are out of order: a call from a compiled loop
    costs more than a check (its arrays' reference counts)."""
    if hi - lo > 64:
        events[lo:hi] = np.sort(events[lo:hi])
        return
    for i in range(lo + 1, hi):
        item = events[i]
        j = i
        while j > lo and events[j - 1] > item:
            events[j] = events[j - 1]
            j -= 1
        events[j] = item


@njit(cache=True)
def _merged_runs(keys: np.ndarray, items: np.ndarray, split: int, count: int) -> np.ndarray:
    """items[:split] and items[split:count], each sorted by keys[item], merged into one sorted array."""
    out = np.empty(count, dtype=np.int64)
    a, b = 0, split
    for k in range(count):
        if b == count or (a < split and keys[items[a]] <= keys[items[b]]):
            out[k] = items[a]
            a += 1
        else:
            out[k] = items[b]
            b += 1
    return out


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
    total, reserve, fragmentation = reserved(peak, accelerator.runtime_reserve_GiB, accelerator.fragmentation)
    at_peak[RESERVE] = reserve
    at_peak[FRAGMENTATION] = fragmentation
    return total


def reserved(peak: T, runtime_reserve_GiB: T, fragmentation: T) -> tuple[T, T, T]:
    """(the peak with the runtime's bytes, the reserve's bytes, fragmentation's bytes) of `with_runtime_reserve`,
    for one peak or, as arrays, for many systems at once (`batch`), with the same float operations."""
    reserve = runtime_reserve_GiB * GiB
    fragments = fragmentation * peak
    return peak + reserve + fragments, reserve, fragments
