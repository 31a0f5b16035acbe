"""`intervals.Busy` for many timelines of one schedule at once, intervals x systems as the tape's values are.

The communication no compute hides is the union of all intervals less the compute: |comm \\ compute| =
|comm U compute| - |compute| (compute runs on one stream, so its intervals never overlap and add up). So two unions
are all that is measured: of the communication intervals, and of every interval.

Before any system is looked at, intervals that follow each other on every system are joined (`Spans`): one that
starts at the very node another ends at (a collective the compute stream waits for, then the compute that waited)
makes one interval with it, which keeps a third of Llama-3-70B's intervals out of the sorts. A union is then read
from each system's starts and ends sorted each on its own: with both sorted, the i-th start opens a gap exactly when
the i earliest ends all come before it, and the gap runs from the i-th end (every interval started before it has
ended by then, and no other has). So the union covers [first start, last end] less max(0, start[i] - end[i - 1])
summed over i: no sort of intervals by start, no running maximum, only two sorts of numbers (timsort, fast on what
`Spans.ordered` leaves: one system's order, which others keep but for a few intervals). `Busy` measures the hidden
communication by interpolating compute time over each merged interval instead; the two agree to rounding.
"""

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from simulators.analytical.tape import MAX_ADD, ClassTape, Tape


@dataclass(frozen=True, slots=True)
class Spans:
    """A rank class's busy intervals as tape nodes, each 3 x intervals: the start's node, a duration column taken
    from it (the zero row where the node is the start itself), the end's node."""

    compute: np.ndarray
    comm: np.ndarray
    every: np.ndarray
    """Compute and communication, joined where one starts where another ends."""

    @classmethod
    def of(cls, tape: Tape, recorded: ClassTape) -> "Spans":
        zero = len(tape.columns)  # the zero row of the durations
        compute = np.array(recorded.compute, dtype=np.intp).reshape(-1, 3).T.copy()
        args, kinds = tape.args, tape.kind
        exact = [len(args[f]) == 1 and kinds[f] == MAX_ADD for f in compute[0].tolist()]
        if any(exact):  # a first op that waited for one node alone starts at it
            at = np.flatnonzero(exact)
            compute[0, at] = [args[f][0] for f in compute[0, at].tolist()]
            compute[1, at] = zero
        comm = np.array([(start, zero, end) for start, end in recorded.comm], dtype=np.intp).reshape(-1, 3).T
        return cls(_joined(compute, zero), _joined(comm, zero), _joined(np.hstack((compute, comm)), zero))

    def rows(self, row_of: np.ndarray) -> "Spans":
        """The spans with their nodes mapped to rows of values (`tape_program.TapeProgram.row_of`)."""
        return Spans(*(np.stack((row_of[s[0]], s[1], row_of[s[2]])) for s in (self.compute, self.comm, self.every)))

    def ordered(self, values: np.ndarray, durations: np.ndarray) -> "Spans":
        """The spans (in rows) in order of their starts on one system (values and durations: a column each), the
        order most systems' intervals keep but for a few (timsort is fast on that: `_Union.of`)."""

        def by_start(span: np.ndarray) -> np.ndarray:
            return span[:, np.argsort(values[span[0]] - durations[span[1]], kind="stable")]

        return Spans(self.compute, by_start(self.comm), by_start(self.every))


def _joined(spans: np.ndarray, zero: int) -> np.ndarray:
    """The spans with every chain of one ending at the node the next starts at (its column the zero row) made one
    span, in the order of their first spans. Only an end no other span shares is joined on, and a span follows
    one span at most. Node ids grow along a chain (an end comes after its start), so chains never loop."""
    start, column, end = spans
    if not len(start):
        return spans
    ends, first_at, count = np.unique(end, return_index=True, return_counts=True)
    at = np.minimum(np.searchsorted(ends, start), len(ends) - 1)
    follows = np.flatnonzero((column == zero) & (ends[at] == start) & (count[at] == 1))
    before = first_at[at[follows]]
    before, unique = np.unique(before, return_index=True)  # a span ending where two start is followed by one
    follows = follows[unique]
    tail = np.arange(len(start))
    tail[before] = follows
    while True:  # pointer jumping: each pass doubles how far along its chain a span's tail is
        further = tail[tail]
        if np.array_equal(further, tail):
            break
        tail = further
    heads = np.ones(len(start), dtype=bool)
    heads[follows] = False
    return np.stack((start[heads], column[heads], end[tail[heads]]))


@dataclass(frozen=True, slots=True)
class BusyMany:
    """The busy figures of many systems: each union's arrays are intervals x systems, as the values are."""

    compute: "_Union"
    comm: "_Union"
    every: "_Union"
    """The union of compute and communication intervals."""

    @classmethod
    def of(cls, values: np.ndarray, durations: np.ndarray, spans: Spans) -> "BusyMany":
        """From the values of the tape program's rows and the durations (rows x systems both), `spans` in rows."""

        def intervals(span: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            start = values[span[0]]
            start -= durations[span[1]]
            return start, values[span[2]]

        return cls(
            compute=_Union.of(*intervals(spans.compute), ordered=True),  # one stream's: disjoint and in order
            comm=_Union.of(*intervals(spans.comm)),
            every=_Union.of(*intervals(spans.every)),
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


@dataclass(frozen=True, slots=True)
class _Union:
    """A union of intervals, per system (see the module docstring)."""

    starts: np.ndarray
    ends: np.ndarray
    """systems x intervals, each sorted on its own."""
    gaps: np.ndarray
    """Seconds not covered between the first start and each start."""

    @classmethod
    def of(cls, starts: np.ndarray, ends: np.ndarray, ordered: bool = False) -> "_Union":
        """From intervals x systems; `ordered`: sorted by start and disjoint already."""
        if ordered:
            starts, ends = np.ascontiguousarray(starts.T), np.ascontiguousarray(ends.T)
        else:  # timsort: fast on what the spans' order leaves (`Spans.ordered`), runs with a few intervals astray
            starts, ends = np.sort(starts.T, axis=1, kind="stable"), np.sort(ends.T, axis=1, kind="stable")
        gaps = np.empty_like(starts)
        gaps[:, :1] = 0.0
        np.subtract(starts[:, 1:], ends[:, :-1], out=gaps[:, 1:])
        np.maximum(gaps, 0.0, out=gaps)
        np.cumsum(gaps, axis=1, out=gaps)
        return cls(starts, ends, gaps)

    def total(self) -> np.ndarray:
        if not self.starts.shape[1]:
            return np.zeros(len(self.starts))
        return self.ends[:, -1] - self.starts[:, 0] - self.gaps[:, -1]

    def before(self, moment: np.ndarray) -> np.ndarray:
        """Seconds covered before `moment` (one per system): from the first start to the moment, less the gaps
        before the last start before it and the part of the gap after it that comes before the moment."""
        if not self.starts.shape[1]:
            return np.zeros(len(moment))
        started = (self.starts < moment[:, None]).sum(axis=1)
        last = np.arange(len(moment)), np.maximum(started - 1, 0)
        idle = np.maximum(moment - self.ends[last], 0.0)
        return np.where(started > 0, moment - self.starts[:, 0] - self.gaps[last] - idle, 0.0)
