"""Busy time of overlapping streams: how long compute runs, how long communication runs, and how much of the
communication no compute hides."""

from collections.abc import Sequence

import numpy as np


def merge(starts: Sequence[float], ends: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [starts[i], ends[i]] as disjoint intervals, sorted; touching intervals become one.

    Sorted by start, an interval opens a new one only if it starts past the furthest end before it: everything up
    to that end is covered already, because the interval that reached that far started no later."""
    s = np.asarray(starts, dtype=float)
    e = np.asarray(ends, dtype=float)
    if not len(s):
        return s, e
    # Stable sorting (timsort) is fast on what callers pass: a few runs that are each already in order.
    order = np.argsort(s, kind="stable")
    s, reach = s[order], np.maximum.accumulate(e[order])
    opens = np.empty(len(s), dtype=bool)
    opens[0] = True
    np.greater(s[1:], reach[:-1], out=opens[1:])
    first = np.flatnonzero(opens)
    # a merged interval ends where the reach stood just before the next one opens; the last one, at the last reach
    return s[first], np.concatenate((reach[first[1:] - 1], reach[-1:]))


def split_busy(
    compute_starts: Sequence[float],
    compute_ends: Sequence[float],
    comm_starts: Sequence[float],
    comm_ends: Sequence[float],
) -> tuple[float, float, float]:
    """Seconds of compute, of communication (the union of its streams) and of communication no compute overlaps.

    Compute runs on one in-order stream, so its intervals never overlap one another: their starts and ends sort
    apart and their lengths add up. The hidden communication is measured as the overlap itself, not as compute +
    communication - busy, so a step without overlap reports every communication second as exposed, exactly.
    """
    cs = np.sort(np.asarray(compute_starts, dtype=float), kind="stable")
    ce = np.sort(np.asarray(compute_ends, dtype=float), kind="stable")
    done = np.cumsum(ce - cs)  # compute seconds by the end of each interval
    compute = float(done[-1]) if len(done) else 0.0
    ms, me = merge(comm_starts, comm_ends)
    comm = float((me - ms).sum())
    if not len(cs) or not len(ms):
        return compute, comm, comm
    # Compute seconds before a time, piecewise linear: flat between intervals, rising inside them. Knots that meet
    # carry one value, so a communication interval between two compute intervals finds exactly no compute.
    knots = np.empty(2 * len(cs))
    knots[0::2], knots[1::2] = cs, ce
    values = np.empty(2 * len(cs))
    values[0], values[2::2], values[1::2] = 0.0, done[:-1], done
    hidden = float((np.interp(me, knots, values) - np.interp(ms, knots, values)).sum())
    return compute, comm, max(0.0, comm - hidden)
