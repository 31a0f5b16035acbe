"""A 1F1B stage's skeleton over more micro-batches made from its skeleton over fewer (`splice`), not walked.

A point whose steady form fails its period check is priced on a longer form or the whole step (`steady_form`),
up to ten times the micro-batches, and walking every stage over all of them cost more than pricing the point.
A 1F1B stage over m + k micro-batches runs its steps over m with k more steady pairs (a forward of the next
micro-batch and a backward) before its last two: the calls and tensors of those pairs repeat the pair before
them with micro-batches (and p2p tags) one further on and the calls they read one period further on, and the
calls after them are those over m moved by k pairs. Only a stage whose walk shows that repetition over the
pairs the inserted ones read is spliced (`Pipeline.spliceable` says which schedules qualify); `None` otherwise,
and the stage is walked."""

from collections.abc import Sequence
from itertools import chain, pairwise

import numpy as np

from dse.workload import Call, CallShape, OpKind, TensorTable
from generators.symbolic.skeleton import Skeleton

_new = tuple.__new__


def moved(calls: Sequence[Call], repeats: np.ndarray, period: int, cut: int, first_microbatch: int) -> list[Call]:
    """`calls` once per repeat r: r micro-batches on, reading the calls from `cut` on r periods further on;
    micro-batches before `first_microbatch` (and the optimizer step's -1) stay, and so do their p2p tags (0 for
    other calls). In arrays, then one tuple per call: a Python function per call cost nearly what the walk did."""
    blocks, inputs, layers, microbatches, tags = zip(*calls, strict=True)
    ends = np.cumsum([len(read) for read in inputs]).tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    flat = np.fromiter(chain.from_iterable(inputs), dtype=np.int64, count=ends[-1] if ends else 0)
    read = (flat[None, :] + (period * repeats)[:, None] * (flat >= cut)[None, :]).tolist()
    mb, tag = np.array(microbatches), np.array(tags)
    on = repeats[:, None] * (mb >= first_microbatch)[None, :]
    mbs, tags = (mb[None, :] + on).ravel().tolist(), (tag[None, :] + 2 * on * (tag != 0)[None, :]).ravel().tolist()
    reads = [tuple(row[start:end]) for row in read for start, end in spans]
    count = len(repeats)
    return [_new(Call, fields) for fields in zip(blocks * count, reads, layers * count, mbs, tags, strict=True)]


def _moved_rows(rows: np.ndarray, cut: int, by: np.ndarray) -> np.ndarray:
    """Producer or consumer calls of rows, each repeat `by[i]` calls on from `cut` on: one array of all repeats."""
    return (rows[None, :] + by[:, None] * (rows >= cut)[None, :]).ravel()


def fewest_microbatches(stages: int, stage: int) -> int:
    """The fewest micro-batches of a 1F1B stage's skeleton that `splice` can lengthen: its warm-up forwards, two
    steady pairs before the last two and as many drain backwards as warm-up forwards."""
    return 2 * (stages - stage - 1) + 4


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
    first = at - warmup - 2
    """The first pair the last one before `at` reads from: its forwards' backward and the step before them."""
    if microbatches < fewest_microbatches(stages, stage) or more <= 0:
        return None
    starts = [short.marks[warmup + 2 * j] for j in range(first, at + 2)]
    cut, (insert, row_insert) = starts[0][0], starts[-2]
    period, row_period = insert - starts[-3][0], row_insert - starts[-3][1]
    if any((c1 - c0, r1 - r0) != (period, row_period) for (c0, r0), (c1, r1) in pairwise(starts)):
        return None
    calls, table = short.shape.calls, short.table
    template = calls[insert - period : insert]
    rows = slice(row_insert - row_period, row_insert)
    after = slice(row_insert, row_insert + row_period)
    # the pair at `at` must be the one before it moved on, calls and tensors alike
    if moved(template, np.array([1]), period, cut, 0) != list(calls[insert : insert + period]):
        return None
    one = np.array([period])
    if (
        table.names[rows] != table.names[after]
        or table.kinds[rows] != table.kinds[after]
        or not np.array_equal(short.source_of[rows], short.source_of[after])
        or not np.array_equal(_moved_rows(table.producer[rows], cut, one), table.producer[after])
        or not np.array_equal(_moved_rows(table.consumer[rows], cut, one), table.consumer[after])
    ):
        return None
    repeats = np.arange(1, more + 1)
    spliced = [
        *calls[:insert],
        *moved(template, repeats, period, cut, 0),
        *moved(calls[insert:], repeats[-1:], period, cut, at),
    ]
    by, tail = period * repeats, period * repeats[-1:]
    head = slice(None, row_insert)
    rest = slice(row_insert, None)

    def column(values: np.ndarray) -> np.ndarray:
        return np.concatenate(
            [values[head], _moved_rows(values[rows], cut, by), _moved_rows(values[rest], cut, tail)]
        ).astype(np.intp, copy=False)

    def repeated(values: tuple | np.ndarray) -> tuple | np.ndarray:
        if isinstance(values, tuple):
            return values[head] + values[rows] * more + values[rest]
        return np.concatenate([values[head], np.tile(values[rows], more), values[rest]])

    step = warmup + 2 * at
    template_marks = short.marks[step - 2 : step]
    marks = short.marks[:step]
    marks += tuple((c + r * period, t + r * row_period) for r in range(1, more + 1) for c, t in template_marks)
    marks += tuple((c + more * period, t + more * row_period) for c, t in short.marks[step:])
    return Skeleton(
        CallShape(tuple(spliced)),
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
