"""A 1F1B pipeline whose steady state repeats every pp micro-batches, not every one, priced from its longer steady
form (`SteadyForm.longer`) to the whole step's figures.

Tiny-Llama at tp 8 without sp on four nodes of a DGX H100 whose InfiniBand runs at 5 GB/s: each stage's
activation and gradient sends queue on its one slow link, and a delay travels round the four stages and comes back
every four micro-batches (GPT-3 175B at tp 8, pp 16 on 1,024 H100s does the same every 16).
"""

from dataclasses import replace

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel, steady
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.engine import ClassSchedule
from simulators.analytical.steady import schedule_steady
from simulators.analytical.steady_reads import reads
from tests.helpers import make_point

SLOW_IB = {"base": "dgx-h100", "network": {1: {"npus": 4, "bandwidth_GBps": 5}}}


def _point(micro_batches: int, system: dict = SLOW_IB):
    return make_point("tiny-llama", system, seq_len=1024, global_batch=micro_batches, tp=8, pp=4, dp=1, sp=False)


def _whole(micro_batches: int):
    point = _point(micro_batches)
    workload = SymbolicGenerator().generate(point)
    return AnalyticalCostModel().simulate(replace(workload, steady=None, point_key="whole"), point.system)


def test_the_timeline_repeats_every_pp_micro_batches_and_not_every_one():
    """Two independent readings of the whole step: four more micro-batches add the same time wherever they are
    added, one more does not add a quarter of that."""
    t = {m: _whole(m).step_time_s for m in (38, 39, 42, 46)}
    assert t[46] - t[42] == pytest.approx(t[42] - t[38], rel=1e-9)
    assert abs((t[39] - t[38]) - (t[42] - t[38]) / 4) > 1e-3 * (t[42] - t[38]) / 4


def test_the_longer_form_prices_the_step_as_its_own_programs_do():
    point = _point(42)
    workload = SymbolicGenerator().generate(point)
    form = workload.steady
    assert (form.microbatches, form.period, form.repeats) == (8, 1, 34)  # p + 4
    longer = form.longer()
    assert (longer.microbatches, longer.period, longer.repeats) == (18, 4, 6)  # 4p, 42 - 16 mod 4 more
    shorter_only = replace(workload, steady=replace(form, build_longer=None))
    assert schedule_steady(shorter_only, point.system) is None, "the shorter form repeats: this test shows nothing"
    assert schedule_steady(workload, point.system) is not None
    steady = AnalyticalCostModel().simulate(workload, point.system)
    whole = _whole(42)
    assert steady.step_time_s == pytest.approx(whole.step_time_s, rel=1e-9)
    for s, w in zip(steady.classes, whole.classes, strict=True):
        for field in ("end_s", "compute_s", "comm_s", "exposed_comm_s"):
            assert getattr(s, field) == pytest.approx(getattr(w, field), rel=1e-9, abs=1e-15), field
        assert s.peak_memory_bytes == pytest.approx(w.peak_memory_bytes, rel=1e-12)
        assert s.time_by_category == pytest.approx(w.time_by_category, rel=1e-9)


def _same(a: ClassSchedule, b: ClassSchedule) -> None:
    for field in ("end_s", "compute_s", "comm_s", "exposed_comm_s", "time_by_category"):
        assert getattr(a, field) == getattr(b, field), field
    for field in ("call_start", "call_end"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert a.transfers is not None and b.transfers is not None
    for mine, theirs in zip(a.transfers, b.transfers, strict=True):
        assert np.array_equal(mine, theirs)


def test_the_longer_form_planned_by_the_shorter_forms_planner_schedules_as_with_its_own():
    """`CompiledScheduler.for_programs`: the longer form planned by the shorter form's planner (`steady._extended`)
    schedules to the bit as with a planner of its own, and the shorter form's schedules built after it are
    unchanged (the planner may have numbered more streams and categories since)."""
    point = _point(42)
    workload = SymbolicGenerator().generate(point)
    form = workload.steady
    longer = form.longer()
    shorter = CompiledScheduler(replace(workload, programs=form.programs, steady=None), point.system)
    tables = shorter.drive()
    before = shorter.schedules(tables)
    shared = shorter.for_programs(longer.programs)
    assert shared._planner is shorter._planner
    own = CompiledScheduler(replace(workload, programs=longer.programs, steady=None), point.system)
    for a, b in zip(shared.run(), own.run(), strict=True):
        _same(a, b)
    for a, b in zip(shorter.schedules(tables), before, strict=True):
        _same(a, b)


def test_a_step_whose_shorter_form_repeats_never_builds_the_longer_one():
    point = _point(42, {"base": "dgx-h100", "network": {1: {"npus": 4}}})  # 50 GB/s: every micro-batch alike
    workload = SymbolicGenerator().generate(point)
    AnalyticalCostModel().simulate(workload, point.system)
    assert workload.steady.build_longer is not None


def test_only_1f1b_steps_longer_than_the_longer_form_have_one():
    assert SymbolicGenerator().generate(_point(18)).steady.longer() is None  # 18 micro-batches: the form itself
    interleaved = make_point(tp=2, pp=4, dp=2, pp_schedule="interleaved", virtual_stages=2, global_batch=128)
    assert SymbolicGenerator().generate(interleaved).steady.longer() is None


def test_a_period_is_ruled_out_by_the_first_stage_read_and_read_from_the_one_that_last_did():
    """`steady._steady_runs` stops at the first stage whose run does not span two periods, reading the stages
    from the one that ruled the period out on the form's last timeline (kept with its calls by `_periods`); which
    stage it starts from changes no run it finds. On the longer form, periods 1 and 2 are too short on every
    stage (runs of 6 calls, a period 6 and 12), period 4 spans two on every one."""
    point = _point(42)
    workload = SymbolicGenerator().generate(point)
    longer = workload.steady.longer()
    tables = CompiledScheduler(replace(workload, programs=longer.programs, steady=None), point.system).drive()
    read = reads(workload.blocks, longer.programs)

    def runs(period: int, first: int) -> tuple[np.ndarray, np.ndarray, int]:
        distance, middle, twin, twin_ptr = steady._joined_twins(longer.programs, period, read)
        times = tables.call_start, tables.call_end, tables.base, steady.TOLERANCE_S
        _, lo, hi, failed = steady._steady_runs(twin, twin_ptr, distance, middle, *times, first)
        return lo, hi, failed

    for first in range(4):
        lo, hi, failed = runs(1, first)
        assert failed == first and np.flatnonzero(lo >= 0).tolist() == [first] and hi[first] - lo[first] == 6
        lo, hi, failed = runs(4, first)
        assert failed == -1 and (lo.tolist(), hi.tolist()) == ([24, 26, 15, 12], [75, 78, 81, 84])
    read.memo[("steady.ruled_out_on", 2)] = 3
    assert steady._periods(longer.programs, tables, 2, read) is None
    assert read.memo[("steady.ruled_out_on", 2)] == 3
    assert steady._periods(longer.programs, tables, 4, read) is not None
    assert ("steady.ruled_out_on", 4) not in read.memo
