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
        what there is before each, so a window costs two binary searches, not a pass over the timeline."""
        (compute_a, comm_a, hidden_a), (compute_b, comm_b, hidden_b) = self._before(start), self._before(end)
        comm = comm_b - comm_a
        return compute_b - compute_a, comm, max(0.0, comm - (hidden_b - hidden_a))

    def _before(self, moment: float) -> tuple[float, float, float]:
        """Compute, communication and hidden communication seconds before `moment`."""
        compute = float(np.interp(moment, self.knots, self.done)) if len(self.knots) else 0.0
        whole = int(np.searchsorted(self.comm_ends, moment, side="right"))  # merged intervals ended by then
        comm = float((self.comm_ends[:whole] - self.comm_starts[:whole]).sum())
        hidden = float(self.hidden[:whole].sum())
        if whole < len(self.comm_starts) and self.comm_starts[whole] < moment:  # the one under way
            start = float(self.comm_starts[whole])
            comm += moment - start
            if len(self.knots):
                hidden += compute - float(np.interp(start, self.knots, self.done))
        return compute, comm, hidden
