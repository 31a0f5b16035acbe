"""`intervals.Busy` for many timelines of one schedule at once, intervals x systems as the tape's values are.

Before any system is looked at, intervals that follow each other on every system are joined (`Spans`): one that
starts at the very node another ends at (a collective the stream waits for, then the one that waited) makes one
interval with it, which keeps intervals out of the gathers and the sorts. The compute runs on one stream, so its
intervals come disjoint and in order. The communication's union is read from each system's starts and ends sorted
each on its own: with both sorted, the i-th start opens a new interval exactly when the i earliest ends all come
before it, and the interval before it ends at the (i - 1)-th end (every interval started before the i-th has ended
by then, and no other has). No sort of intervals by start, no running maximum, only two sorts of numbers, which a
compiled loop (`batch_kernels.measure`) makes system by system, by insertion on what `Spans.ordered` leaves (the
starts in one system's order of them, the ends in its order of them, which others keep but for a few). The hidden
communication is then measured as `Busy` measures it: per merged interval, the compute seconds inside it, read
off the compute's running sum by one forward walk over both. The figures are `Busy`'s to rounding, not to the bit:
the running sums add in another order than numpy's.
"""

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from simulators.analytical import batch_kernels
from simulators.analytical.tape import MAX_ADD, ClassTape, Tape


@dataclass(frozen=True, slots=True)
class Spans:
    """A rank class's busy intervals as tape nodes, each 3 x intervals: the start's node, a duration column taken
    from it (the zero row where the node is the start itself), the end's node; and their calls, so that a stretch
    of calls can be left out by index (`Cut`): the lowest and the highest index of the calls whose ops make each
    span (2 x spans); once `ordered` orders the communication's starts and ends each on its own, 4 x spans there:
    those of the span the start in this column is of, then those of the span the end is of."""

    compute: np.ndarray
    comm: np.ndarray
    compute_calls: np.ndarray
    comm_calls: np.ndarray

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
        compute, compute_calls = _joined(compute, recorded.compute_calls, zero)
        comm, comm_calls = _joined(comm, np.stack((recorded.comm_calls, recorded.comm_calls)), zero)
        return cls(compute, comm, compute_calls, comm_calls)

    def rows(self, row_of: np.ndarray) -> "Spans":
        """The spans with their nodes mapped to rows of values (`tape_program.TapeProgram.row_of`)."""
        spans = (self.compute, self.comm)
        compute, comm = (np.stack((row_of[s[0]], s[1], row_of[s[2]])).astype(np.intp) for s in spans)
        return Spans(compute, comm, self.compute_calls, self.comm_calls)

    def ordered(self, values: np.ndarray, durations: np.ndarray) -> "Spans":
        """The spans (in rows) with the communication's starts in order on one system and its ends in order on it
        (values and durations: a column each), the orders most systems keep but for a few. A communication span
        then no longer pairs its start with its end: only the union is measured, and it reads the starts and the
        ends each sorted on its own."""
        comm, calls = self.comm, self.comm_calls
        starts = np.argsort(values[comm[0]] - durations[comm[1]], kind="stable")
        ends = np.argsort(values[comm[2]], kind="stable")
        ordered = np.stack((comm[0, starts], comm[1, starts], comm[2, ends]))
        return Spans(self.compute, ordered, self.compute_calls, np.vstack((calls[:2, starts], calls[-2:, ends])))


def _joined(spans: np.ndarray, calls: np.ndarray, zero: int) -> tuple[np.ndarray, np.ndarray]:
    """The spans with every chain of one ending at the node the next starts at (its column the zero row) made one
    span, in the order of their first spans, and each one's lowest and highest call (calls: 2 x spans, of each
    span before). Only an end no other span shares is joined on, and a span follows one span at most. Node ids
    grow along a chain (an end comes after its start), so chains never loop."""
    start, column, end = spans
    if not len(start):
        return spans, calls
    ends, first_at, count = np.unique(end, return_index=True, return_counts=True)
    at = np.minimum(np.searchsorted(ends, start), len(ends) - 1)
    follows = np.flatnonzero((column == zero) & (ends[at] == start) & (count[at] == 1))
    before = first_at[at[follows]]
    before, unique = np.unique(before, return_index=True)  # a span ending where two start is followed by one
    follows = follows[unique]
    tail = np.arange(len(start))
    tail[before] = follows
    low, high = calls
    while True:  # pointer jumping: each pass doubles how far along its chain a span's tail (and its calls) is
        further = tail[tail]
        low, high = np.minimum(low, low[tail]), np.maximum(high, high[tail])
        if np.array_equal(further, tail):
            break
        tail = further
    heads = np.ones(len(start), dtype=bool)
    heads[follows] = False
    return np.stack((start[heads], column[heads], end[tail[heads]])), np.stack((low[heads], high[heads]))


BLOCK = 32
"""Systems measured together (`batch_kernels.measure`): their intervals stay in the processor's cache while they are
gathered and measured. The block changes no figure."""


@dataclass(frozen=True, slots=True)
class Cut:
    """A steady stretch of each system's timeline measured by its period rather than interval by interval: from
    A, the end of the two periods the steady checks read (moments `window`, `window` + 1, `window` + 2: M0, M0 + L,
    A = M0 + 2L), to B = A + k L, before which only calls whose times were checked periodic run
    (`batch_steady.Period.cut`). The intervals of the calls inside [A, B] are left out (`batch_kernels.measure`),
    and the totals corrected: with R what is left, total = total_R - (before_R(B) - before_R(A)) + k (before(M0 +
    L) - before(M0)), for the compute, communication and hidden communication alike, since nothing before A is
    left out and every interval reaching past B is kept. It is the assumption the step's extension makes for its
    further periods, for k periods the form has: the figures differ from a full measurement by rounding and by how
    far the periods' busy seconds differ within the window check's tolerance, at most k * 3 * TOLERANCE_S per
    figure (`steady.TOLERANCE_S`; `tests/test_batch_steady_cut.py`). On a longer form each system is cut by its
    own period, the first its timeline shows (`batch_steady.Period.each`); moments of the other periods tried
    that fall inside its [A, B] are measured without its stretch, and are not read for it (`batch._evaluate`)."""

    window: np.ndarray
    """Per system, the index of the moment M0 (its period's first: several periods may be measured at once)."""
    repeats: np.ndarray
    """k per system, 0 where nothing is cut."""
    end: np.ndarray
    """B per system."""
    calls: np.ndarray
    """2 x systems: the first call of a run of calls that all run inside [A, B], and the call after the run (none
    where k is 0)."""


@dataclass(frozen=True, slots=True)
class BusyMany:
    """The busy figures of many systems: `Busy.totals`, and the seconds covered before given moments, from which
    `windows` reads `Busy.between`."""

    totals: tuple[np.ndarray, np.ndarray, np.ndarray]
    """(compute, communication, exposed communication) seconds per system."""
    covered: np.ndarray
    """Per moment, the (compute, communication, hidden communication) seconds before it, per system: moments x 3 x
    systems."""

    @classmethod
    def of(
        cls,
        values: np.ndarray,
        durations: np.ndarray,
        spans: Spans,
        moments: list[np.ndarray],
        blocks: np.ndarray,
        wanted: np.ndarray | None = None,
        cut: Cut | None = None,
    ) -> "BusyMany":
        """From the values of the tape program's rows and the durations (rows x systems both, C-ordered), `spans`
        in rows (`Spans.ordered`); moments: arrays of one time per system; blocks: where each block of systems
        measured together starts (of at most `BLOCK`), and where the last ends; wanted: the systems whose figures
        will be read (all by default), where the others' would be thrown away (their figures are then 0: a steady
        form's systems that show no period are priced again on a longer form); cut: a steady stretch measured by
        its period (`Cut`), if any."""
        systems = values.shape[1]
        at = np.array([*moments, cut.end] if cut else moments, dtype=float).reshape(-1, systems)
        chosen = np.ones(systems, dtype=np.bool_) if wanted is None else wanted
        cuts = cut.calls if cut else np.zeros((2, systems), dtype=np.intp)
        arrays = (spans.compute, spans.comm, spans.compute_calls, spans.comm_calls)
        totals, covered = batch_kernels.measure(values, durations, *arrays, at, blocks, chosen, cuts)
        if cut:
            covered, at_end = covered[:-1], covered[-1]
            columns = np.arange(systems)
            start, one, two = (covered[cut.window + k, :, columns].T for k in range(3))
            corrected = totals - (at_end - two) + cut.repeats * (one - start)
            totals = np.where(cut.repeats > 0, corrected, totals)
        exposed = np.maximum(0.0, totals[1] - totals[2])
        return cls((totals[0], totals[1], exposed), covered)

    def windows(self, moments: slice = slice(None)) -> list[tuple[np.ndarray, ...]]:
        """Between each of the given moments (all by default) and the next of them, the (compute, communication,
        exposed communication) seconds per system, as `Busy.between`."""
        out = []
        for (compute_a, comm_a, hidden_a), (compute_b, comm_b, hidden_b) in pairwise(self.covered[moments]):
            comm = comm_b - comm_a
            out.append((compute_b - compute_a, comm, np.maximum(0.0, comm - (hidden_b - hidden_a))))
        return out
