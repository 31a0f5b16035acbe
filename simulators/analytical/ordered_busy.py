"""Busy time of a scheduler's timelines, measured in one compiled pass over the records the scheduler keeps in order
(`ordered_busy`), and read back per timeline or for every timeline at once (`OrderedBusy`); `intervals.Busy` is
what each timeline's figures mean. Apart from `intervals` so that each module stays one file's worth."""

from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np
from numba import njit

from simulators.analytical.intervals import Busy, _before_around, _windows_of, pairwise_sum


@dataclass(frozen=True, slots=True)
class OrderedBusy:
    """Timelines' `Busy.of` as `ordered_busy` measures them, their fields joined: timeline r's knots and done from
    knot_ptr[r, 0] to knot_ptr[r, 1] less those from holes[r, 0] to holes[r, 1] (a cut's, left in place), its
    counts[r] merged communication intervals and their hidden seconds from firsts[r]. A timeline's Busy is built
    only when asked for (`busy`: `steady` reads none), and every timeline's windows are one compiled call
    (`periods`), not one per timeline."""

    knots: np.ndarray
    knot_ptr: np.ndarray
    holes: np.ndarray
    done: np.ndarray
    """Laid out as the knots; in the holes, unset."""
    merged_starts: np.ndarray
    merged_ends: np.ndarray
    hidden: np.ndarray
    firsts: np.ndarray
    counts: np.ndarray
    """Per timeline, how many merged intervals it has, or -1 where it was left to `Busy.of` (`left`)."""
    totals: np.ndarray
    """Per timeline, (compute, communication, exposed communication, last end): `Busy.totals` and the last end."""
    at_cut: np.ndarray
    """Per timeline measured with a cut, its start a and what there is before a (`_before_around`), which the
    window check reads again where its windows end there (`_periods_all`); nan for the rest."""
    left: dict[int, Busy]
    """The timelines not recorded in order, each `Busy.of` its intervals."""

    def busy(self, r: int) -> Busy:
        """Timeline r's Busy (its arrays views of the joined ones, its knots and done copied where cut)."""
        if (found := self.left.get(r)) is not None:
            return found
        (k0, k1), (c0, c1), m0 = self.knot_ptr[r].tolist(), self.holes[r].tolist(), int(self.firsts[r])
        m1 = m0 + int(self.counts[r])
        knots, done = self.knots[k0:k1], self.done[k0:k1]
        if c0 < c1:
            knots, done = (np.concatenate((x[k0:c0], x[c1:k1])) for x in (self.knots, self.done))
        merged = self.merged_starts[m0:m1], self.merged_ends[m0:m1], self.hidden[m0:m1]
        compute, comm, exposed = self.totals[r, :3].tolist()
        return Busy(knots, done, *merged, (compute, comm, exposed))

    def each(self) -> list[tuple[Busy, float]]:
        """Per timeline, its Busy and its last end."""
        return [(self.busy(r), latest) for r, latest in enumerate(self.totals[:, 3].tolist())]

    def periods(self, lo: np.ndarray, shift: np.ndarray) -> np.ndarray:
        """Per timeline r, `Busy.periods(lo[r], shift[r])` as one row of six: every timeline recorded in order in one
        compiled call (`_periods_all`), the rest by their Busy."""
        out = _periods_all(
            self.knots,
            self.knot_ptr,
            self.holes,
            self.done,
            self.merged_starts,
            self.merged_ends,
            self.hidden,
            self.firsts,
            self.counts,
            self.at_cut,
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
    `Busy.of`: the values are `Busy.of`'s either way. The knots are kept, not copied (an uncut Busy's are a view).

    With `cuts` (per timeline (a, b), a >= b for none), each timeline is measured without the intervals inside
    (a, b) (`_inside`: each pass steps over them where they lie, `holes`, rather than reading a copy without
    them), and its totals are its busy seconds outside (a, b) (`_outside`): `steady` cuts out periods of a
    stretch it has checked to repeat, and adds them back as it adds the step's further periods. Its Busy reads
    as the whole timeline's up to a, all that `steady` reads of it."""
    runs = len(knot_ptr)
    measured = _ordered(
        knots, knot_ptr, comm_starts, comm_ends, stream_ptr, np.zeros((runs, 2)) if cuts is None else cuts
    )
    holes, done, merged_starts, merged_ends, hidden, firsts, totals, counts, at_cut = measured
    left = {}
    for r in np.flatnonzero(counts < 0).tolist():
        (k0, k1), (c0, c1) = knot_ptr[r].tolist(), holes[r, 0].tolist()
        own = np.concatenate((knots[k0:c0], knots[c1:k1]))
        spans = [
            piece
            for (s0, s1), (h0, h1) in zip(pairwise(stream_ptr[r].tolist()), holes[r, 1:].tolist(), strict=True)
            for piece in ((s0, h0), (h1, s1))
        ]
        starts, ends = (np.concatenate([x[:0], *(x[lo:hi] for lo, hi in spans)]) for x in (comm_starts, comm_ends))
        latest = max(float(own[1::2].max(initial=0.0)), float(ends.max(initial=0.0)))
        busy = Busy.of(own[0::2], own[1::2], starts, ends)
        if cuts is not None and cuts[r, 0] < cuts[r, 1]:
            n, merged = len(busy.knots), (busy.comm_starts, busy.comm_ends, busy.hidden)
            covered = 0.0 + pairwise_sum(busy.hidden) if n else 0.0
            figures, _ = _outside(busy.knots, busy.done, n, n, *merged, covered, *busy.totals[:2], *cuts[r].tolist())
            busy = replace(busy, totals=figures)
        totals[r] = (*busy.totals, latest)
        left[r] = busy
    return OrderedBusy(
        knots, knot_ptr, holes[:, 0], done, merged_starts, merged_ends, hidden, firsts, counts, totals, at_cut, left
    )


@njit(cache=True)
def _periods_all(
    knots: np.ndarray,
    knot_ptr: np.ndarray,
    holes: np.ndarray,
    done: np.ndarray,
    merged_starts: np.ndarray,
    merged_ends: np.ndarray,
    hidden: np.ndarray,
    firsts: np.ndarray,
    counts: np.ndarray,
    at_cut: np.ndarray,
    lo: np.ndarray,
    shift: np.ndarray,
) -> np.ndarray:
    """`OrderedBusy.periods` of each timeline it measured (count >= 0), in one call (`Busy.periods` of each: what
    there is before lo, lo + shift and lo + 2 * shift, `_windows_of`); the last moment is read off `at_cut` where
    it is the cut's start (`steady` ends the windows there), as `_outside` read it; the rest of the rows are left
    at 0."""
    out = np.zeros((len(knot_ptr), 6))
    for r in range(len(knot_ptr)):
        if counts[r] >= 0:
            k0, k1, m0, m1 = knot_ptr[r, 0], knot_ptr[r, 1], firsts[r], firsts[r] + counts[r]
            fields = knots[k0:k1], done[k0:k1], holes[r, 0] - k0, holes[r, 1] - k0
            merged = merged_starts[m0:m1], merged_ends[m0:m1], hidden[m0:m1]
            end = lo[r] + 2 * shift[r]
            a = _before_around(*fields, *merged, lo[r])
            b = _before_around(*fields, *merged, lo[r] + shift[r])
            c = (
                (at_cut[r, 1], at_cut[r, 2], at_cut[r, 3])
                if end == at_cut[r, 0]
                else _before_around(*fields, *merged, end)
            )
            window = _windows_of(a, b, c)
            for i in range(6):
                out[r, i] = window[i]
    return out


@njit(cache=True)
def _outside(
    knots: np.ndarray,
    done: np.ndarray,
    c0: int,
    c1: int,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    hidden: np.ndarray,
    covered: float,
    compute: float,
    comm: float,
    a: float,
    b: float,
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(compute, communication, exposed) seconds outside (a, b) of a timeline, and what there is before a, from
    the Busy fields (its knots less knots[c0:c1]) and the hidden, compute and communication totals of its
    intervals less those inside (a, b) (`covered`: 0.0 + the hidden seconds' pairwise sum, 0.0 without knots, as
    `_ordered_one` sums them): their totals less what they have between a and b (each side read by
    `_before_around`), exposed = communication - hidden, clipped at 0 on the totals only. Outside (a, b) the busy
    seconds are the whole timeline's: an interval that reaches either side is kept, and the union and its hidden
    seconds on a side read only intervals that reach into it."""
    at_a = _before_around(knots, done, c0, c1, comm_starts, comm_ends, hidden, a)
    at_b = _before_around(knots, done, c0, c1, comm_starts, comm_ends, hidden, b)
    comm = comm - (at_b[1] - at_a[1])
    exposed = comm - (covered - (at_b[2] - at_a[2]))
    return (compute - (at_b[0] - at_a[0]), comm, exposed if exposed > 0.0 else 0.0), at_a


@njit(cache=True)
def _inside(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> tuple[int, int]:
    """[i0, i1) of a stream's intervals inside (a, b): from the first that starts after a to the first that ends
    at or after b, by binary searches. That relies on the stream's starts and ends both rising, as the engine
    records them (an op starts once its stream's previous op has ended, `engine_kernel.drive`; a p2p op holds
    its stream until it settles); reading every interval to check it cost as much as the cut saved, so only
    the run's first start and last end are checked (nothing is left out where they are not inside).

    Strictly inside: what the window check reads up to a then finds every merged interval it reads ended, under
    way or not yet begun as in the whole timeline, so it reads the same values to the bit."""
    i0 = np.searchsorted(starts, a, side="right")
    i1 = max(i0, np.searchsorted(ends, b, side="left"))
    if i1 == i0 or not (a < starts[i0] and ends[i1 - 1] < b):
        return i0, i0
    return i0, i1


@njit(cache=True)
def _ordered(
    knots: np.ndarray,
    knot_ptr: np.ndarray,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    stream_ptr: np.ndarray,
    cuts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`ordered_busy`'s pass: per timeline r and stream (its compute first), the intervals inside its cut
    (cuts[r, 0], cuts[r, 1]) that `_inside` finds, as [h0, h1) in the whole arrays (the compute's knots from h0 to
    h1; none: k1, k1); Busy's done laid out as the knots, and comm_starts, comm_ends and hidden, a timeline's from
    firsts[r] on (as many places as it has communication intervals outside its cut); per timeline (compute,
    communication, exposed, last end), those outside its cut where it has one (`_outside`); and per timeline how
    many merged intervals it has, or -1 where its intervals were not in the order this relies on (its values are
    then unset). One call: the cut is found, stepped over and its totals taken in the same pass."""
    runs, streams = len(knot_ptr), stream_ptr.shape[1] - 1
    holes = np.empty((runs, streams + 1, 2), dtype=np.int64)
    firsts = np.empty(runs, dtype=np.int64)
    m = 0
    for r in range(runs):
        a, b, cut = cuts[r, 0], cuts[r, 1], cuts[r, 0] < cuts[r, 1]
        k0, k1 = knot_ptr[r, 0], knot_ptr[r, 1]
        i0, i1 = _inside(knots[k0:k1:2], knots[k0 + 1 : k1 : 2], a, b) if cut else (0, 0)
        holes[r, 0, 0], holes[r, 0, 1] = (k0 + 2 * i0, k0 + 2 * i1) if i0 < i1 else (k1, k1)
        firsts[r] = m
        for s in range(streams):
            s0, s1 = stream_ptr[r, s], stream_ptr[r, s + 1]
            i0, i1 = _inside(comm_starts[s0:s1], comm_ends[s0:s1], a, b) if cut else (0, 0)
            holes[r, s + 1, 0], holes[r, s + 1, 1] = s0 + i0, s0 + i1
            m += s1 - s0 - (i1 - i0)
    done = np.empty(len(knots))
    merged_starts, merged_ends, hidden = np.empty(m), np.empty(m), np.zeros(m)
    totals = np.zeros((runs, 4))
    counts = np.full(runs, -1, dtype=np.int64)
    at_cut = np.full((runs, 4), np.nan)
    for r in range(runs):
        k0, k1, m0 = knot_ptr[r, 0], knot_ptr[r, 1], firsts[r]
        own, own_done, c0, c1 = knots[k0:k1], done[k0:k1], holes[r, 0, 0] - k0, holes[r, 0, 1] - k0
        if not _running_compute(own, own_done, c0, c1):
            continue
        merged = merged_starts[m0:], merged_ends[m0:], hidden[m0:]
        count, covered = _ordered_one(
            own, own_done, c0, c1, comm_starts, comm_ends, stream_ptr[r], holes[r, 1:], *merged, totals[r]
        )
        counts[r] = count
        if count >= 0 and cuts[r, 0] < cuts[r, 1]:
            fields = merged_starts[m0 : m0 + count], merged_ends[m0 : m0 + count], hidden[m0 : m0 + count]
            figures, at_a = _outside(
                own, own_done, c0, c1, *fields, covered, totals[r, 0], totals[r, 1], cuts[r, 0], cuts[r, 1]
            )
            totals[r, 0], totals[r, 1], totals[r, 2] = figures
            at_cut[r, 0], at_cut[r, 1], at_cut[r, 2], at_cut[r, 3] = cuts[r, 0], *at_a
    return holes, done, merged_starts, merged_ends, hidden, firsts, totals, counts, at_cut


@njit(cache=True)
def _ordered_one(
    knots: np.ndarray,
    done: np.ndarray,
    c0: int,
    c1: int,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    stream_ptr: np.ndarray,
    holes: np.ndarray,
    merged_starts: np.ndarray,
    merged_ends: np.ndarray,
    hidden: np.ndarray,
    totals: np.ndarray,
) -> tuple[int, float]:
    """One timeline of `_ordered` whose compute seconds (`done`) are in: its merged intervals, their hidden
    seconds and its totals into the arrays given; how many merged intervals, or -1 if its streams do not rise,
    and its hidden seconds in all (0.0 without knots; `_outside` reads them too).
    Its knots are these less knots[c0:c1], its streams' intervals less each one's hole.

    Every float operation is `Busy.of`'s: the running compute sum as np.cumsum adds, np.interp's search and
    formula, numpy's pairwise summation."""
    count = _union_of_streams(comm_starts, comm_ends, stream_ptr, holes, merged_starts, merged_ends)
    if count < 0:
        return count, 0.0
    starts, ends = merged_starts[:count], merged_ends[:count]
    _hidden(knots, done, c0, c1, starts, ends, hidden)
    comm = 0.0 + pairwise_sum(ends - starts)
    exposed = comm
    kept = len(knots) - (c1 - c0)
    covered = 0.0 + pairwise_sum(hidden[:count]) if kept else 0.0
    if kept and count:
        exposed = comm - covered
        exposed = exposed if exposed > 0.0 else 0.0
    final = len(knots) - 1 if c1 < len(knots) else c0 - 1  # the last knot kept
    last = knots[final] if kept and knots[final] > 0.0 else 0.0
    if count and ends[-1] > last:
        last = ends[-1]
    totals[0], totals[1], totals[2], totals[3] = done[final] if kept else 0.0, comm, exposed, last
    return count, covered


@njit(cache=True)
def _running_compute(knots: np.ndarray, done: np.ndarray, c0: int, c1: int) -> bool:
    """Busy's done (compute seconds by each knot, summed as np.cumsum does) at each knot but knots[c0:c1], if those
    knots rise and are finite. The first interval is taken apart and the checks are gathered rather than left at
    once, so that the loop over the rest runs without a branch: 70 us, not 149, over 43,600 intervals (GPT-3 at tp
    8, pp 16 without sp, its longer form's 16 stages); what `done` holds when they fail is not read."""
    compute = previous = 0.0
    first, rising = True, True
    for part in range(2):
        k = 0 if part == 0 else c1
        hi = c0 if part == 0 else len(knots)
        if first and k < hi:
            previous = knots[k + 1]
            rising = knots[k] <= previous < np.inf
            done[k], compute, done[k + 1] = 0.0, previous - knots[k], previous - knots[k]
            first = False
            k += 2
        while k < hi:  # a while loop: numba's range with a step of 2 ran as slowly as the branches did
            s, e = knots[k], knots[k + 1]
            rising &= (previous <= s) & (s <= e) & (e < np.inf)
            previous = e
            done[k] = compute
            compute = compute + (e - s)
            done[k + 1] = compute
            k += 2
    return rising


@njit(cache=True)
def _union_of_streams(
    starts: np.ndarray,
    ends: np.ndarray,
    stream_ptr: np.ndarray,
    holes: np.ndarray,
    out_starts: np.ndarray,
    out_ends: np.ndarray,
) -> int:
    """`merge`'s intervals, into out_starts and out_ends, from streams whose intervals each start in order, stream
    s's less those from holes[s, 0] to holes[s, 1]; how many, or -1 where a stream's intervals do not rise or are
    not finite.

    The streams are merged by start: the stream whose next interval starts first takes every interval up to the
    next stream's start. The union does not depend on the order of intervals that start together, so any order
    of ties gives `_merged`'s intervals."""
    streams = len(stream_ptr) - 1
    head = np.empty(streams, dtype=np.int64)
    stop = np.empty(streams, dtype=np.int64)
    skip = np.empty((streams, 2), dtype=np.int64)
    active = 0
    for s in range(streams):
        first = holes[s, 1] if holes[s, 0] == stream_ptr[s] else stream_ptr[s]
        if first < stream_ptr[s + 1]:
            head[active], stop[active] = first, stream_ptr[s + 1]
            skip[active, 0], skip[active, 1] = holes[s, 0], holes[s, 1]
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
            if j == skip[pick, 0]:
                j = skip[pick, 1]
            if j == stop[pick]:
                active -= 1
                head[pick], stop[pick] = head[active], stop[active]
                skip[pick, 0], skip[pick, 1] = skip[active, 0], skip[active, 1]
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
def _hidden(
    knots: np.ndarray, done: np.ndarray, c0: int, c1: int, starts: np.ndarray, ends: np.ndarray, hidden: np.ndarray
) -> None:
    """Into hidden, np.interp(ends, knots, done) - np.interp(starts, knots, done) for disjoint intervals in order,
    all finite, over the knots less knots[c0:c1]: the starts and ends rise in turn, so one forward walk finds
    their knots (the last at or before each, as numpy's search does), stepping from c0 - 1 to c1; numpy's cases
    and formula at each. Without knots, hidden is left as it is."""
    n = len(knots)
    if n == c1 - c0:
        return
    j = -1
    nxt = 0 if c0 > 0 else c1  # the knot after j
    before = 0.0
    for side in range(2 * len(starts)):
        x = ends[side // 2] if side & 1 else starts[side // 2]
        while nxt < n and knots[nxt] <= x:
            j = nxt
            nxt = c1 if j + 1 == c0 else j + 1
        if j < 0:
            value = done[nxt]
        elif nxt == n or knots[j] == x:
            value = done[j]
        else:  # np.interp's formula; its retries where that gives nan need values that are not finite
            slope = (done[nxt] - done[j]) / (knots[nxt] - knots[j])
            value = slope * (x - knots[j]) + done[j]
        if side & 1:
            hidden[side // 2] = value - before
        else:
            before = value
