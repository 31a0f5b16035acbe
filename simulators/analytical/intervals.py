"""Length of a union of time intervals: how long at least one of several overlapping streams is busy."""

from collections.abc import Sequence

import numpy as np


def union_length(starts: Sequence[float], ends: Sequence[float]) -> float:
    """Seconds covered by at least one interval [starts[i], ends[i]].

    Sorted by start, an interval only adds what reaches past the furthest end before it: everything between
    its start and that end is already covered, because the interval that reached that far started no later.
    """
    if len(starts) == 0:
        return 0.0
    s = np.asarray(starts, dtype=float)
    e = np.asarray(ends, dtype=float)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    added = e[1:] - np.maximum(s[1:], reach[:-1])
    return float(e[0] - s[0] + np.clip(added, 0.0, None).sum())


def merge_intervals(starts: Sequence[float], ends: Sequence[float]) -> tuple[list[float], list[float]]:
    """The same union as disjoint intervals, sorted: touching or overlapping intervals become one."""
    if not starts:
        return [], []
    pairs = sorted(zip(starts, ends, strict=True))
    out_s, out_e = [pairs[0][0]], [pairs[0][1]]
    for s, e in pairs[1:]:
        if s <= out_e[-1]:
            if e > out_e[-1]:
                out_e[-1] = e
        else:
            out_s.append(s)
            out_e.append(e)
    return out_s, out_e
