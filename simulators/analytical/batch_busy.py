"""`intervals.Busy` for many timelines of one schedule at once: a row per system, a block of systems at a time.

The communication no compute hides is the union of all intervals less the compute: |comm \\ compute| =
|comm U compute| - |compute| (compute runs on one stream, so its intervals never overlap and add up). So two unions
are all that is measured: of the communication intervals, and of every interval. Each system's intervals are
sorted by start (a stable sort, fast on what the tape yields: a few streams' runs, each already in order) and each
contributes the piece [max(start, reach), max(end, reach)] past the furthest end before it (`reach`): the pieces
are disjoint and in order, and add up to the union, as `intervals.merge`'s merged intervals do. `Busy` measures
the hidden communication by interpolating compute time over each merged interval instead; the two agree to
rounding.
"""

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

BLOCK = 16
"""Systems handled together: a block's arrays stay in the processor's cache (twice as fast as 250 at once)."""


@dataclass(frozen=True, slots=True)
class BusyMany:
    """The busy figures of many systems, a block of systems at a time."""

    blocks: list["_Block"]

    @classmethod
    def of(
        cls, compute_starts: np.ndarray, compute_ends: np.ndarray, comm_starts: np.ndarray, comm_ends: np.ndarray
    ) -> "BusyMany":
        """From arrays of intervals x systems (the tape's values)."""
        systems = compute_starts.shape[1]
        return cls(
            [
                _Block.of(*(a[:, lo : lo + BLOCK] for a in (compute_starts, compute_ends, comm_starts, comm_ends)))
                for lo in range(0, systems, BLOCK)
            ]
        )

    def totals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(compute, communication, exposed communication) seconds per system, as `Busy.totals`."""
        compute, comm, exposed = zip(*(b.totals() for b in self.blocks), strict=True)
        return np.concatenate(compute), np.concatenate(comm), np.concatenate(exposed)

    def windows(self, start: np.ndarray, length: np.ndarray, count: int) -> list[tuple[np.ndarray, ...]]:
        """Per window [start + k length, start + (k + 1) length), k < count, the (compute, communication, exposed
        communication) seconds in it per system, as `Busy.between`."""
        parts = []
        lo = 0
        for block in self.blocks:
            size = len(block.every.done)
            parts.append(block.windows(start[lo : lo + size], length[lo : lo + size], count))
            lo += size
        return [tuple(np.concatenate([p[k][figure] for p in parts]) for figure in range(3)) for k in range(count)]


@dataclass(frozen=True, slots=True)
class _Union:
    """A union of intervals, per system, as pieces (see the module docstring)."""

    opened: np.ndarray
    closed: np.ndarray
    """systems x intervals."""
    done: np.ndarray
    """Seconds covered by the end of each piece."""

    @classmethod
    def of(cls, starts: np.ndarray, ends: np.ndarray) -> "_Union":
        """From intervals as rows of systems."""
        order = np.argsort(starts, axis=1, kind="stable")
        starts, ends = np.take_along_axis(starts, order, axis=1), np.take_along_axis(ends, order, axis=1)
        reach = np.maximum.accumulate(ends, axis=1)
        before = np.empty_like(reach)
        before[:, :1], before[:, 1:] = -np.inf, reach[:, :-1]
        opened, closed = np.maximum(starts, before), np.maximum(ends, before)
        return cls(opened, closed, np.cumsum(closed - opened, axis=1))

    def total(self) -> np.ndarray:
        return self.done[:, -1] if self.done.shape[1] else np.zeros(len(self.done))

    def before(self, moment: np.ndarray) -> np.ndarray:
        """Seconds covered before `moment` (one per system): the pieces opened before it, the last only up to it."""
        if not self.opened.shape[1]:
            return np.zeros(len(moment))
        at = moment[:, None]
        opened = (self.opened < at).sum(axis=1, keepdims=True)
        last = np.maximum(opened - 1, 0)
        earlier = np.where(opened > 1, np.take_along_axis(self.done, np.maximum(opened - 2, 0), axis=1), 0.0)
        part = np.minimum(at, np.take_along_axis(self.closed, last, axis=1)) - np.take_along_axis(self.opened, last, 1)
        return np.where(opened > 0, earlier + part, 0.0)[:, 0]


@dataclass(frozen=True, slots=True)
class _Block:
    compute: _Union
    comm: _Union
    every: _Union
    """The union of compute and communication intervals."""

    @classmethod
    def of(
        cls, compute_starts: np.ndarray, compute_ends: np.ndarray, comm_starts: np.ndarray, comm_ends: np.ndarray
    ) -> "_Block":
        starts = np.vstack((compute_starts, comm_starts)).T.copy()
        ends = np.vstack((compute_ends, comm_ends)).T.copy()
        split = len(compute_starts)
        own_starts, own_ends = starts[:, :split], ends[:, :split]  # one stream's: disjoint and in order already
        return cls(
            compute=_Union(own_starts, own_ends, np.cumsum(own_ends - own_starts, axis=1)),
            comm=_Union.of(starts[:, split:], ends[:, split:]),
            every=_Union.of(starts, ends),
        )

    def totals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(compute, communication, exposed communication) seconds per system, as `Busy.totals`."""
        compute, comm = self.compute.total(), self.comm.total()
        return compute, comm, np.maximum(0.0, self.every.total() - compute)

    def windows(self, start: np.ndarray, length: np.ndarray, count: int) -> list[tuple[np.ndarray, ...]]:
        """Per window [start + k length, start + (k + 1) length), k < count, the (compute, communication, exposed
        communication) seconds in it per system, as `Busy.between`."""
        moments = [start + k * length for k in range(count + 1)]
        before = [(self.compute.before(m), self.comm.before(m), self.every.before(m)) for m in moments]
        out = []
        for (compute_a, comm_a, every_a), (compute_b, comm_b, every_b) in pairwise(before):
            compute = compute_b - compute_a
            out.append((compute, comm_b - comm_a, np.maximum(0.0, every_b - every_a - compute)))
        return out
