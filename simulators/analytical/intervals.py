"""Busy time of overlapping streams: how long compute runs, how long communication runs, and how much of the
communication no compute hides."""

from collections.abc import Sequence
from dataclasses import dataclass

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
        """`between(lo, lo + shift)` and `between(lo + shift, lo + 2 * shift)`, in one compiled call (as
        `ordered_busy.OrderedBusy.periods` reads every timeline's for `steady`)."""
        both = _windows(self.knots, self.done, self.comm_starts, self.comm_ends, self.hidden, lo, shift)
        return both[:3], both[3:]


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
    fields, the moment between them read once (`_windows_of`)."""
    a = _before(knots, done, comm_starts, comm_ends, hidden, lo)
    b = _before(knots, done, comm_starts, comm_ends, hidden, lo + shift)
    c = _before(knots, done, comm_starts, comm_ends, hidden, lo + 2 * shift)
    return _windows_of(a, b, c)


@njit(cache=True)
def _windows_of(
    a: tuple[float, float, float], b: tuple[float, float, float], c: tuple[float, float, float]
) -> tuple[float, float, float, float, float, float]:
    """The windows from one moment to the next and from there to a third, what there is before each given
    (`_before`), each as `_between` gives it."""
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
    """Compute, communication and hidden communication seconds before t, of the Busy with these fields
    (`_before_around` with no knots left out)."""
    n = len(knots)
    return _before_around(knots, done, n, n, comm_starts, comm_ends, hidden, t)


@njit(cache=True)
def _before_around(
    knots: np.ndarray,
    done: np.ndarray,
    c0: int,
    c1: int,
    comm_starts: np.ndarray,
    comm_ends: np.ndarray,
    hidden: np.ndarray,
    t: float,
) -> tuple[float, float, float]:
    """`_before` of the Busy whose knots and done are these less [c0, c1) (`ordered_busy` leaves a cut's out in
    place, c0 = c1 = len(knots) for none): compute by np.interp over the knots (`_interp_around`), the merged
    communication intervals ended by t (numpy's pairwise sums of theirs and their hidden seconds), and the one
    under way at t, if any, up to t."""
    kept = len(knots) - (c1 - c0)
    compute = _interp_around(t, knots, done, c0, c1) if kept else 0.0
    whole = np.searchsorted(comm_ends, t, side="right")
    comm = 0.0 + pairwise_sum(comm_ends[:whole] - comm_starts[:whole])
    covered = 0.0 + pairwise_sum(hidden[:whole])
    if whole < len(comm_starts) and comm_starts[whole] < t:  # the one under way
        start = comm_starts[whole]
        comm += t - start
        if kept:
            covered += compute - _interp_around(start, knots, done, c0, c1)
    return compute, comm, covered


@njit(cache=True)
def _interp_around(x: float, knots: np.ndarray, done: np.ndarray, c0: int, c1: int) -> float:
    """`_interp` over the knots less knots[c0:c1] (some left, c0 and c1 even): over those before c0 up to the
    first after, over those from c1 on from there. The same to the bit: where x falls between knots c0 - 1 (an
    end) and c1 (a start), np.interp over the knots kept reads 0.0 * (x - knots[c0 - 1]) + done[c0 - 1] (a
    start's done is the end's before it), as the part before c0 reads its last knot's done[c0 - 1]."""
    if c0 > 0 and (c1 == len(knots) or x < knots[c1]):
        return _interp(x, knots[:c0], done[:c0])
    return _interp(x, knots[c1:], done[c1:])


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
