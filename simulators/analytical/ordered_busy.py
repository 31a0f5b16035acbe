"""Busy time of a scheduler's timelines, measured in one compiled pass over the records the scheduler keeps in order
(`ordered_busy`), and read back per timeline or for every timeline at once (`OrderedBusy`); `intervals.Busy` is
what each timeline's figures mean. Apart from `intervals` so that each module stays one file's worth."""

from dataclasses import dataclass, replace

import numpy as np
from numba import njit

from simulators.analytical.intervals import Busy, _before, _windows, pairwise_sum


@dataclass(frozen=True, slots=True)
class OrderedBusy:
    """Timelines' `Busy.of` as `ordered_busy` measures them, their fields joined: timeline r's knots and done from
    knot_ptr[r, 0] to knot_ptr[r, 1], its counts[r] merged communication intervals and their hidden seconds from
    firsts[r]. A timeline's Busy is built only when asked for (`busy`: `steady` reads none), and every timeline's
    windows are one compiled call (`periods`), not one per timeline."""

    knots: np.ndarray
    knot_ptr: np.ndarray
    done: np.ndarray
    merged_starts: np.ndarray
    merged_ends: np.ndarray
    hidden: np.ndarray
    firsts: np.ndarray
    counts: np.ndarray
    """Per timeline, how many merged intervals it has, or -1 where it was left to `Busy.of` (`left`)."""
    totals: np.ndarray
    """Per timeline, (compute, communication, exposed communication, last end): `Busy.totals` and the last end."""
    left: dict[int, Busy]
    """The timelines not recorded in order, each `Busy.of` its intervals."""

    def busy(self, r: int) -> Busy:
        """Timeline r's Busy (its arrays views of the joined ones)."""
        if (found := self.left.get(r)) is not None:
            return found
        (k0, k1), m0 = self.knot_ptr[r].tolist(), int(self.firsts[r])
        m1 = m0 + int(self.counts[r])
        merged = self.merged_starts[m0:m1], self.merged_ends[m0:m1], self.hidden[m0:m1]
        compute, comm, exposed = self.totals[r, :3].tolist()
        return Busy(self.knots[k0:k1], self.done[k0:k1], *merged, (compute, comm, exposed))

    def each(self) -> list[tuple[Busy, float]]:
        """Per timeline, its Busy and its last end."""
        return [(self.busy(r), latest) for r, latest in enumerate(self.totals[:, 3].tolist())]

    def periods(self, lo: np.ndarray, shift: np.ndarray) -> np.ndarray:
        """Per timeline r, `Busy.periods(lo[r], shift[r])` as one row of six: every timeline recorded in order in one
        compiled call (`_periods_all`), the rest by their Busy."""
        out = _periods_all(
            self.knots,
            self.knot_ptr,
            self.done,
            self.merged_starts,
            self.merged_ends,
            self.hidden,
            self.firsts,
            self.counts,
            lo,
            shift,
        )
        for r, busy in self.left.items():
            first, second = busy.periods(float(lo[r]), float(shift[r]))
            out[r] = (*first, *second)
        return out


def ordered_busy(
    knots: np.ndarray,
    knot_ptr: np.ndarray,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    stream_ptr: np.ndarray,
    cuts: np.ndarray | None = None,
) -> OrderedBusy:
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
    firsts = stream_ptr[:, 0]
    if cuts is not None:
        _outside_all(knots, knot_ptr, done, merged_starts, merged_ends, hidden, firsts, counts, totals, cuts)
    left = {}
    for r in np.flatnonzero(counts < 0).tolist():
        (k0, k1), (m0, m1) = knot_ptr[r].tolist(), (int(stream_ptr[r, 0]), int(stream_ptr[r, -1]))
        starts, ends = knots[k0:k1:2], knots[k0 + 1 : k1 : 2]
        latest = max(float(ends.max(initial=0.0)), float(comm_ends[m0:m1].max(initial=0.0)))
        busy = Busy.of(starts, ends, comm_starts[m0:m1], comm_ends[m0:m1])
        if cuts is not None and cuts[r, 0] < cuts[r, 1]:
            fields = busy.knots, busy.done, busy.comm_starts, busy.comm_ends, busy.hidden
            busy = replace(busy, totals=_outside(*fields, *busy.totals[:2], *cuts[r].tolist()))
        totals[r] = (*busy.totals, latest)
        left[r] = busy
    return OrderedBusy(knots, knot_ptr, done, merged_starts, merged_ends, hidden, firsts, counts, totals, left)


@njit(cache=True)
def _periods_all(
    knots: np.ndarray,
    knot_ptr: np.ndarray,
    done: np.ndarray,
    merged_starts: np.ndarray,
    merged_ends: np.ndarray,
    hidden: np.ndarray,
    firsts: np.ndarray,
    counts: np.ndarray,
    lo: np.ndarray,
    shift: np.ndarray,
) -> np.ndarray:
    """`OrderedBusy.periods` of each timeline it measured (count >= 0), in one call (`_windows` of each); the rest
    of the rows are left at 0."""
    out = np.zeros((len(knot_ptr), 6))
    for r in range(len(knot_ptr)):
        if counts[r] >= 0:
            k0, k1, m0, m1 = knot_ptr[r, 0], knot_ptr[r, 1], firsts[r], firsts[r] + counts[r]
            fields = knots[k0:k1], done[k0:k1], merged_starts[m0:m1], merged_ends[m0:m1], hidden[m0:m1]
            window = _windows(*fields, lo[r], shift[r])
            for i in range(6):
                out[r, i] = window[i]
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
