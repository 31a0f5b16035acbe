"""Peak memory of one rank class, swept over its simulated timeline.

A tensor is live from the start of its producer call (from the start of the step when it has none) to the end
of its consumer call (to the end of the step when it has none); every call also holds its block's working
memory while it runs. Pricing liveness on the timeline rather than on issue order is what makes 1F1B hold
fewer micro-batches of activations than GPipe.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple, TypeVar

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
    table_parts,
)
from simulators.analytical.calls import call_array, shape_array

_TEMPORARY = TENSOR_KIND_CODE[TensorKind.TEMPORARY]
_KIND_NAMES = tuple(kind.value for kind in TENSOR_KINDS)
T = TypeVar("T", float, np.ndarray)


def peak_memory(
    program: Program,
    blocks: Sequence[Block],
    call_start: Sequence[float],
    call_end: Sequence[float],
    block_temp: np.ndarray | None = None,
) -> tuple[float, dict[str, float]]:
    """The peak bytes and, at the moment of the peak, the bytes by tensor kind (block working memory counts as
    temporary). Frees at an instant go before allocations at that instant: a call that starts as another ends
    reuses the memory the other released.

    Swept in one compiled pass (`_sweep`) over the tensors each moment allocates or frees (`_Moments`, kept on
    the program's call shape per tensor table: later points of the shape differ only in sizes and times), in
    `Liveness.order`'s order, with `Liveness.peak`'s float operations; sizes, working memory or call times that
    are not finite or are negative take `Liveness`'s own path. block_temp: the blocks' `working_bytes`, which a
    caller sweeping every rank class of a workload reads once for all of them (the same blocks)."""
    moments, own_bytes, table_bytes = _moments_of(program)
    temp = working_bytes(blocks) if block_temp is None else block_temp
    start, end = np.asarray(call_start, dtype=float), np.asarray(call_end, dtype=float)
    by_kind = np.zeros(len(TENSOR_KINDS))
    peak, swept = 0.0, False
    if moments is not None:
        peak, swept = _sweep(*moments, own_bytes, table_bytes, temp, start, end, _TEMPORARY, by_kind)
    if not swept:
        events = Liveness.from_columns(columns_of(program.tensors), call_array(program, "block"), blocks)
        return events.peak(events.times(start, end))
    return peak, dict(zip(_KIND_NAMES, by_kind.tolist(), strict=True))


def working_bytes(blocks: Sequence[Block]) -> np.ndarray:
    """Each block's working memory (temp_bytes), by block."""
    return np.fromiter((block.temp_bytes for block in blocks), float, len(blocks))


class _Moments(NamedTuple):
    """A program's tensors by the moment they are allocated or freed, apart from their sizes and the moments'
    times: what `_sweep` reads besides a point's sizes and times. Moment 0 is the step's start, 1 + c call c's
    start, 1 + calls + c its end."""

    ptr: np.ndarray
    """items[ptr[m]:ptr[m + 1]]: the tensors moment m allocates (m <= calls) or frees, in tensor order."""
    items: np.ndarray
    kind: np.ndarray
    """Per tensor, its code in TENSOR_KINDS."""
    call_blocks: np.ndarray
    order: np.ndarray
    """The moments in the order of the last timeline swept (-1s before the first): `_sweep` checks that a new
    timeline keeps it, which later points of a shape mostly do, rather than sorting again."""

    @staticmethod
    def of(tensors: TensorColumns, call_blocks: np.ndarray) -> "_Moments | None":
        """None if a tensor names a call the program does not have (`Liveness` raises)."""
        producer, consumer, kind, _ = tensors
        calls = len(call_blocks)
        ptr, items, valid = _moment_lists(producer, consumer, calls)
        if not valid:
            return None
        return _Moments(ptr, items, kind.astype(np.int32), call_blocks, np.full(2 * calls + 1, -1, dtype=np.int32))


_STRUCTURE = attrgetter("kind", "producer", "consumer")
_NONE = np.zeros(0)


def _moments_of(program: Program) -> tuple[_Moments | None, np.ndarray, np.ndarray]:
    """The program's `_Moments` and the bytes of its own tensors and of its table's (or of all its tensors, and
    none). Kept on its call shape per tensor table, with its own tensors' kinds, producers and consumers (compared
    rather than hashed: an enum hashes in Python); derived afresh for a program without them (its calls or
    tensors edited after generation)."""
    shape, parts = program.call_shape(), table_parts(program.tensors)
    if shape is None or parts is None:
        tensors = columns_of(program.tensors)
        return _Moments.of(tensors, call_array(program, "block")), _NONE, tensors.bytes
    own, table, table_bytes = parts
    key, structure = ("memory.moments", table), tuple(map(_STRUCTURE, own))
    kept = shape.memo.get(key)
    if kept is None or kept[0] != structure:
        kept = shape.memo[key] = (structure, _Moments.of(columns_of(program.tensors), shape_array(shape, "block")))
    return kept[1], np.array([t.bytes for t in own], dtype=float), table_bytes


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
        temp = working_bytes(blocks)[call_blocks]
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
def _moment_lists(producer: np.ndarray, consumer: np.ndarray, calls: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """`_Moments.ptr` and `.items` by a counting sort of the tensors' moments (each moment's in tensor order), and
    whether every tensor names calls the program has."""
    ptr = np.zeros(2 * calls + 2, dtype=np.int32)
    for t in range(len(producer)):
        if producer[t] >= calls or consumer[t] >= calls:
            return ptr, np.empty(0, dtype=np.int32), False
        ptr[max(producer[t], -1) + 2] += 1
        if consumer[t] >= 0:
            ptr[2 + calls + consumer[t]] += 1
    for m in range(2 * calls + 1):
        ptr[m + 1] += ptr[m]
    items = np.empty(ptr[-1], dtype=np.int32)
    fill = ptr[:-1].copy()
    for t in range(len(producer)):
        m = max(producer[t], -1) + 1
        items[fill[m]] = t
        fill[m] += 1
        if consumer[t] >= 0:
            items[fill[1 + calls + consumer[t]]] = t
            fill[1 + calls + consumer[t]] += 1
    return ptr, items, True


@njit(cache=True)
def _sweep(
    ptr: np.ndarray,
    items: np.ndarray,
    kind: np.ndarray,
    call_blocks: np.ndarray,
    order: np.ndarray,
    own_bytes: np.ndarray,
    table_bytes: np.ndarray,
    block_temp: np.ndarray,
    call_start: np.ndarray,
    call_end: np.ndarray,
    temporary: int,
    by_kind: np.ndarray,
) -> tuple[float, bool]:
    """`Liveness.from_columns`, `times`, `order` and `peak` in one pass: the peak bytes, with the bytes by kind at
    its moment written into `by_kind` (zeros), and whether it could sweep (if not, the caller sweeps with
    `Liveness`): sizes, working memory and call times finite, sizes and working memory not negative.

    Every event happens at a moment (`_Moments`). Sorting the moments, not the events, gives the sweep order: the
    moments are sorted by their rounded times (each call's start and end mostly follow the calls' order, so an
    insertion sort of each is close to one pass; later timelines mostly keep the last one's order, checked in one
    pass), and the moments of one rounded instant give their frees, then their allocations, each in event order:
    `Liveness.order`'s stable lexsort, without sorting the events. An instant with events at one call's end and
    one call's start at most (most are) lists them in event order already; `_instant` merges those of more.

    With no negative sizes, the events that go first at an instant are the frees and those of no bytes, which
    change no sum wherever they go (x + 0.0 == x), and a free never makes a new peak: the level and the bytes by
    kind are summed event by event as np.cumsum and np.bincount would, and the first largest level (np.argmax's)
    kept with the bytes by kind there."""
    calls, moments, own = len(call_blocks), len(order), len(own_bytes)
    if len(call_start) != calls or len(call_end) != calls:
        return 0.0, False
    size = np.empty(own + len(table_bytes))
    size[:own] = own_bytes
    size[own:] = table_bytes
    valid = True
    for t in range(len(size)):  # without an early exit, which keeps the loop from vectorizing
        valid &= (size[t] >= 0.0) & (size[t] < np.inf)
    if not valid:
        return 0.0, False
    temp = np.empty(calls)
    when = np.empty(moments)  # np.round(time, 9): rint(time * 10**9) / 10**9
    busy = np.empty(moments, dtype=np.bool_)  # whether the moment has events
    when[0], busy[0] = 0.0, ptr[1] > 0
    for c in range(calls):
        temp[c] = block_temp[call_blocks[c]]
        if not (0.0 <= temp[c] < np.inf and np.isfinite(call_start[c]) and np.isfinite(call_end[c])):
            return 0.0, False
        when[1 + c] = np.rint(call_start[c] * 1e9) / 1e9
        when[1 + calls + c] = np.rint(call_end[c] * 1e9) / 1e9
        busy[1 + c] = temp[c] != 0 or ptr[2 + c] > ptr[1 + c]
        busy[1 + calls + c] = temp[c] != 0 or ptr[2 + calls + c] > ptr[1 + calls + c]
    if not _in_order(when, order):
        order[:] = np.arange(moments)
        _sort_run(when, order, 0, calls + 1)
        _sort_run(when, order, calls + 1, moments)
        order[:] = _merged_runs(when, order, calls + 1, moments)
    running = np.zeros(len(by_kind))
    spare = np.empty(len(size) + calls, dtype=np.int64)
    level = peak = 0.0
    i = 0
    while i < moments:
        ending = starting = -1  # the instant's moments with events, while it has at most one of each side
        instant = when[order[i]]
        j = i
        while j < moments and when[order[j]] == instant:
            m = order[j]
            if busy[m]:
                if m > calls:
                    ending = m if ending == -1 else -2
                else:
                    starting = m if starting == -1 else -2
            j += 1
        if ending == -2 or starting == -2:
            level, peak = _instant(
                order[i:j], calls, ptr, items, kind, size, temp, temporary, spare, level, peak, running, by_kind
            )
        else:
            if ending >= 0:
                for p in range(ptr[ending], ptr[ending + 1]):
                    level += -size[items[p]]
                    running[kind[items[p]]] += -size[items[p]]
                if temp[ending - 1 - calls] != 0:
                    level += -temp[ending - 1 - calls]
                    running[temporary] += -temp[ending - 1 - calls]
            if starting >= 0:
                for p in range(ptr[starting], ptr[starting + 1]):
                    level += size[items[p]]
                    running[kind[items[p]]] += size[items[p]]
                    if level > peak:
                        peak = _kept(level, running, by_kind)
                if starting > 0 and temp[starting - 1] != 0:
                    level += temp[starting - 1]
                    running[temporary] += temp[starting - 1]
                    if level > peak:
                        peak = _kept(level, running, by_kind)
        i = j
    return peak, True


@njit(cache=True)
def _in_order(keys: np.ndarray, items: np.ndarray) -> bool:
    """Whether items (-1s: not yet ordered) are sorted by keys[item]."""
    ordered = len(items) == 0 or items[0] >= 0
    i = 1
    while ordered and i < len(items):
        ordered = keys[items[i]] >= keys[items[i - 1]]
        i += 1
    return ordered


@njit(cache=True)
def _kept(level: float, running: np.ndarray, by_kind: np.ndarray) -> float:
    """A new peak: the bytes by kind at it copied into `by_kind`."""
    for k in range(len(running)):
        by_kind[k] = running[k]
    return level


@njit(cache=True)
def _instant(
    moments: np.ndarray,
    calls: int,
    ptr: np.ndarray,
    items: np.ndarray,
    kind: np.ndarray,
    size: np.ndarray,
    temp: np.ndarray,
    temporary: int,
    spare: np.ndarray,
    level: float,
    peak: float,
    running: np.ndarray,
    by_kind: np.ndarray,
) -> tuple[float, float]:
    """`_sweep`'s step over the events of several moments at one instant: their tensors' frees, their calls'
    working memory's frees, their tensors' allocations, their calls' working memory's allocations, each in
    tensor or call order (`Liveness.from_columns`'s event order). Returns the level and the peak after them."""
    for freeing in (True, False):
        n = 0
        for m in moments:
            if freeing == (m > calls):
                for p in range(ptr[m], ptr[m + 1]):
                    spare[n] = items[p]
                    n += 1
        _sort_events(spare, 0, n)
        for t in spare[:n]:
            level += -size[t] if freeing else size[t]
            running[kind[t]] += -size[t] if freeing else size[t]
            if level > peak:
                peak = _kept(level, running, by_kind)
        n = 0
        for m in moments:
            c = m - 1 - calls if m > calls else m - 1
            if freeing == (m > calls) and c >= 0 and temp[c] != 0:
                spare[n] = c
                n += 1
        _sort_events(spare, 0, n)
        for c in spare[:n]:
            level += -temp[c] if freeing else temp[c]
            running[temporary] += -temp[c] if freeing else temp[c]
            if level > peak:
                peak = _kept(level, running, by_kind)
    return level, peak


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
    slice costs more), np.sort for many. `_instant` calls it for the few instants with more than one call ending
    or starting (a fraction of one in a stage of GPT-3's studies)."""
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
