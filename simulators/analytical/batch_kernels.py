"""The batch path's compiled loops (numba): a tape evaluated node by node, and unions of busy intervals measured
system by system.

They replace numpy passes whose figures they keep to the last bit: every float operation is the one the numpy code
made, in its order (max and min as `np.maximum` and `np.minimum`, which return a NaN argument; a running sum added
left to right as `np.cumsum` adds). They take plain arrays only, and are cached on disk (`cache=True`), so a process
compiles them once per machine.
"""

import numpy as np
from numba import njit

from simulators.analytical.tape import MAX_ADD, MIN, SHARED

_SHIFTS_PER_ITEM = 8
"""How far an insertion sort may shift items (per item) before the row is sorted from scratch instead: the rows
come nearly in order (`batch_busy.Spans.ordered`), which an insertion sort finishes in one pass, but a system
whose intervals run in another order would make it quadratic."""


@njit(cache=True)
def kept(first: np.ndarray, args: np.ndarray, read: np.ndarray) -> np.ndarray:
    """Which nodes `read` depends on, itself included, the constants 0 and 1 too: a sweep from the last node down,
    as every node's arguments come before it. first, args: each node's arguments, args[first[n]:first[n + 1]]."""
    count = len(first) - 1
    flags = np.zeros(count, dtype=np.bool_)
    flags[read] = True
    flags[0] = flags[1] = True
    for node in range(count - 1, 1, -1):
        if flags[node]:
            for at in range(first[node], first[node + 1]):
                flags[args[at]] = True
    return flags


@njit(cache=True)
def evaluate(
    kind: np.ndarray, first: np.ndarray, args: np.ndarray, column: np.ndarray, durations: np.ndarray, values: np.ndarray
) -> None:
    """Fill values (rows x systems) with every row's time on every system, row by row (each row's arguments come
    before it; rows 0 and 1 are the constants 0 and inf). A row starts from its duration (durations[column[row]]);
    MAX_ADD adds the latest of its arguments to it, MIN is the earliest of them, SHARED (arguments start and busy,
    s its duration) is start + s + min(busy - start, s). Plain 2-D indexing throughout: a row view per node costs
    more than the arithmetic of a few hundred systems."""
    rows, systems = values.shape
    latest = np.empty(systems)
    for s in range(systems):
        values[0, s] = 0.0
        values[1, s] = np.inf
    for row in range(2, rows):
        c, lo, hi, k = column[row], first[row], first[row + 1], kind[row]
        x = args[lo]
        if k == SHARED:
            y = args[lo + 1]
            for s in range(systems):
                idle, seconds = values[y, s] - values[x, s], durations[c, s]
                idle = idle if idle <= seconds or idle != idle else seconds
                values[row, s] = values[x, s] + seconds + idle
        elif hi - lo == 1 and k == MAX_ADD:
            for s in range(systems):
                values[row, s] = durations[c, s] + values[x, s]
        elif hi - lo == 1:
            for s in range(systems):
                values[row, s] = values[x, s]
        else:
            for s in range(systems):
                latest[s] = values[x, s]
            for at in range(lo + 1, hi):
                y = args[at]
                if k == MIN:
                    for s in range(systems):
                        a, b = latest[s], values[y, s]
                        latest[s] = a if a <= b or a != a else b
                else:
                    for s in range(systems):
                        a, b = latest[s], values[y, s]
                        latest[s] = a if a >= b or a != a else b
            if k == MAX_ADD:
                for s in range(systems):
                    values[row, s] = durations[c, s] + latest[s]
            else:
                for s in range(systems):
                    values[row, s] = latest[s]


@njit(cache=True)
def measure(
    values: np.ndarray,
    durations: np.ndarray,
    start: np.ndarray,
    column: np.ndarray,
    end: np.ndarray,
    ordered: bool,
    moments: np.ndarray,
    blocks: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals on each system (values: rows x systems): its seconds, and the seconds of it before
    each moment (moments x systems), read from each system's starts and ends sorted each on its own
    (`batch_busy`). An interval's start is values[start] less durations[column] (nothing taken where the column is
    the last, zero row), its end values[end]; starts and ends need not pair up, as only their sorted orders are
    read, and each is best given in the order most systems keep. `ordered`: the starts and ends are sorted and the
    intervals disjoint already. `blocks`: where each block of systems measured together starts, and where the last
    ends (see `_starts_before`)."""
    count, systems = len(start), values.shape[1]
    moment_count = moments.shape[0]
    total = np.zeros(systems)
    before = np.zeros((moment_count, systems))
    if count == 0:
        return total, before
    zero = durations.shape[0] - 1
    block = 0
    for b in range(len(blocks) - 1):
        block = max(block, blocks[b + 1] - blocks[b])
    firsts = np.empty((block, count))
    lasts = np.empty((block, count))
    gaps = np.empty(count)
    for b in range(len(blocks) - 1):
        lo, width = blocks[b], blocks[b + 1] - blocks[b]
        for i in range(count):
            a, c, e = start[i], column[i], end[i]
            if c != zero:
                for j in range(width):
                    firsts[j, i] = values[a, lo + j] - durations[c, lo + j]
            else:
                for j in range(width):
                    firsts[j, i] = values[a, lo + j]
            for j in range(width):
                lasts[j, i] = values[e, lo + j]
        span = -np.inf  # the widest union of the block, as `_starts_before` places the starts
        for j in range(width):
            if not ordered:
                _sort(firsts[j])
                _sort(lasts[j])
            reach = lasts[j, count - 1] - firsts[j, 0]
            span = span if span >= reach or span != span else reach
        span += 1.0
        for j in range(width):
            first, last = firsts[j], lasts[j]
            gaps[0] = 0.0  # the running sum of the gaps: a start after every earlier interval has ended opens one
            for i in range(1, count):
                gap = first[i] - last[i - 1]
                gaps[i] = gaps[i - 1] + (gap if gap >= 0.0 or gap != gap else 0.0)
            total[lo + j] = last[count - 1] - first[0] - gaps[count - 1]
            origin, offset = first[0], j * span
            for k in range(moment_count):
                at = moments[k, lo + j]
                started = _starts_before(first, origin, offset, min(max(at - origin, -0.5), span - 0.5) + offset)
                if started > 0:  # from the first start to the moment, less the gaps before the latest start
                    idle = at - last[started - 1]  # and the part of the gap after it that comes before the moment
                    idle = idle if idle >= 0.0 or idle != idle else 0.0
                    before[k, lo + j] = at - origin - gaps[started - 1] - idle
    return total, before


@njit(cache=True)
def _starts_before(first: np.ndarray, origin: float, offset: float, wanted: float) -> int:
    """How many of the sorted starts come before a moment, compared as the numpy code this loop replaced compared
    them, so as to count the same at a tie within rounding: each start placed at start - origin + offset, the moment at
    `wanted` (moment - origin, clipped to [-0.5, span - 0.5], + offset), where the offset is the system's place in
    its block of systems times the block's span (its widest union + 1 s), the blocks laid side by side for one
    search over all of them. The seconds covered are continuous in the moment, so the count matters only to
    rounding, but to the last bit it does."""
    lo, hi = 0, len(first)
    while lo < hi:
        middle = (lo + hi) // 2
        if first[middle] - origin + offset < wanted:
            lo = middle + 1
        else:
            hi = middle
    return lo


@njit(cache=True)
def _sort(row: np.ndarray) -> None:
    """Sort a row in place: an insertion sort while the row is nearly in order, else a heapsort (times are never
    NaN, so any sort gives the same row; numba's own np.sort would triple the compile time)."""
    budget = _SHIFTS_PER_ITEM * len(row)
    for i in range(1, len(row)):
        item = row[i]
        if not row[i - 1] > item:
            continue
        j = i
        while j > 0 and row[j - 1] > item:
            row[j] = row[j - 1]
            j -= 1
        row[j] = item
        budget -= i - j
        if budget < 0:
            _heapsort(row)
            return


@njit(cache=True)
def _heapsort(row: np.ndarray) -> None:
    count = len(row)
    for top in range(count // 2 - 1, -1, -1):
        _sift(row, top, count)
    for last in range(count - 1, 0, -1):
        row[0], row[last] = row[last], row[0]
        _sift(row, 0, last)


@njit(cache=True)
def _sift(row: np.ndarray, at: int, count: int) -> None:
    """Move row[at] down the max-heap of row[:count] to where it belongs."""
    item = row[at]
    while 2 * at + 1 < count:
        child = 2 * at + 1
        if child + 1 < count and row[child + 1] > row[child]:
            child += 1
        if not row[child] > item:
            break
        row[at] = row[child]
        at = child
    row[at] = item


@njit(cache=True)
def longest_steady(
    twin: np.ndarray, start: np.ndarray, end: np.ndarray, distance: int, middle: int, tolerance: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per system (start, end: calls x systems), the period's length (start[middle + distance] - start[middle])
    and [lo, hi) of the first longest run of `twin` calls that recur `distance` calls later with their start and
    end one length later, within `tolerance` (hi == lo: none). One pass over the calls, the systems inner, with the
    float operations of the arrays this replaces (end there - end here - length, in that order)."""
    systems = start.shape[1]
    length = np.empty(systems)
    for s in range(systems):
        length[s] = start[middle + distance, s] - start[middle, s]
    lo = np.zeros(systems, dtype=np.intp)
    hi = np.zeros(systems, dtype=np.intp)
    run = np.full(systems, -1, dtype=np.intp)  # where each system's current run started, -1 outside one
    calls = len(twin)
    for i in range(calls + 1):
        recurs = i < calls and twin[i]
        for s in range(systems):
            steady = False
            if recurs:
                shift = start[i + distance, s] - start[i, s]
                steady = (
                    abs(shift - length[s]) <= tolerance
                    and abs(end[i + distance, s] - end[i, s] - length[s]) <= tolerance
                )
            if steady:
                if run[s] < 0:
                    run[s] = i
            elif run[s] >= 0:
                if i - run[s] > hi[s] - lo[s]:  # strictly longer: the earliest of equal runs stays
                    lo[s], hi[s] = run[s], i
                run[s] = -1
    return length, lo, hi


@njit(cache=True)
def keeps_order(
    call_start: np.ndarray,
    call_end: np.ndarray,
    at_start: np.ndarray,
    at_end: np.ndarray,
    order: np.ndarray,
    allocates: np.ndarray,
) -> np.ndarray:
    """Per system (call_start, call_end: calls x systems), whether its memory events, taken in `order`, are in
    sweep order (`memory.Liveness.order`): each event's time (its call's start or end, `Liveness.times`; 0 for
    neither) rounded to 9 decimals as np.round rounds (rint(t * 1e9) / 1e9) is after the previous one's, or equal
    with an allocation not before a free (allocates: per event in order)."""
    systems = call_start.shape[1]
    keeps = np.ones(systems, dtype=np.bool_)
    previous = np.empty(systems)
    for k in range(len(order)):
        event = order[k]
        a, e = at_start[event], at_end[event]
        not_before = k > 0 and allocates[k] >= allocates[k - 1]
        for s in range(systems):
            t = 0.0
            if a >= 0:
                t = call_start[a, s]
            if e >= 0:
                t = call_end[e, s]
            when = np.rint(t * 1e9) / 1e9
            if k > 0 and not (when > previous[s] or (when == previous[s] and not_before)):
                keeps[s] = False
            previous[s] = when
    return keeps


@njit(cache=True)
def add_rows(out: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """np.add.at(out, rows, values) for a 2-D out: values' k-th row added to out's row rows[k], in order of k (as
    add.at adds a repeated row), without add.at's per-call cost (which is most of it on a few hundred rows)."""
    for k in range(len(rows)):
        row = rows[k]
        for s in range(out.shape[1]):
            out[row, s] += values[k, s]
