"""`intervals.Busy` for many timelines of one schedule at once: a row per system.

Each system's communication intervals are sorted by start (a stable sort, fast on what the tape yields: a few
streams' runs, each already in order) and each interval contributes the piece [max(start, reach), max(end, reach)]
past the furthest end before it (`reach`): the pieces are disjoint and in order, and they add up to the union, as
`intervals.merge`'s merged intervals do. The compute intervals run on one in-order stream, so they are in order on
every system; the compute seconds before each end of each piece (what `Busy` interpolates over its knots) are the
intervals before it and the part of the one it falls in, found by a binary search per system.
"""

from dataclasses import dataclass
from itertools import pairwise

import numpy as np


@dataclass(frozen=True, slots=True)
class BusyMany:
    compute_starts: np.ndarray
    """systems x compute intervals: each system's compute interval starts (in order: one in-order stream)."""
    done: np.ndarray
    """systems x compute intervals: compute seconds by the end of each compute interval."""
    offset: np.ndarray
    """Compute seconds by each compute interval's start, less that start: inside interval k, the compute
    seconds before t are offset[k] + t, and past its end done[k]."""
    opened: np.ndarray
    closed: np.ndarray
    """systems x communication intervals: the pieces (see the module docstring)."""
    hidden_open: np.ndarray
    hidden_close: np.ndarray
    """Compute seconds before each piece's start and end."""
    comm_done: np.ndarray
    hidden_done: np.ndarray
    """Communication seconds, and compute seconds inside them, by the end of each piece."""

    @classmethod
    def of(
        cls, compute_starts: np.ndarray, compute_ends: np.ndarray, comm_starts: np.ndarray, comm_ends: np.ndarray
    ) -> "BusyMany":
        """From arrays of intervals x systems (the tape's values)."""
        systems = compute_starts.shape[1]
        starts, ends = np.ascontiguousarray(comm_starts.T), np.ascontiguousarray(comm_ends.T)
        order = np.argsort(starts, axis=1, kind="stable")
        starts, ends = np.take_along_axis(starts, order, axis=1), np.take_along_axis(ends, order, axis=1)
        reach = np.maximum.accumulate(ends, axis=1)
        before = np.hstack((np.full((systems, 1), -np.inf), reach[:, :-1]))[:, : starts.shape[1]]
        opened, closed = np.maximum(starts, before), np.maximum(ends, before)
        compute_starts, compute_ends = np.ascontiguousarray(compute_starts.T), compute_ends.T
        done = np.cumsum(compute_ends - compute_starts, axis=1)
        offset = done - compute_ends
        hidden_open = _compute_before(compute_starts, done, offset, opened, _positions(compute_starts, opened))
        hidden_close = _compute_before(compute_starts, done, offset, closed, _positions(compute_starts, closed))
        comm_done = np.cumsum(closed - opened, axis=1)
        hidden_done = np.cumsum(hidden_close - hidden_open, axis=1)
        return cls(compute_starts, done, offset, opened, closed, hidden_open, hidden_close, comm_done, hidden_done)

    def totals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(compute, communication, exposed communication) seconds per system, as `Busy.totals`."""
        systems = len(self.done)
        compute = self.done[:, -1] if self.done.shape[1] else np.zeros(systems)
        comm = self.comm_done[:, -1] if self.comm_done.shape[1] else np.zeros(systems)
        if not self.done.shape[1] or not self.opened.shape[1]:
            return compute, comm, comm
        return compute, comm, np.maximum(0.0, comm - self.hidden_done[:, -1])

    def windows(self, start: np.ndarray, length: np.ndarray, count: int) -> list[tuple[np.ndarray, ...]]:
        """Per window [start + k length, start + (k + 1) length), k < count, the (compute, communication, exposed
        communication) seconds in it per system, as `Busy.between`."""
        before = [self._before(start + k * length) for k in range(count + 1)]
        out = []
        for (compute_a, comm_a, hidden_a), (compute_b, comm_b, hidden_b) in pairwise(before):
            comm = comm_b - comm_a
            out.append((compute_b - compute_a, comm, np.maximum(0.0, comm - (hidden_b - hidden_a))))
        return out

    def _before(self, moment: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Compute, communication and hidden communication seconds before `moment` (one per system), as
        `Busy._before`: the pieces that opened before it, the last of them only up to it."""
        at = moment[:, None]
        compute = _compute_before(self.compute_starts, self.done, self.offset, at, _positions(self.compute_starts, at))
        systems = len(moment)
        if not self.opened.shape[1]:
            return compute[:, 0], np.zeros(systems), np.zeros(systems)
        opened = _positions(self.opened, at, side="left")  # pieces opened before the moment
        last = np.maximum(opened - 1, 0)
        began = opened > 0

        def at_last(values: np.ndarray) -> np.ndarray:
            return np.take_along_axis(values, last, axis=1)

        def before_last(values: np.ndarray) -> np.ndarray:
            return np.where(opened > 1, np.take_along_axis(values, np.maximum(opened - 2, 0), axis=1), 0.0)

        closed = at_last(self.closed)
        comm = before_last(self.comm_done) + np.minimum(at, closed) - at_last(self.opened)
        inside = np.where(closed <= at, at_last(self.hidden_close), compute) - at_last(self.hidden_open)
        hidden = before_last(self.hidden_done) + inside
        return compute[:, 0], np.where(began, comm, 0.0)[:, 0], np.where(began, hidden, 0.0)[:, 0]


def _positions(sorted_rows: np.ndarray, points: np.ndarray, side: str = "right") -> np.ndarray:
    """Per system (a row), where each of its points falls among its sorted values (`np.searchsorted`)."""
    position = np.empty(points.shape, dtype=np.intp)
    for system, (row, at) in enumerate(zip(sorted_rows, points, strict=True)):
        position[system] = np.searchsorted(row, at, side=side)
    return position


def _compute_before(
    compute_starts: np.ndarray, done: np.ndarray, offset: np.ndarray, points: np.ndarray, position: np.ndarray
) -> np.ndarray:
    """Compute seconds before each point, given how many compute intervals start at or before it: all of those
    but the last, and of the last as much as lies before the point."""
    if not compute_starts.shape[1]:
        return np.zeros(points.shape)
    last = np.maximum(position - 1, 0)
    seen = np.minimum(np.take_along_axis(offset, last, axis=1) + points, np.take_along_axis(done, last, axis=1))
    return np.where(position == 0, 0.0, seen)
