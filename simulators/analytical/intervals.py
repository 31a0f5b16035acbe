"""Length of a union of time intervals: how long at least one of several overlapping streams is busy."""

from collections.abc import Sequence

import numpy as np


def union_length(starts: Sequence[float], ends: Sequence[float]) -> float:
    """Seconds covered by at least one interval [starts[i], ends[i]].

    Sorted by start, an interval only adds what reaches past the furthest end before it: everything between
    its start and that end is already covered, because the interval that reached that far started no later.
    """
    if not starts:
        return 0.0
    s = np.asarray(starts, dtype=float)
    e = np.asarray(ends, dtype=float)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    added = e[1:] - np.maximum(s[1:], reach[:-1])
    return float(e[0] - s[0] + np.clip(added, 0.0, None).sum())
