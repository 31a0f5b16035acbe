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
    order = np.argsort(s)
    s, reach = s[order], np.maximum.accumulate(e[order])
    opens = np.empty(len(s), dtype=bool)
    opens[0] = True
    np.greater(s[1:], reach[:-1], out=opens[1:])
    first = np.flatnonzero(opens)
    return s[first], reach[np.append(first[1:] - 1, len(s) - 1)]


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
    # A zero-length interval before every time (all are >= 0) lets each query find an interval at or before it.
    cs = np.sort(np.append(np.asarray(compute_starts, dtype=float), -1.0))
    ce = np.sort(np.append(np.asarray(compute_ends, dtype=float), -1.0))
    lengths = ce - cs
    compute = float(lengths.sum())
    ms, me = merge(comm_starts, comm_ends)
    comm = float((me - ms).sum())
    if len(cs) == 1 or not len(ms):
        return compute, comm, comm
    before = np.cumsum(lengths) - lengths  # compute seconds of the intervals before each one
    hidden = float((_compute_until(me, cs, ce, before) - _compute_until(ms, cs, ce, before)).sum())
    return compute, comm, max(0.0, comm - hidden)


def _compute_until(t: np.ndarray, cs: np.ndarray, ce: np.ndarray, before: np.ndarray) -> np.ndarray:
    """Compute seconds before each time of a sorted array, from disjoint sorted compute intervals."""
    k = np.searchsorted(cs, t, side="right") - 1  # the last compute interval starting at or before t
    return before[k] + (np.minimum(t, ce[k]) - cs[k])
