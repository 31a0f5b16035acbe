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
summed over i: no sort of intervals by start, no running maximum, only two sorts of numbers, which a compiled loop
(`batch_kernels.measure`) makes system by system, by insertion on what `Spans.ordered` leaves (the starts in one
system's order of them, the ends in its order of them, which others keep but for a few). `Busy` measures the hidden
communication by interpolating compute time over each merged interval instead; the two agree to rounding.
"""

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from simulators.analytical import batch_kernels
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
        compute = recorded.compute.astype(np.intp)
        firsts = compute[0].copy()
        at = np.flatnonzero((tape.first[firsts + 1] - tape.first[firsts] == 1) & (tape.kind[firsts] == MAX_ADD))
        if len(at):  # a first op that waited for one node alone starts at it
            compute[0, at] = tape.args[tape.first[firsts[at]]]
            compute[1, at] = zero
        comm = np.stack((recorded.comm[0], np.full(recorded.comm.shape[1], zero), recorded.comm[1])).astype(np.intp)
        return cls(_joined(compute, zero), _joined(comm, zero), _joined(np.hstack((compute, comm)), zero))

    def rows(self, row_of: np.ndarray) -> "Spans":
        """The spans with their nodes mapped to rows of values (`tape_program.TapeProgram.row_of`)."""
        spans = (self.compute, self.comm, self.every)
        return Spans(*(np.stack((row_of[s[0]], s[1], row_of[s[2]])).astype(np.intp) for s in spans))

    def ordered(self, values: np.ndarray, durations: np.ndarray) -> "Spans":
        """The spans (in rows) with their starts in order on one system and their ends in order on it (values and
        durations: a column each), the orders most systems keep but for a few. A span then no longer pairs its
        start with its end: only the unions are measured, and they read the starts and the ends each sorted on its
        own."""

        def by_time(span: np.ndarray) -> np.ndarray:
            starts = np.argsort(values[span[0]] - durations[span[1]], kind="stable")
            ends = np.argsort(values[span[2]], kind="stable")
            return np.stack((span[0, starts], span[1, starts], span[2, ends]))

        return Spans(self.compute, by_time(self.comm), by_time(self.every))


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


BLOCK = 32
"""Systems whose unions are measured together (`batch_kernels.measure`): their intervals stay in the processor's
cache while they are gathered and sorted; the block also sets where a moment within rounding of a start counts it
(`batch_kernels._starts_before`), so the figures stay those measured with it (`batch._chunks` lays them out)."""


@dataclass(frozen=True, slots=True)
class BusyMany:
    """The busy figures of many systems: `Busy.totals`, and the seconds covered before given moments, from which
    `windows` reads `Busy.between`."""

    totals: tuple[np.ndarray, np.ndarray, np.ndarray]
    """(compute, communication, exposed communication) seconds per system."""
    covered: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Per moment, the (compute, communication, any) seconds covered before it, per system."""

    @classmethod
    def of(
        cls, values: np.ndarray, durations: np.ndarray, spans: Spans, moments: list[np.ndarray], blocks: np.ndarray
    ) -> "BusyMany":
        """From the values of the tape program's rows and the durations (rows x systems both, C-ordered), `spans`
        in rows (`Spans.ordered`); moments: arrays of one time per system; blocks: where each block of systems
        measured together starts (of at most `BLOCK`), and where the last ends."""
        at = np.array(moments, dtype=float).reshape(len(moments), values.shape[1])

        def measured(span: np.ndarray, ordered: bool) -> tuple[np.ndarray, np.ndarray]:
            return batch_kernels.measure(values, durations, span[0], span[1], span[2], ordered, at, blocks)

        compute, compute_before = measured(spans.compute, True)  # one stream's: disjoint and in order already
        comm, comm_before = measured(spans.comm, False)
        every, every_before = measured(spans.every, False)
        return cls(
            (compute, comm, np.maximum(0.0, every - compute)),
            list(zip(compute_before, comm_before, every_before, strict=True)),
        )

    def windows(self, moments: slice = slice(None)) -> list[tuple[np.ndarray, ...]]:
        """Between each of the given moments (all by default) and the next of them, the (compute, communication,
        exposed communication) seconds per system, as `Busy.between`."""
        out = []
        for (compute_a, comm_a, every_a), (compute_b, comm_b, every_b) in pairwise(self.covered[moments]):
            compute = compute_b - compute_a
            out.append((compute, comm_b - comm_a, np.maximum(0.0, every_b - every_a - compute)))
        return out
