"""The batch path's compiled loops (numba): a tape evaluated node by node, and busy intervals measured system by
system.

Most replace numpy passes whose figures they keep to the last bit: every float operation is the one the numpy code
made, in its order (max and min as `np.maximum` and `np.minimum`, which return a NaN argument; a running sum added
left to right as `np.cumsum` adds). `measure` keeps `intervals.Busy`'s figures to rounding only (`batch_busy`).
They take plain arrays only, and are cached on disk (`cache=True`), so a process compiles them once per machine.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.base import BaseContext
from numba.core.typing.templates import Signature
from numba.extending import intrinsic

from simulators.analytical.tape import MAX_ADD, MIN, SHARED

_SHIFTS_PER_ITEM = 8
"""How far an insertion sort may shift items (per item) before the row is sorted from scratch instead: the rows
come nearly in order (`batch_busy.Spans.ordered`), which an insertion sort finishes in one pass, but a system
whose intervals run in another order would make it quadratic."""

_AHEAD = 8
"""How many intervals ahead `_gather` asks for the rows it will read: their rows lie scattered over the values,
where the processor does not foresee the reads; fetched ahead, a gather takes half the time (GPT-3 175B tp4 pp8,
anything from 4 to 32 alike)."""


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
    more than the arithmetic of a few hundred systems. A node is one pass over the systems per argument after its
    first, the duration added in the last where it can be (a MAX_ADD of two, the most common node of several), since
    the values far exceed the caches: folded through a scratch row, such a node took three passes, and the tape
    evaluated 15-20% slower (GPT-3 175B)."""
    rows, systems = values.shape
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
        elif hi - lo == 2 and k == MAX_ADD:  # most nodes of many arguments: one pass
            y = args[lo + 1]
            for s in range(systems):
                values[row, s] = durations[c, s] + _later(values[x, s], values[y, s])
        else:  # the earliest or latest of the arguments folded in the row itself, then the duration added
            for at in range(lo + 1, hi):
                y = args[at]
                if k == MIN:
                    for s in range(systems):
                        values[row, s] = _earlier(values[x, s], values[y, s])
                else:
                    for s in range(systems):
                        values[row, s] = _later(values[x, s], values[y, s])
                x = row
            if k == MAX_ADD:
                for s in range(systems):
                    values[row, s] = durations[c, s] + values[row, s]


@njit(cache=True)
def _later(a: float, b: float) -> float:
    """np.maximum(a, b): the later, a NaN if either is."""
    return a if a >= b or a != a else b


@njit(cache=True)
def _earlier(a: float, b: float) -> float:
    """np.minimum(a, b): the earlier, a NaN if either is."""
    return a if a <= b or a != a else b


@njit(cache=True)
def measure(
    values: np.ndarray,
    durations: np.ndarray,
    compute: np.ndarray,
    comm: np.ndarray,
    compute_calls: np.ndarray,
    comm_calls: np.ndarray,
    moments: np.ndarray,
    blocks: np.ndarray,
    wanted: np.ndarray,
    cuts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """`intervals.Busy` on each system (values: rows x systems): the (compute, communication, hidden
    communication) seconds (3 x systems), and the (compute, communication, hidden communication) seconds before
    each moment (moments x 3 x systems), as `Busy._before` reads them. compute, comm: the intervals as rows, 3 x
    intervals each (`batch_busy.Spans`): an interval starts at values[row 0] less durations[row 1] (nothing taken
    where that is the last, zero row) and ends at values[row 2]. The compute intervals are one stream's, disjoint
    and in order; the communication starts and ends are sorted each on its own (they need not pair up: only the
    union is read, `batch_busy`), best given in the order most systems keep. `blocks`: where each block of
    systems gathered together starts, and where the last ends: a block's intervals stay in the processor's cache
    while every figure is measured from them, so each interval's times are gathered once. Each system's figures
    are its own whatever the blocks. `wanted`: which systems to measure; the others' figures are left 0 (a block is
    gathered only from its first wanted system to its last). compute_calls, comm_calls: the calls of the spans
    (`batch_busy.Spans`); `cuts` (2 x systems): per system a run of calls [from, to) whose intervals may be left
    out (none where to <= from; `batch_busy.Cut` says why and corrects the totals): the intervals of the calls in
    every wanted system's run of a block are neither gathered nor sorted (`_kept`)."""
    n, m, systems = compute.shape[1], comm.shape[1], values.shape[1]
    moment_count = moments.shape[0]
    totals = np.zeros((3, systems))
    before = np.zeros((moment_count, 3, systems))
    block = 0
    for b in range(len(blocks) - 1):
        block = max(block, blocks[b + 1] - blocks[b])
    compute_starts, done = np.empty((block, n)), np.empty((block, n + 1))
    comm_starts, comm_ends = np.empty((block, m)), np.empty((block, m))
    merged_starts, merged_ends, compute_at = np.empty(m), np.empty(m), np.empty(m)
    comm_by, hidden_by = np.empty(m + 1), np.empty(m + 1)  # running sums over the merged intervals
    for b in range(len(blocks) - 1):
        lo, hi = blocks[b], blocks[b + 1]
        while lo < hi and not wanted[lo]:
            lo += 1
        while hi > lo and not wanted[hi - 1]:
            hi -= 1
        if lo == hi:
            continue
        width = hi - lo
        first, last = _common(cuts, lo, hi, wanted)
        kept, kept_comm = _kept(compute, compute_calls, first, last), _kept(comm, comm_calls, first, last)
        count_b, count_m = kept.shape[1], kept_comm.shape[1]
        _gather(values, durations, kept, lo, width, compute_starts, done, True)
        _gather(values, durations, kept_comm, lo, width, comm_starts, comm_ends, False)
        for j in range(width):
            s = lo + j
            if not wanted[s]:
                continue
            starts, done_j = compute_starts[j, :count_b], done[j, : count_b + 1]
            count = _merged(comm_starts[j, :count_m], comm_ends[j, :count_m], merged_starts, merged_ends)
            comm_by[0] = hidden_by[0] = 0.0
            at = 0  # the compute intervals started by the time reached: both walks go forward
            for k in range(count):
                at = _started(starts, merged_starts[k], at)
                compute_at[k] = _compute_before(starts, done_j, at, merged_starts[k])
                at = _started(starts, merged_ends[k], at)
                inside = _compute_before(starts, done_j, at, merged_ends[k]) - compute_at[k]
                comm_by[k + 1] = comm_by[k] + (merged_ends[k] - merged_starts[k])
                hidden_by[k + 1] = hidden_by[k] + inside
            totals[0, s], totals[1, s], totals[2, s] = done_j[count_b], comm_by[count], hidden_by[count]
            for k in range(moment_count):
                t = moments[k, s]
                compute_t = _compute_before(starts, done_j, _at_or_before(starts, count_b, t), t)
                whole = _at_or_before(merged_ends, count, t)
                comm_t, hidden_t = comm_by[whole], hidden_by[whole]
                if whole < count and merged_starts[whole] < t:  # the merged interval under way, up to t
                    comm_t += t - merged_starts[whole]
                    hidden_t += compute_t - compute_at[whole]
                before[k, 0, s], before[k, 1, s], before[k, 2, s] = compute_t, comm_t, hidden_t
    return totals, before


@njit(cache=True)
def _common(cuts: np.ndarray, lo: int, hi: int, wanted: np.ndarray) -> tuple[int, int]:
    """The calls [first, last) inside the cut (`cuts`: each system's run of calls) of every wanted system of lo..hi;
    none where one has no cut."""
    first, last = 0, -1  # none until a wanted system is seen
    for s in range(lo, hi):
        if not wanted[s]:
            continue
        if not cuts[1, s] > cuts[0, s]:
            return 0, 0
        if last < 0:
            first, last = cuts[0, s], cuts[1, s]
        else:
            first, last = max(first, cuts[0, s]), min(last, cuts[1, s])
    return first, last


@njit(cache=True)
def _kept(spans: np.ndarray, calls: np.ndarray, first: int, last: int) -> np.ndarray:
    """The spans (3 x spans) less those whose calls all lie in first..last - 1: the starts (rows 0 and 1) and the
    ends (row 2) each by the calls of their own span (calls: the lowest and the highest of the starts' spans, then
    of the ends' where they differ, `batch_busy.Spans`), as many of each; the spans themselves where none are left
    out."""
    if last <= first:
        return spans
    out = np.empty_like(spans)
    starts = ends = 0
    at = calls.shape[0] - 2  # the ends' spans' calls
    for i in range(spans.shape[1]):
        if calls[0, i] < first or calls[1, i] >= last:
            out[0, starts], out[1, starts] = spans[0, i], spans[1, i]
            starts += 1
        if calls[at, i] < first or calls[at + 1, i] >= last:
            out[2, ends] = spans[2, i]
            ends += 1
    return out[:, :starts]


@njit(cache=True)
def _gather(
    values: np.ndarray,
    durations: np.ndarray,
    spans: np.ndarray,
    lo: int,
    width: int,
    starts: np.ndarray,
    ends: np.ndarray,
    running: bool,
) -> None:
    """The spans' starts on systems lo to lo + width into starts (width x spans), and their ends into ends, or
    with `running` the running sum of their lengths (width x spans + 1: before each, and in all): row by row of
    values, each read once and asked for `_AHEAD` spans before, the systems' sums added side by side."""
    zero = durations.shape[0] - 1
    count = spans.shape[1]
    if running:
        for j in range(width):
            ends[j, 0] = 0.0
    for i in range(count):
        if i + _AHEAD < count:
            for j in range(0, width, 8):  # a cache line holds 8 values
                _prefetch(values, spans[0, i + _AHEAD], lo + j)
                _prefetch(values, spans[2, i + _AHEAD], lo + j)
        a, c, e = spans[0, i], spans[1, i], spans[2, i]
        if c != zero:
            for j in range(width):
                starts[j, i] = values[a, lo + j] - durations[c, lo + j]
        else:
            for j in range(width):
                starts[j, i] = values[a, lo + j]
        if running:
            for j in range(width):
                ends[j, i + 1] = ends[j, i] + (values[e, lo + j] - starts[j, i])
        else:
            for j in range(width):
                ends[j, i] = values[e, lo + j]


@intrinsic
def _prefetch(typingctx: object, array: types.Array, row: types.Integer, column: types.Integer) -> tuple:
    """Ask the processor to fetch the cache line of array[row, column] (a 2-D array of floats), which a later read
    will want (LLVM's llvm.prefetch: for a read, kept in every cache). It changes no value, only when they arrive."""
    signature = types.void(array, types.intp, types.intp)

    def codegen(context: BaseContext, builder: ir.IRBuilder, signature: Signature, args: list) -> object:
        kind = signature.args[0]
        data = context.make_array(kind)(context, builder, args[0])
        at = cgutils.get_item_pointer(context, builder, kind, data, [args[1], args[2]], wraparound=False)
        word = ir.IntType(32)
        fetch = ir.FunctionType(ir.VoidType(), [at.type, word, word, word])
        function = cgutils.get_or_insert_function(builder.module, fetch, "llvm.prefetch.p0")
        builder.call(function, [at, ir.Constant(word, 0), ir.Constant(word, 3), ir.Constant(word, 1)])
        return context.get_dummy_value()

    return signature, codegen


@njit(cache=True)
def _merged(starts: np.ndarray, ends: np.ndarray, merged_starts: np.ndarray, merged_ends: np.ndarray) -> int:
    """The union of intervals as disjoint intervals in order, into merged_starts and merged_ends; how many. The
    starts and ends are sorted here, each on its own: the i-th start opens a new interval exactly when the i
    earliest ends all come before it, and the interval before it then ends at the (i - 1)-th end (`batch_busy`)."""
    count = len(starts)
    if not count:
        return 0
    _sort(starts)
    _sort(ends)
    merged_starts[0] = starts[0]
    k = 0
    for i in range(1, count):
        if starts[i] > ends[i - 1]:
            merged_ends[k] = ends[i - 1]
            k += 1
            merged_starts[k] = starts[i]
    merged_ends[k] = ends[count - 1]
    return k + 1


@njit(cache=True)
def _started(starts: np.ndarray, t: float, at: int) -> int:
    """How many of the compute intervals (in order) start at or before t, counting on from `at` of them."""
    while at < len(starts) and starts[at] <= t:
        at += 1
    return at


@njit(cache=True)
def _at_or_before(times: np.ndarray, count: int, t: float) -> int:
    """How many of the first `count` times (in order) are at or before t: a binary search."""
    lo, hi = 0, count
    while lo < hi:
        middle = (lo + hi) // 2
        if times[middle] <= t:
            lo = middle + 1
        else:
            hi = middle
    return lo


@njit(cache=True)
def _compute_before(starts: np.ndarray, done: np.ndarray, started: int, t: float) -> float:
    """Compute seconds before t, where `started` compute intervals start at or before it (done: the running sum
    of their lengths): those ended, and the one under way up to t. Past an interval's end this is its running sum
    itself, to the bit: done[i] + (t - start) rounds to no less than done[i] + (end - start), which is
    done[i + 1], so that a merged interval between two compute intervals finds exactly none in it."""
    if not started:
        return 0.0
    last = started - 1
    under_way = done[last] + (t - starts[last])
    return under_way if under_way < done[started] else done[started]


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
    float operations of the arrays this replaces (end there - end here - length, in that order); a call neither a
    twin nor just after one changes no run, and is passed over. The loop over the systems has no branch (selects
    only), so that it is compiled to vector instructions: in half the time of one that branched per system (GPT-3
    175B tp8 pp16, in a batch)."""
    systems = start.shape[1]
    length = np.empty(systems)
    for s in range(systems):
        length[s] = start[middle + distance, s] - start[middle, s]
    lo = np.zeros(systems, dtype=np.intp)
    hi = np.zeros(systems, dtype=np.intp)
    run = np.full(systems, -1, dtype=np.intp)  # where each system's current run started, -1 outside one
    calls = len(twin)
    for i in range(calls + 1):
        if i < calls and twin[i]:
            for s in range(systems):
                steady = (abs(start[i + distance, s] - start[i, s] - length[s]) <= tolerance) & (
                    abs(end[i + distance, s] - end[i, s] - length[s]) <= tolerance
                )
                _ended(lo, hi, run, s, i, not steady)
                run[s] = (run[s] if run[s] >= 0 else i) if steady else -1
        elif i > 0 and twin[i - 1]:  # the call after a twin: every run open ends (after any other, none is)
            for s in range(systems):
                _ended(lo, hi, run, s, i, True)
                run[s] = -1
    return length, lo, hi


@njit(cache=True)
def _ended(lo: np.ndarray, hi: np.ndarray, run: np.ndarray, s: int, i: int, ends: bool) -> None:
    """Where system s's run open (if any) `ends` before call i, make it its longest if strictly longer than the
    longest so far (the earliest of equal runs stays), by selects."""
    longer = ends & (run[s] >= 0) & (i - run[s] > hi[s] - lo[s])
    lo[s] = run[s] if longer else lo[s]
    hi[s] = i if longer else hi[s]


@njit(cache=True)
def calls_inside(
    call_start: np.ndarray,
    call_end: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    cut: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    distance: np.ndarray,
    length: np.ndarray,
    tolerance: float,
) -> np.ndarray:
    """Per system (call_start, call_end: calls x systems) that is `cut`, a run of calls [first, after) that all
    start at or after `start` (A) and end at or before `end` (B), 2 x systems, (0, 0) on the others: from the one
    after the last call that starts before A to the first call that ends after B. The caller knows, of each system
    cut, that its calls before lo + distance end by B and those from hi + distance on start after B
    (`steady.spare_periods`), and that its calls lo..hi - 1 recur `distance` calls later one `length` later within
    `tolerance` (its steady run, `longest_steady`).

    Where the period exceeds twice the tolerance, each call of the run therefore starts and ends before its twin
    does: of the windows of `distance` calls from lo on, each starts later than the one before at its earliest
    and ends later at its latest, and every later call of the run is a twin of a twin... of a call in one. So a
    binary search over the windows (`_window_after`) finds the window the call sought is in, and a walk from it
    the call, reading a few windows of a system's calls where walking from the known bounds read the stretch cut,
    most of the run (a few hundred calls on GPT-3 175B at pp 16). The calls are those the walks find."""
    calls, systems = call_start.shape
    out = np.zeros((2, systems), dtype=np.intp)
    window_a = window_b = -1  # the windows the last system's calls were found in: most systems share them
    for s in range(systems):
        if not cut[s]:
            continue
        a, b, low, d = start[s], end[s], lo[s], distance[s]
        windows = (hi[s] - low) // d + 1 if length[s] > 2 * tolerance else 0
        top = hi[s] + d  # calls from it on start after B
        window_a = _window_after(call_start, s, low, d, windows, a, True, window_a)
        c = low + window_a * d - 1 if window_a < windows else top - 1  # calls from there to top start at or after A
        while c >= 0 and not call_start[c, s] < a:
            c -= 1
        out[0, s] = c + 1
        window_b = _window_after(call_end, s, low, d, windows, b, False, window_b)
        c = max(low + d, low + window_b * d)  # calls before it end by B
        while c < calls and not call_end[c, s] > b:
            c += 1
        out[1, s] = c
    return out


@njit(cache=True)
def _window_after(
    times: np.ndarray, s: int, lo: int, d: int, windows: int, t: float, earliest: bool, guess: int
) -> int:
    """The first of the `windows` windows of d calls from lo on (times[lo + m d : lo + (m + 1) d, s]) whose
    earliest time is at or after t (`earliest`) or whose latest is after t; `windows` if none. Each window's
    earliest and latest times are later than the one's before (`calls_inside`): a binary search, whose first two
    windows read are `guess` and the one next to it that decides whether it is the first."""
    first, last, probes = 0, windows, 0
    while first < last:
        m = guess if probes < 2 and first <= guess < last else (first + last) // 2
        window = times[lo + m * d : lo + (m + 1) * d, s]
        if window.min() >= t if earliest else window.max() > t:
            last, guess = m, m - 1
        else:
            first, guess = m + 1, m + 1
        probes += 1
    return first


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
    with an allocation not before a free (allocates: per event in order). The event's times are one row, chosen
    before the loop over the systems, which has no branch and is compiled to vector instructions."""
    systems = call_start.shape[1]
    keeps = np.ones(systems, dtype=np.bool_)
    previous = np.empty(systems)
    zeros = np.zeros(systems)
    for k in range(len(order)):
        event = order[k]
        a, e = at_start[event], at_end[event]
        times = call_end[e] if e >= 0 else call_start[a] if a >= 0 else zeros
        not_before = k > 0 and allocates[k] >= allocates[k - 1]
        for s in range(systems):
            when = np.rint(times[s] * 1e9) / 1e9
            keeps[s] &= k == 0 or (when > previous[s]) | ((when == previous[s]) & not_before)
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


@njit(cache=True)
def latest(times: np.ndarray) -> np.ndarray:
    """Per column, the largest of `times` (rows x columns) and 0, a NaN where one is: times.max(axis=0,
    initial=0.0), which a max gives in any order, a row at a time over the columns. numpy's reduction runs a loop
    per row; halving the rows in numpy (as this did before) made a temporary array per halving and took twice as
    long (GPT-3 175B tp8 pp16, 1,000 systems: 5.2 ms, 2.7 here)."""
    out = np.zeros(times.shape[1])
    for row in range(times.shape[0]):
        for s in range(times.shape[1]):
            out[s] = _later(out[s], times[row, s])
    return out
