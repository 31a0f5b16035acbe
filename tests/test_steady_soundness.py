"""A drain that recurs over as many calls as the steady state, and stages whose steady runs do not meet: the
periodicity rule (`steady._periods`, `steady_reads.Reads.joined`) must extend neither.

Stage 0 of a 1F1B pipeline ends in p - 1 backwards, one a period apart, so the drain is a run of calls recurring
at the period's length, at half a micro-batch's calls (a backward's). Llama-2-13B on eight stages with ZeRO-3 and
selective recompute has 14 calls a micro-batch on stage 0: its drain recurs at 7 calls over 44, more than the 35
over which a steady form of 11 micro-batches (p + 3, where the generator's base is p + 4) repeats at 14. A rule
that took the longest run at any distance at which calls recur, and asked of it only that it span two distances
(X1's relaxed rule), extends the drain there: every other stage shows its steady state at the same length, so
each added period gets stage 0 one backward's busy seconds instead of a forward's and a backward's (its compute
11% and its sends 35% short over 17 micro-batches). The rule takes the distance of one period's micro-batches
(14 calls), which the drain does not recur at, so the form prices the step as the whole step does.
"""

from dataclasses import replace

import numpy as np
import pytest

from dse.interfaces import SimResult
from dse.workload import Workload
from generators.symbolic import SymbolicGenerator, schedule
from simulators.analytical import AnalyticalCostModel, steady
from simulators.analytical.calls import call_array
from simulators.analytical.cost_model import BATCH_FROM
from tests.helpers import make_point, steady_runs
from tests.test_steady_reads import POINT

SHORT, STEP = 11, 17
"""The steady form's micro-batches (p + 3) and the step's."""


@pytest.fixture(scope="module")
def drained():
    """The point with a steady form of SHORT micro-batches (the generator's own would be p + 4 or more), its
    stages' runs as `_periods` finds them, and stage 0's calls' times."""
    point = make_point(**{**POINT, "global_batch": 4 * STEP})  # test_steady_reads' point, 17 micro-batches
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedule, "steady_microbatches", lambda _: SHORT)
        workload = SymbolicGenerator().generate(point)
    form = workload.steady
    assert (form.microbatches, form.period, form.repeats) == (SHORT, 1, STEP - SHORT)
    times, _, runs = steady_runs(workload, point.system)
    return point, workload, runs, times[0]


def test_stage_0s_drain_recurs_longer_than_its_steady_state_and_is_not_taken(drained):
    """The case as built: stage 0's drain backwards recur 7 calls apart, a period's length later, over a run
    longer than the steady run `_periods` takes, which recurs at 14 calls (a micro-batch's) and ends before the
    drain's begins."""
    _, workload, runs, (start, end) = drained
    program = workload.steady.programs[0]
    microbatch, block = call_array(program, "microbatch"), call_array(program, "block")
    length, first, distance, _, (lo, hi) = runs[0]
    assert distance == np.count_nonzero(microbatch == microbatch[first]) == 14
    half = distance // 2
    twin = (block[:-half] == block[half:]) & (microbatch[:-half] >= 0) & (microbatch[half:] == microbatch[:-half] + 1)
    drain_lo, drain_hi = steady._longest_steady(twin, start, end, half, length, steady.TOLERANCE_S)
    assert drain_hi - drain_lo >= max(hi - lo, 2 * half) and drain_lo >= hi


def test_the_step_from_the_short_form_is_the_whole_step(drained):
    """Every stage shows its steady state, and every figure of the step priced from the form, per point and in a
    batch, is the whole step's (where the drain was extended, stage 0's compute was 11% and its sends 35% short)."""
    point, workload, runs, _ = drained
    assert runs is not None
    model = AnalyticalCostModel()
    assert steady.schedule_steady(workload, point.system) is not None
    whole = model.simulate(_whole(workload), point.system)
    _assert_whole(model.simulate(workload, point.system), whole)
    _assert_whole(model.simulate_many(workload, [point.system] * BATCH_FROM)[0], whole)


def test_stages_whose_steady_runs_do_not_meet_are_not_extended(monkeypatch):
    """Mixtral-8x7B at tp 4, pp 8, dp 4 with ZeRO-1 runs 27 micro-batches, here from a steady form of 15 (the
    generator's own, p + 4, leaves stage 4 no steady run, which rules it out before the stages are joined). Its step
    does not grow by one period a micro-batch (every eighth adds 110 us more), and on the form's timeline every stage
    repeats at one period's length, but not over one stretch of time: stage 7's longest run ends before those of stages
    5 and 6 begin. Each stage on its own passes, so the transfers that join the stages (`Reads.joined`) are what rule
    the form out, and the step is priced as the whole step is, per point and in a batch (where that check was left out,
    the step was 2.2e-4 and stage 4's communication 0.6% short)."""
    point = make_point(
        "mixtral-8x7b",
        {"base": "dgx-h100", "network": {1: {"npus": 16}}},
        seq_len=4096,
        global_batch=4 * 27,
        tp=4,
        pp=8,
        dp=4,
        zero=1,
        recompute="selective",
    )
    monkeypatch.setattr(schedule, "steady_microbatches", lambda _: 15)
    workload = SymbolicGenerator().generate(point)
    form = workload.steady
    assert (form.microbatches, form.period) == (15, 1)
    times, read, runs = steady_runs(workload, point.system)
    assert runs is not None
    lengths = [run[0] for run in runs]
    assert max(lengths) - min(lengths) <= steady.TOLERANCE_S
    lo, hi, distance = (
        np.array([[value] for value in column]) for column in zip(*[(*r[4], r[2]) for r in runs], strict=True)
    )
    assert times[7][0][hi[7, 0]] < times[5][0][lo[5, 0]]  # stage 7's run over before stage 5's begins
    assert not read.joined(lo, hi, distance)[0]
    model = AnalyticalCostModel()
    whole = model.simulate(_whole(workload), point.system)
    _assert_whole(model.simulate(workload, point.system), whole)
    _assert_whole(model.simulate_many(workload, [point.system] * BATCH_FROM)[0], whole)


def _whole(workload: Workload) -> Workload:
    """The step priced from its own programs: no steady form, another key so the results cache does not answer."""
    return replace(workload, steady=None, point_key="whole")


def _assert_whole(result: SimResult, whole: SimResult) -> None:
    """Every figure of `result` is the whole step's, to rounding."""
    assert result.step_time_s == pytest.approx(whole.step_time_s, rel=1e-9)
    for s, w in zip(result.classes, whole.classes, strict=True):
        for field in ("end_s", "compute_s", "comm_s", "exposed_comm_s"):
            assert getattr(s, field) == pytest.approx(getattr(w, field), rel=1e-9), field
        assert s.time_by_category == pytest.approx(w.time_by_category, rel=1e-9)
