"""A 1F1B stage's skeleton over a longer form or the whole step spliced from its steady form's (`splice`) is the
one its walk makes: calls, tags, tensors, p2p blocks and step marks alike, and the programs filled from it too."""

import numpy as np
import pytest
from helpers import make_point

import generators.symbolic.pipeline as pipeline
import generators.symbolic.skeleton as skeleton
from dse.workload import Program, columns_of
from generators.symbolic.generator import SymbolicGenerator
from generators.symbolic.pipeline import Pipeline
from generators.symbolic.schedule import one_f_one_b, steady_microbatches
from generators.symbolic.skeleton import Skeleton
from generators.symbolic.splice import _Steps, fewest_microbatches

CASES = {
    "pp2": (dict(pp=2), 30),
    "pp2-zero1-blocking": (dict(pp=2, dp=2, zero=1, overlap_p2p_comm=False), 72),
    "pp4-recompute": (dict(pp=4, recompute="full"), 41),
    "pp4-blocking-selective": (dict(pp=4, overlap_p2p_comm=False, recompute="selective"), 48),
    "pp8-tp2-sp": (dict(pp=8, tp=2, sp=True), 60),
    "pp8-tp2-blocking": (dict(pp=8, tp=2, overlap_p2p_comm=False), 96),
    "pp8-zero1-dp2": (dict(pp=8, dp=2, zero=1), 2 * 77),
    "pp4-zero2-dp2": (dict(pp=4, dp=2, zero=2), 2 * 40),
    "pp4-zero2-dp2-synced-per-microbatch": (dict(pp=4, dp=2, zero=2, grad_reduce="per_microbatch"), 2 * 40),
    "pp4-zero3-dp2": (dict(pp=4, dp=2, zero=3), 2 * 40),
}
WALKED = {"pp4-zero2-dp2-synced-per-microbatch", "pp4-zero3-dp2"}
"""Cases whose stages issue per micro-batch outside the steady pairs (gradient syncs, weight gathers): walked."""


def programs_and_skeletons(point, monkeypatch) -> tuple[list[list[Program]], list[Skeleton]]:
    """The programs of a point's steady form, its longer form and its whole step, made with empty skeleton
    caches, and the skeletons its stages took, in order."""
    skeleton._SKELETONS.clear()
    skeleton._STEPS.clear()
    kept: list[Skeleton] = []
    keep = pipeline.keep_skeleton
    monkeypatch.setattr(pipeline, "keep_skeleton", lambda key, made: (kept.append(made), keep(key, made)))
    workload = SymbolicGenerator().generate(point)
    assert workload.steady is not None
    longer = workload.steady.longer()
    assert longer is not None and longer is not workload.steady
    forms = [workload.steady.programs, longer.programs, list(workload.programs)]
    monkeypatch.undo()
    return forms, kept


def same_skeleton(a: Skeleton, b: Skeleton) -> bool:
    tables = [(t.names, t.kinds, t.producer, t.consumer, t.kind) for t in (a.table, b.table)]
    columns = [(x.dtype, x.tolist()) for x in (*tables[0][2:], a.source_of)]
    assert columns == [(x.dtype, x.tolist()) for x in (*tables[1][2:], b.source_of)]
    return (a.shape.calls, a.p2p, a.table.names, a.table.kinds, a.sources, a.marks) == (
        b.shape.calls,
        b.p2p,
        b.table.names,
        b.table.kinds,
        b.sources,
        b.marks,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_a_spliced_skeleton_is_the_walked_one(case, monkeypatch):
    parallel, global_batch = CASES[case]
    point = make_point("llama3-8b", global_batch=global_batch, **parallel)
    spliced: list[Skeleton | None] = []
    splice = pipeline.splice
    monkeypatch.setattr(pipeline, "splice", lambda *args: spliced.append(splice(*args)) or spliced[-1])
    forms, skeletons = programs_and_skeletons(point, monkeypatch)
    monkeypatch.setattr(Pipeline, "spliceable", lambda self: False)
    walked_forms, walked = programs_and_skeletons(point, monkeypatch)

    if case in WALKED:
        assert not spliced
    else:
        assert len(spliced) == 2 * point.parallel.pp and all(s is not None for s in spliced)
    assert len(skeletons) == len(walked) == 3 * point.parallel.pp
    assert all(same_skeleton(a, b) for a, b in zip(skeletons, walked, strict=True))
    for programs, walked_programs in zip(forms, walked_forms, strict=True):
        for a, b in zip(programs, walked_programs, strict=True):
            assert list(a.calls) == list(b.calls)
            for x, y in zip(columns_of(a.tensors), columns_of(b.tensors), strict=True):
                assert np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)


def steady_programs(point) -> tuple[list, list[Program]]:
    """A fresh generator's workload's blocks and steady-form programs for the point, with the caches as they are."""
    workload = SymbolicGenerator().generate(point)
    assert workload.steady is not None
    return workload.blocks, workload.steady.programs


@pytest.mark.parametrize(
    "case", [case for case in CASES if case not in WALKED and CASES[case][0].get("overlap_p2p_comm", True)]
)
def test_a_skeleton_spliced_from_an_earlier_points_is_the_walked_one(case, monkeypatch):
    """A stage first seen over more micro-batches than an earlier point of its shape took is spliced from that
    point's skeleton, not walked, and gives the programs a walk does, then and when reused. Every 1F1B point of a
    shape that has a steady form has the same one (p + 4 micro-batches), so the earlier point is a step of p + 3,
    which has none, the fewest a first stage's skeleton is spliced from. Not with blocking sends: over p + 3, the
    pairs of one stage read its last warm-up forward, and with blocking sends that forward's calls a micro-batch on
    are not the first steady forward's, so `splice` declines and that stage is walked (correct, only slower)."""
    parallel, global_batch = CASES[case]
    point = make_point("llama3-8b", global_batch=global_batch, **parallel)
    microbatches = steady_microbatches(point)
    assert microbatches is not None
    dp = point.parallel.dp
    fewer = make_point("llama3-8b", global_batch=dp * (microbatches - 1), **parallel)
    assert steady_microbatches(fewer) is None
    assert fewer.micro_batches == microbatches - 1 == fewest_microbatches(point.parallel.pp, 0)
    skeleton._SKELETONS.clear()
    skeleton._STEPS.clear()
    walked = steady_programs(point)
    skeleton._SKELETONS.clear()
    skeleton._STEPS.clear()
    SymbolicGenerator().generate(fewer)
    walks: list[int] = []
    walk = pipeline.walk
    monkeypatch.setattr(pipeline, "walk", lambda *args: walks.append(args[2]) or walk(*args))
    spliced = steady_programs(point)
    reused = steady_programs(point)
    assert not walks
    for blocks, programs in (spliced, reused):
        assert blocks == walked[0]
        for a, b in zip(programs, walked[1], strict=True):
            assert list(a.calls) == list(b.calls)
            for x, y in zip(columns_of(a.tensors), columns_of(b.tensors), strict=True):
                assert np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)


@pytest.mark.parametrize(("stages", "stage", "microbatches"), [(4, 0, 8), (8, 0, 12), (8, 5, 12), (16, 3, 20)])
def test_the_splice_finds_each_step_and_moves_reads_by_micro_batches(stages, stage, microbatches):
    """`_Steps` places every forward and backward where `one_f_one_b` runs it, and moves a call in a step to the
    same place in the step of its kind a micro-batch on: warm-up forwards onto steady ones too."""
    steps = one_f_one_b(stages, stage, microbatches)
    warmup = min(stages - stage - 1, microbatches)
    located = _Steps(warmup, microbatches, np.arange(len(steps)) * 3, 3 * len(steps))
    backward = np.array([kind == "B" for kind, _ in steps])
    assert located.of(backward, np.array([mb for _, mb in steps])).tolist() == list(range(len(steps)))
    place = {step: i for i, step in enumerate(steps)}
    calls = np.array([c for c in range(3 * len(steps)) if (steps[c // 3][0], steps[c // 3][1] + 1) in place])
    expected = [3 * place[(kind, mb + 1)] + c % 3 for c in calls.tolist() for kind, mb in [steps[c // 3]]]
    assert located.mover(0, np.array([1]), located)(calls).ravel().tolist() == expected
