"""Busy time of overlapping streams: how long compute runs, how long communication runs, and how much of the
communication no compute hides."""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from numba import njit


def merge(starts: Sequence[float], ends: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [starts[i], ends[i]] as disjoint intervals, sorted; touching intervals become one.

    Sorted by start, an interval opens a new one only if it starts past the furthest end before it: everything up
    to that end is covered already, because the interval that reached that far started no later."""
    s = np.asarray(starts, dtype=float)
    e = np.asarray(ends, dtype=float)
    if not len(s):
        return s, e
    # Stable sorting (timsort) is fast on what callers pass: a few runs that are each already in order.
    return _merged(s, e, np.argsort(s, kind="stable"))


@njit(cache=True)
def _merged(s: np.ndarray, e: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`merge` in one pass over the intervals in `order` (by start); it only compares, so its ends are the inputs'
    own values. `reach` is the furthest end so far, as numpy's maximum.accumulate was."""
    out_s = np.empty(len(s))
    out_e = np.empty(len(s))
    k = 0
    first = order[0]
    start, reach = s[first], e[first]
    for i in range(1, len(order)):
        j = order[i]
        if s[j] > reach:
            out_s[k], out_e[k] = start, reach
            k += 1
            start = s[j]
        if e[j] > reach:
            reach = e[j]
    out_s[k], out_e[k] = start, reach
    return out_s[: k + 1].copy(), out_e[: k + 1].copy()


def split_busy(
    compute_starts: Sequence[float],
    compute_ends: Sequence[float],
    comm_starts: Sequence[float],
    comm_ends: Sequence[float],
) -> tuple[float, float, float]:
    """Seconds of compute, of communication (the union of its streams) and of communication no compute overlaps."""
    return Busy.of(compute_starts, compute_ends, comm_starts, comm_ends).totals


@dataclass(frozen=True, slots=True)
class Busy:
    """A timeline's busy intervals as what `between` reads off: how much compute, communication and hidden
    communication there is before any time.

    Compute runs on one in-order stream, so its intervals never overlap one another: their starts and ends sort
    apart and their lengths add up. Compute seconds before a time are then piecewise linear, flat between
    intervals and rising inside them, with knots that meet carrying one value, so that a communication interval
    between two compute intervals finds exactly no compute. The hidden communication is measured as the overlap
    itself, not as compute + communication - busy, so a step without overlap reports every communication second
    as exposed, exactly.
    """

    knots: np.ndarray
    """Compute interval starts and ends, interleaved in time order."""
    done: np.ndarray
    """Compute seconds by each knot."""
    comm_starts: np.ndarray
    comm_ends: np.ndarray
    """The communication intervals merged (disjoint, in order)."""
    hidden: np.ndarray
    """Per merged communication interval, the compute seconds inside it."""
    totals: tuple[float, float, float]
    """(compute, communication, exposed communication) seconds of the whole timeline."""

    @classmethod
    def of(
        cls,
        compute_starts: Sequence[float],
        compute_ends: Sequence[float],
        comm_starts: Sequence[float],
        comm_ends: Sequence[float],
    ) -> "Busy":
        cs = np.sort(np.asarray(compute_starts, dtype=float), kind="stable")
        ce = np.sort(np.asarray(compute_ends, dtype=float), kind="stable")
        done = np.cumsum(ce - cs)  # compute seconds by the end of each interval
        compute = float(done[-1]) if len(done) else 0.0
        ms, me = merge(comm_starts, comm_ends)
        comm = float((me - ms).sum())
        knots = np.empty(2 * len(cs))
        knots[0::2], knots[1::2] = cs, ce
        values = np.empty(2 * len(cs))
        if len(cs):
            values[0], values[2::2], values[1::2] = 0.0, done[:-1], done
        hidden = np.interp(me, knots, values) - np.interp(ms, knots, values) if len(cs) else np.zeros(len(ms))
        exposed = max(0.0, comm - float(hidden.sum())) if len(cs) and len(ms) else comm
        return cls(knots, values, ms, me, hidden, (compute, comm, exposed))

    def between(self, start: float, end: float) -> tuple[float, float, float]:
        """(compute, communication, exposed communication) seconds from `start` to `end`: the differences of
        what there is before each (`_before`), so a window costs two binary searches, not a pass over the
        timeline."""
        return _between(self.knots, self.done, self.comm_starts, self.comm_ends, self.hidden, start, end)

    def periods(self, lo: float, shift: float) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """`between(lo, lo + shift)` and `between(lo + shift, lo + 2 * shift)`, in one compiled call (`steady`
        asks this of every stage of every form it checks)."""
        both = _windows(self.knots, self.done, self.comm_starts, self.comm_ends, self.hidden, lo, shift)
        return both[:3], both[3:]


def ordered_busy(
    knots: np.ndarray,
    knot_ptr: np.ndarray,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    stream_ptr: np.ndarray,
    cuts: np.ndarray | None = None,
) -> list[tuple[Busy, float]]:
    """Per timeline, `Busy.of` it and its last end (0.0 if it has none), for timelines recorded in order, all in
    one compiled pass: timeline r's compute from knot_ptr[r, 0] to knot_ptr[r, 1] of `knots`, its communication
    stream s's from stream_ptr[r, s] to stream_ptr[r, s + 1] of comm_starts and comm_ends (one call, not one per
    timeline: a scheduler's 8 or 16 classes each paid the call's overhead and its Python).

    `Busy.of` sorts the compute starts and ends and the communication intervals; a scheduler's records come in
    order already: one in-order stream runs a timeline's compute, so its intervals (`knots`: start, end, start,
    ...) follow one another, and each communication stream's intervals settle in that stream's order, so merging
    the streams sorts them. The pass checks that order and leaves a timeline not so ordered (or not finite) to
    `Busy.of`: the values are `Busy.of`'s either way. The knots are kept, not copied (each Busy's are a view).

    With `cuts` (per timeline (a, b), a >= b for none), each timeline is measured without the intervals inside
    (a, b) (`_kept`), and its totals are its busy seconds outside (a, b) (`_outside`): `steady` cuts out periods
    of a stretch it has checked to repeat, and adds them back as it adds the step's further periods. Its Busy
    reads as the whole timeline's up to a, all that `steady` reads of it."""
    if cuts is not None:
        knots, knot_ptr, comm_starts, comm_ends, stream_ptr = _kept(
            knots, knot_ptr, comm_starts, comm_ends, stream_ptr, cuts[:, 0], cuts[:, 1]
        )
    done, merged_starts, merged_ends, hidden, totals, counts = _ordered(
        knots, knot_ptr, comm_starts, comm_ends, stream_ptr
    )
    if cuts is not None:
        _outside_all(knots, knot_ptr, done, merged_starts, merged_ends, hidden, stream_ptr[:, 0], counts, totals, cuts)
    out = []
    firsts, lasts = stream_ptr[:, 0].tolist(), stream_ptr[:, -1].tolist()
    for (k0, k1), m0, m1, count, (compute, comm, exposed, latest) in zip(
        knot_ptr.tolist(), firsts, lasts, counts.tolist(), totals.tolist(), strict=True
    ):
        if count < 0:
            starts, ends = knots[k0:k1:2], knots[k0 + 1 : k1 : 2]
            latest = max(float(ends.max(initial=0.0)), float(comm_ends[m0:m1].max(initial=0.0)))
            busy = Busy.of(starts, ends, comm_starts[m0:m1], comm_ends[m0:m1])
            if cuts is not None and cuts[len(out), 0] < cuts[len(out), 1]:
                fields = busy.knots, busy.done, busy.comm_starts, busy.comm_ends, busy.hidden
                busy = replace(busy, totals=_outside(*fields, *busy.totals[:2], *cuts[len(out)].tolist()))
            out.append((busy, latest))
            continue
        end = m0 + count
        merged = merged_starts[m0:end], merged_ends[m0:end], hidden[m0:end]
        out.append((Busy(knots[k0:k1], done[k0:k1], *merged, (compute, comm, exposed)), latest))
    return out


@njit(cache=True)
def _outside_all(
    knots: np.ndarray,
    knot_ptr: np.ndarray,
    done: np.ndarray,
    merged_starts: np.ndarray,
    merged_ends: np.ndarray,
    hidden: np.ndarray,
    firsts: np.ndarray,
    counts: np.ndarray,
    totals: np.ndarray,
    cuts: np.ndarray,
) -> None:
    """`_outside` into `_ordered`'s totals of each timeline it measured (count >= 0) with a cut, in one call."""
    for r in range(len(knot_ptr)):
        if counts[r] >= 0 and cuts[r, 0] < cuts[r, 1]:
            k0, k1, m0, m1 = knot_ptr[r, 0], knot_ptr[r, 1], firsts[r], firsts[r] + counts[r]
            fields = knots[k0:k1], done[k0:k1], merged_starts[m0:m1], merged_ends[m0:m1], hidden[m0:m1]
            totals[r, 0], totals[r, 1], totals[r, 2] = _outside(
                *fields, totals[r, 0], totals[r, 1], cuts[r, 0], cuts[r, 1]
            )


@njit(cache=True)
def _outside(
    knots: np.ndarray,
    done: np.ndarray,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    hidden: np.ndarray,
    compute: float,
    comm: float,
    a: float,
    b: float,
) -> tuple[float, float, float]:
    """(compute, communication, exposed) seconds outside (a, b) of a timeline, from the Busy fields and the
    compute and communication totals of its intervals less those inside (a, b): their totals less what they have
    between a and b (each side read by `_before`; the hidden seconds summed as `_ordered_one` sums them),
    exposed = communication - hidden, clipped at 0 on the totals only. Outside (a, b) the busy seconds are the
    whole timeline's: an interval that reaches either side is kept, and the union and its hidden seconds on a
    side read only intervals that reach into it."""
    at_a = _before(knots, done, comm_starts, comm_ends, hidden, a)
    at_b = _before(knots, done, comm_starts, comm_ends, hidden, b)
    covered = 0.0 + pairwise_sum(hidden) if len(knots) else 0.0
    comm = comm - (at_b[1] - at_a[1])
    exposed = comm - (covered - (at_b[2] - at_a[2]))
    return compute - (at_b[0] - at_a[0]), comm, exposed if exposed > 0.0 else 0.0


@njit(cache=True)
def _kept(
    knots: np.ndarray,
    knot_ptr: np.ndarray,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    stream_ptr: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`ordered_busy`'s arguments less, per timeline r and stream (its compute one first), the intervals inside
    (a[r], b[r]) that `_inside` finds, the rest in their order. Found first, then copied into arrays of the size
    kept: fresh arrays of the whole size cost more in page faults than the copying.

    Strictly inside: what the window check reads up to a then finds every merged interval it reads ended, under
    way or not yet begun as in the whole timeline, so it reads the same values to the bit."""
    runs, streams = len(knot_ptr), stream_ptr.shape[1] - 1
    left = np.empty((runs, streams + 1, 2), dtype=np.int64)  # per stream, [i0, i1) in the whole arrays
    n = m = 0
    for r in range(runs):
        k0, k1 = knot_ptr[r, 0], knot_ptr[r, 1]
        i0, i1 = _inside(knots[k0:k1:2], knots[k0 + 1 : k1 : 2], a[r], b[r])
        left[r, 0, 0], left[r, 0, 1] = k0 + 2 * i0, k0 + 2 * i1
        n += k1 - k0 - 2 * (i1 - i0)
        for s in range(streams):
            s0, s1 = stream_ptr[r, s], stream_ptr[r, s + 1]
            i0, i1 = _inside(comm_starts[s0:s1], comm_ends[s0:s1], a[r], b[r])
            left[r, s + 1, 0], left[r, s + 1, 1] = s0 + i0, s0 + i1
            m += s1 - s0 - (i1 - i0)
    out_knots, out_starts, out_ends = np.empty(n), np.empty(m), np.empty(m)
    out_knot_ptr, out_stream_ptr = np.empty_like(knot_ptr), np.empty_like(stream_ptr)
    n = m = 0
    for r in range(runs):
        out_knot_ptr[r, 0] = n
        for lo, hi in ((knot_ptr[r, 0], left[r, 0, 0]), (left[r, 0, 1], knot_ptr[r, 1])):
            out_knots[n : n + hi - lo] = knots[lo:hi]
            n += hi - lo
        out_knot_ptr[r, 1] = n
        for s in range(streams):
            out_stream_ptr[r, s] = m
            for lo, hi in ((stream_ptr[r, s], left[r, s + 1, 0]), (left[r, s + 1, 1], stream_ptr[r, s + 1])):
                out_starts[m : m + hi - lo] = comm_starts[lo:hi]
                out_ends[m : m + hi - lo] = comm_ends[lo:hi]
                m += hi - lo
        out_stream_ptr[r, streams] = m
    return out_knots, out_knot_ptr, out_starts, out_ends, out_stream_ptr


@njit(cache=True)
def _inside(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> tuple[int, int]:
    """[i0, i1) of a stream's intervals inside (a, b): from the first that starts after a to the first that ends
    at or after b, by binary searches. That relies on the stream's starts and ends both rising, as the engine
    records them (an op starts once its stream's previous op has ended, `engine_kernel.drive`; a p2p op holds
    its stream until it settles); reading every interval to check it cost as much as the cut saved, so only
    the run's first start and last end are checked (nothing is left out where they are not inside)."""
    i0 = np.searchsorted(starts, a, side="right")
    i1 = max(i0, np.searchsorted(ends, b, side="left"))
    if i1 == i0 or not (a < starts[i0] and ends[i1 - 1] < b):
        return i0, i0
    return i0, i1


@njit(cache=True)
def _ordered(
    knots: np.ndarray, knot_ptr: np.ndarray, comm_starts: np.ndarray, comm_ends: np.ndarray, stream_ptr: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`ordered_busy`'s pass: Busy's done, comm_starts, comm_ends and hidden, each laid out as the timelines' knots
    or communication intervals (a timeline's merged intervals from its first communication interval's place on),
    per timeline (compute, communication, exposed, last end), and per timeline how many merged intervals it has,
    or -1 where its intervals were not in the order this relies on (its values are then unset)."""
    done = np.empty(len(knots))
    merged_starts = np.empty(len(comm_starts))
    merged_ends = np.empty(len(comm_starts))
    hidden = np.zeros(len(comm_starts))
    totals = np.zeros((len(knot_ptr), 4))
    counts = np.full(len(knot_ptr), -1, dtype=np.int64)
    for r in range(len(knot_ptr)):
        k0, k1, m0 = knot_ptr[r, 0], knot_ptr[r, 1], stream_ptr[r, 0]
        own = knots[k0:k1]
        if _running_compute(own, done[k0:k1]):
            counts[r] = _ordered_one(
                own,
                done[k0:k1],
                comm_starts,
                comm_ends,
                stream_ptr[r],
                merged_starts[m0:],
                merged_ends[m0:],
                hidden[m0:],
                totals[r],
            )
    return done, merged_starts, merged_ends, hidden, totals, counts


@njit(cache=True)
def _ordered_one(
    knots: np.ndarray,
    done: np.ndarray,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    stream_ptr: np.ndarray,
    merged_starts: np.ndarray,
    merged_ends: np.ndarray,
    hidden: np.ndarray,
    totals: np.ndarray,
) -> int:
    """One timeline of `_ordered` whose compute seconds (`done`) are in: its merged intervals, their hidden
    seconds and its totals into the arrays given; how many merged intervals, or -1 if its streams do not rise.

    Every float operation is `Busy.of`'s: the running compute sum as np.cumsum adds, np.interp's search and
    formula, numpy's pairwise summation."""
    count = _union_of_streams(comm_starts, comm_ends, stream_ptr, merged_starts, merged_ends)
    if count < 0:
        return count
    starts, ends = merged_starts[:count], merged_ends[:count]
    _hidden(knots, done, starts, ends, hidden)
    comm = 0.0 + pairwise_sum(ends - starts)
    exposed = comm
    if len(knots) and count:
        exposed = comm - (0.0 + pairwise_sum(hidden[:count]))
        exposed = exposed if exposed > 0.0 else 0.0
    last = knots[-1] if len(knots) and knots[-1] > 0.0 else 0.0
    if count and ends[-1] > last:
        last = ends[-1]
    totals[0], totals[1], totals[2], totals[3] = done[-1] if len(knots) else 0.0, comm, exposed, last
    return count


@njit(cache=True)
def _running_compute(knots: np.ndarray, done: np.ndarray) -> bool:
    """Busy's done (compute seconds by each knot, summed as np.cumsum does), if the knots rise and are finite."""
    compute = previous = 0.0
    for k in range(0, len(knots), 2):
        s, e = knots[k], knots[k + 1]
        if not ((k == 0 or previous <= s) and s <= e < np.inf):
            return False
        previous = e
        done[k] = compute
        compute = e - s if k == 0 else compute + (e - s)
        done[k + 1] = compute
    return True


@njit(cache=True)
def _union_of_streams(
    starts: np.ndarray, ends: np.ndarray, stream_ptr: np.ndarray, out_starts: np.ndarray, out_ends: np.ndarray
) -> int:
    """`merge`'s intervals, into out_starts and out_ends, from streams whose intervals each start in order; how
    many, or -1 where a stream's intervals do not rise or are not finite.

    The streams are merged by start: the stream whose next interval starts first takes every interval up to the
    next stream's start. The union does not depend on the order of intervals that start together, so any order
    of ties gives `_merged`'s intervals."""
    streams = len(stream_ptr) - 1
    head = np.empty(streams, dtype=np.int64)
    stop = np.empty(streams, dtype=np.int64)
    active = 0
    for s in range(streams):
        if stream_ptr[s] < stream_ptr[s + 1]:
            head[active], stop[active] = stream_ptr[s], stream_ptr[s + 1]
            active += 1
    count = 0
    start = reach = 0.0
    while active:
        pick = 0
        for a in range(1, active):
            if starts[head[a]] < starts[head[pick]]:
                pick = a
        bound = np.inf
        for a in range(active):
            if a != pick and starts[head[a]] < bound:
                bound = starts[head[a]]
        j = head[pick]
        while True:
            s, e = starts[j], ends[j]
            if not (s <= e < np.inf):
                return -1
            if count == 0:
                start, reach = s, e
                count = 1
            else:
                if s > reach:
                    out_starts[count - 1], out_ends[count - 1] = start, reach
                    count += 1
                    start = s
                if e > reach:
                    reach = e
            j += 1
            if j == stop[pick]:
                active -= 1
                head[pick], stop[pick] = head[active], stop[active]
                break
            if starts[j] < s:
                return -1
            if starts[j] > bound:
                head[pick] = j
                break
    if count:
        out_starts[count - 1], out_ends[count - 1] = start, reach
    return count


@njit(cache=True)
def _hidden(knots: np.ndarray, done: np.ndarray, starts: np.ndarray, ends: np.ndarray, hidden: np.ndarray) -> None:
    """Into hidden, np.interp(ends, knots, done) - np.interp(starts, knots, done) for disjoint intervals in order,
    all finite: the starts and ends rise in turn, so one forward walk finds their knots (the last at or before
    each, as numpy's search does); numpy's cases and formula at each. Without knots, hidden is left as it is."""
    n = len(knots)
    if not n:
        return
    j = -1
    before = 0.0
    for side in range(2 * len(starts)):
        x = ends[side // 2] if side & 1 else starts[side // 2]
        while j + 1 < n and knots[j + 1] <= x:
            j += 1
        if j < 0:
            value = done[0]
        elif j == n - 1 or knots[j] == x:
            value = done[j]
        else:  # np.interp's formula; its retries where that gives nan need values that are not finite
            slope = (done[j + 1] - done[j]) / (knots[j + 1] - knots[j])
            value = slope * (x - knots[j]) + done[j]
        if side & 1:
            hidden[side // 2] = value - before
        else:
            before = value


@njit(cache=True)
def pairwise_sum(a: np.ndarray) -> float:
    """a.sum() as numpy adds it, less its initial 0.0 (np.add.reduce's pairwise_sum: eight running sums over
    blocks of up to 128 values, the sums of halves added above that; tests/test_compiled_busy.py checks it against
    the installed numpy). numpy recurses; numba segfaults loading a recursive function from its disk cache, so
    the halves are walked with a stack (left half, right half, add)."""
    if len(a) <= 128:
        return _block_sum(a, 0, len(a))
    frames = np.empty((64, 3), dtype=np.int64)  # (start, length, halves done); a 2**64-long array needs fewer
    sums = np.empty(64)
    frames[0, 0], frames[0, 1], frames[0, 2] = 0, len(a), 0
    depth, done = 1, 0
    while depth:
        start, length, halves = frames[depth - 1, 0], frames[depth - 1, 1], frames[depth - 1, 2]
        if length <= 128:
            sums[done] = _block_sum(a, start, length)
            done += 1
            depth -= 1
        elif halves == 2:
            sums[done - 2] = sums[done - 2] + sums[done - 1]
            done -= 1
            depth -= 1
        else:
            half = length // 2
            half -= half % 8
            frames[depth - 1, 2] = halves + 1
            frames[depth, 0] = start if halves == 0 else start + half
            frames[depth, 1] = half if halves == 0 else length - half
            frames[depth, 2] = 0
            depth += 1
    return sums[0]


@njit(cache=True)
def _block_sum(a: np.ndarray, lo: int, n: int) -> float:
    """numpy's pairwise_sum of at most 128 values: one running sum below 8, else eight."""
    if n < 8:
        res = -0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = lo + 8
    stop = lo + n - n % 8
    while i < stop:
        r0, r1, r2, r3 = r0 + a[i], r1 + a[i + 1], r2 + a[i + 2], r3 + a[i + 3]
        r4, r5, r6, r7 = r4 + a[i + 4], r5 + a[i + 5], r6 + a[i + 6], r7 + a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < lo + n:
        res += a[i]
        i += 1
    return res


@njit(cache=True)
def _between(
    knots: np.ndarray,
    done: np.ndarray,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    hidden: np.ndarray,
    start: float,
    end: float,
) -> tuple[float, float, float]:
    """`Busy.between`: compute, communication and exposed communication seconds from start to end."""
    a = _before(knots, done, comm_starts, comm_ends, hidden, start)
    b = _before(knots, done, comm_starts, comm_ends, hidden, end)
    comm = b[1] - a[1]
    exposed = comm - (b[2] - a[2])
    return b[0] - a[0], comm, exposed if exposed > 0.0 else 0.0


@njit(cache=True)
def _windows(
    knots: np.ndarray,
    done: np.ndarray,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    hidden: np.ndarray,
    lo: float,
    shift: float,
) -> tuple[float, float, float, float, float, float]:
    """`Busy.periods`: the windows from lo to lo + shift and from there to lo + 2 * shift of the Busy with these
    fields, each as `_between` gives it, the moment between them read once."""
    a = _before(knots, done, comm_starts, comm_ends, hidden, lo)
    b = _before(knots, done, comm_starts, comm_ends, hidden, lo + shift)
    c = _before(knots, done, comm_starts, comm_ends, hidden, lo + 2 * shift)
    first_comm, second_comm = b[1] - a[1], c[1] - b[1]
    first_exposed, second_exposed = first_comm - (b[2] - a[2]), second_comm - (c[2] - b[2])
    return (
        b[0] - a[0],
        first_comm,
        first_exposed if first_exposed > 0.0 else 0.0,
        c[0] - b[0],
        second_comm,
        second_exposed if second_exposed > 0.0 else 0.0,
    )


@njit(cache=True)
def _before(
    knots: np.ndarray, done: np.ndarray, comm_starts: np.ndarray, comm_ends: np.ndarray, hidden: np.ndarray, t: float
) -> tuple[float, float, float]:
    """Compute, communication and hidden communication seconds before t, of the Busy with these fields: compute
    by np.interp over the knots (`_interp`), the merged communication intervals ended by t (numpy's pairwise sums
    of theirs and their hidden seconds), and the one under way at t, if any, up to t."""
    compute = _interp(t, knots, done) if len(knots) else 0.0
    whole = np.searchsorted(comm_ends, t, side="right")
    comm = 0.0 + pairwise_sum(comm_ends[:whole] - comm_starts[:whole])
    covered = 0.0 + pairwise_sum(hidden[:whole])
    if whole < len(comm_starts) and comm_starts[whole] < t:  # the one under way
        start = comm_starts[whole]
        comm += t - start
        if len(knots):
            covered += compute - _interp(start, knots, done)
    return compute, comm, covered


@njit(cache=True)
def _interp(x: float, xp: np.ndarray, fp: np.ndarray) -> float:
    """np.interp(x, xp, fp) for one x and rising xp: its search (the last knot at or before x) and its cases and
    formula, its retries where the formula gives nan included."""
    if np.isnan(x):
        return x
    j = np.searchsorted(xp, x, side="right") - 1
    if j < 0:
        return fp[0]
    if j == len(xp) - 1 or xp[j] == x:
        return fp[j]
    slope = (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j])
    value = slope * (x - xp[j]) + fp[j]
    if np.isnan(value):
        value = slope * (x - xp[j + 1]) + fp[j + 1]
        if np.isnan(value) and fp[j] == fp[j + 1]:
            value = fp[j]
    return value
