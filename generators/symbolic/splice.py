"""A 1F1B stage's skeleton over more micro-batches made from its skeleton over fewer (`splice`), not walked.

A point whose steady form fails its period check is priced on a longer form or the whole step (`steady_form`),
up to ten times the micro-batches, and walking every stage over all of them cost more than pricing the point.
A 1F1B stage over m + k micro-batches runs its steps over m with k more steady pairs (a forward of the next
micro-batch and a backward) before its last two: the calls and tensors of those pairs repeat the pair before
them with micro-batches (and p2p tags) one further on, and the calls after them are those over m with
micro-batches k further on. A call moved r micro-batches on reads either calls before the first forward
the pairs read, which stay, or a step of some micro-batch, and then the same place in the step of that kind r
micro-batches on (`_Steps.mover`): a backward reads its forward's activations, which on an early stage of a
short form (under 2(p - s) + 4 micro-batches) is a warm-up forward, so the reads follow the steps rather than
a stride of whole pairs. Only a stage whose walk shows that repetition over the steps the inserted pairs read
is spliced (`Pipeline.spliceable` says which schedules qualify); `None` otherwise, and the stage is walked."""

from collections.abc import Callable
from functools import cached_property
from itertools import pairwise

import numpy as np

from dse.calls import CallColumns
from dse.workload import CallShape, OpKind, TensorTable
from generators.symbolic.skeleton import Skeleton


class _Steps:
    """Where a 1F1B stage's steps start among its calls (`one_f_one_b`: `warmup` forwards, then pairs of a forward
    and a backward, then the backwards left), to move a call's reads to the same step micro-batches on."""

    def __init__(self, warmup: int, microbatches: int, starts: np.ndarray, calls: int) -> None:
        self.warmup, self.microbatches, self.starts, self.calls = warmup, microbatches, starts, calls
        """`starts`: per step, the calls made before it; `calls`: all of them."""

    @cached_property
    def step_of(self) -> np.ndarray:
        """Per call, its step."""
        return np.repeat(np.arange(len(self.starts)), np.diff(self.starts, append=self.calls))

    def of(self, backward: np.ndarray, microbatch: np.ndarray) -> np.ndarray:
        """The step that runs each forward (or backward) of a micro-batch."""
        w, m = self.warmup, self.microbatches
        forward = np.where(microbatch < w, microbatch, 2 * microbatch - w)
        return np.where(backward, np.where(microbatch < m - w, w + 2 * microbatch + 1, m + microbatch), forward)

    def mover(self, cut: int, repeats: np.ndarray, onto: "_Steps") -> "Reads":
        """What moves calls, per repeat r, each from `cut` on to its place in the step of its kind r
        micro-batches on among `onto`'s steps; calls before `cut` stay. Worked out per step, gathered per call."""
        steps, w, m = np.arange(len(self.starts)), self.warmup, self.microbatches
        backward = (steps >= w) & (((steps - w) % 2 == 1) | (steps >= 2 * m - w))
        microbatch = np.where(backward, np.where(steps < 2 * m - w, (steps - w) // 2, steps - m), (steps + w) // 2)
        microbatch = np.where(steps < w, steps, microbatch)
        # steps past `onto`'s last are never read by what is moved (reads go back): any of them will do
        step = np.minimum(onto.of(backward[None, :], microbatch[None, :] + repeats[:, None]), len(onto.starts) - 1)
        by = onto.starts[step] - self.starts
        step_of = self.step_of

        def move(calls: np.ndarray) -> np.ndarray:
            return calls[None, :] + by[:, step_of[calls]] * (calls >= cut)[None, :]

        return move


Reads = Callable[[np.ndarray], np.ndarray]
"""Calls (or tensors' producers and consumers) moved on: one row per repeat (`_Steps.mover`)."""


def moved(calls: CallColumns, reads_of: Reads, repeats: np.ndarray, first_microbatch: int) -> CallColumns:
    """`calls` once per repeat r: r micro-batches on, reading what `reads_of` moves their reads to for r;
    micro-batches before `first_microbatch` (and the optimizer step's -1) stay, and so do their p2p tags (0 for
    other calls). As columns: tuples per call (a longer form's thousands a stage) cost more than the splice's
    arithmetic, and a cost model reads the columns (`CallShape.columns`)."""
    count = len(repeats)
    on = repeats[:, None] * (calls.microbatch >= first_microbatch)[None, :]
    return CallColumns(
        np.tile(calls.block, count),
        reads_of(calls.inputs).ravel(),
        np.tile(calls.input_counts, count),
        np.tile(calls.layer, count),
        (calls.microbatch[None, :] + on).ravel(),
        (calls.tag[None, :] + 2 * on * (calls.tag != 0)[None, :]).ravel(),
    )


def fewest_microbatches(stages: int, stage: int) -> int:
    """The fewest micro-batches of a 1F1B stage's skeleton that `splice` can lengthen: its warm-up forwards and four
    steady pairs, whatever its drain."""
    return stages - stage - 1 + 4


def splice(
    short: Skeleton,
    stages: int,
    stage: int,
    microbatches: int,
    more: int,
    p2p: tuple[tuple[OpKind, int, str], ...] = (),
) -> Skeleton | None:
    """The skeleton of a 1F1B `stage` over `microbatches` + `more` micro-batches, from its skeleton over
    `microbatches`; None if that one does not repeat as the splice needs. The inserted pairs send and receive
    through the p2p blocks of the shorter one; `p2p` are those of them the caller makes for it (none when the
    shorter form's walk made them on the same pipeline)."""
    warmup = min(stages - stage - 1, microbatches)
    at = microbatches - warmup - 2
    """The steady pair before which the new ones go (`one_f_one_b`: pair j is steps warmup + 2j and + 1)."""
    if microbatches < fewest_microbatches(stages, stage) or more <= 0:
        return None
    calls, table = short.shape.columns(), short.table
    count = len(calls.block)
    steps = _Steps(warmup, microbatches, np.array([c for c, _ in short.marks]), count)
    cut_step = int(steps.of(np.array(False), np.array(at - 2)))
    """The forward of micro-batch at - 2, one before the forward that the backward of the pair before `at` reads:
    calls from it on move with the micro-batches, calls before it stay."""
    cut = short.marks[cut_step][0]
    starts = [short.marks[warmup + 2 * j] for j in range(max(at - warmup - 2, 0), at + 2)]
    insert, row_insert = starts[-2]
    period, row_period = insert - starts[-3][0], row_insert - starts[-3][1]
    if any((c1 - c0, r1 - r0) != (period, row_period) for (c0, r0), (c1, r1) in pairwise(starts)):
        return None
    forwards = steps.of(np.array(False), np.arange(at - 2, microbatches)).tolist()
    if len({tuple(np.subtract(short.marks[s + 1], short.marks[s])) for s in forwards}) != 1:
        return None
    one = np.array([1])
    on_short = steps.mover(cut, one, steps)
    template = calls.span(insert - period, insert)
    rows = slice(row_insert - row_period, row_insert)
    after = slice(row_insert, row_insert + row_period)
    # the pair at `at` must be the one before it moved on, calls and tensors alike; and where the pairs read
    # warm-up forwards, the first steady forward the last warm-up one moved on
    if not moved(template, on_short, one, 0).same(calls.span(insert, insert + period)):
        return None
    if at - 2 < warmup < microbatches:
        (c0, _), (c1, _) = short.marks[warmup - 1], short.marks[warmup]
        if not moved(calls.span(c0, c1), on_short, one, 0).same(calls.span(c1, c1 + c1 - c0)):
            return None
    if (
        table.names[rows] != table.names[after]
        or table.kinds[rows] != table.kinds[after]
        or not np.array_equal(short.source_of[rows], short.source_of[after])
        or not np.array_equal(on_short(table.producer[rows]).ravel(), table.producer[after])
        or not np.array_equal(on_short(table.consumer[rows]).ravel(), table.consumer[after])
    ):
        return None
    step = warmup + 2 * at
    template_marks = short.marks[step - 2 : step]
    marks = short.marks[:step]
    marks += tuple((c + r * period, t + r * row_period) for r in range(1, more + 1) for c, t in template_marks)
    marks += tuple((c + more * period, t + more * row_period) for c, t in short.marks[step:])
    longer = _Steps(warmup, microbatches + more, np.array([c for c, _ in marks]), count + more * period)
    repeats = np.arange(1, more + 1)
    on_pairs, on_tail = steps.mover(cut, repeats, longer), steps.mover(cut, np.array([more]), longer)
    spliced = CallColumns.joined(
        [
            calls.span(0, insert),
            moved(template, on_pairs, repeats, 0),
            moved(calls.span(insert, count), on_tail, np.array([more]), at),
        ]
    )
    head = slice(None, row_insert)
    rest = slice(row_insert, None)

    def column(values: np.ndarray) -> np.ndarray:
        return np.concatenate([values[head], on_pairs(values[rows]).ravel(), on_tail(values[rest]).ravel()]).astype(
            np.intp, copy=False
        )

    def repeated(values: tuple | np.ndarray) -> tuple | np.ndarray:
        if isinstance(values, tuple):
            return values[head] + values[rows] * more + values[rest]
        return np.concatenate([values[head], np.tile(values[rows], more), values[rest]])

    return Skeleton(
        CallShape(columns=spliced),
        p2p,
        TensorTable(
            repeated(table.names),
            repeated(table.kinds),
            column(table.producer),
            column(table.consumer),
            repeated(table.kind),
        ),
        short.sources,
        repeated(short.source_of),
        marks,
    )
