"""The compiled engine's fast-forward (`engine_kernel.drive` lays out a layer run's remaining calls by shift once
one repeats the call before) agrees with issuing every op: each time within the bound the shift check allows
(`SHIFT_ABS_S` per call laid out, plus rounding), on every case of the fast path's tests and on GPT-3 175B at
tp 4, pp 8; and it does lay calls out (it is not silently off)."""

from dataclasses import replace

import numpy as np
import pytest

from dse.workload import Workload
from generators.symbolic import SymbolicGenerator
from simulators.analytical import engine_kernel as kernel
from simulators.analytical.call_layout import layer_runs
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.engine_kernel import _repeat
from simulators.analytical.op_rows import anchored_plans
from tests.helpers import make_point
from tests.test_analytical_fastpath import CASES

ROUNDING = 1e-12
"""Relative: what rounding differently moves a time or a sum of the few thousand intervals of these schedules."""

GPT3 = {"base": "gpt3-175b", "flash_attention": False, "dropout": True}
FOUR_NODES = {"base": "dgx-h100", "network": {1: {"npus": 4}}}


class _Recording(CompiledScheduler):
    """Keeps the tables the kernel filled."""

    def schedules(self, t: kernel.EngineTables):
        self.tables = t
        return super().schedules(t)


def _both(workload: Workload, system) -> tuple[_Recording, _Recording]:
    on, off = _Recording(workload, system), _Recording(workload, system, fast_forward=False)
    on.run_schedules, off.run_schedules = on.run(), off.run()
    return on, off


def _check(on: _Recording, off: _Recording) -> None:
    """Every time within the shift bound times the longest layer run, every total within rounding."""
    runs = on.tables.run_last[on.tables.run_last >= 0]
    longest = 1 + int(np.bincount(runs).max(initial=0))
    copied = int(on.tables.counters[kernel.COPIED])  # each moves later calls by at most one check's bound more
    for a, b in zip(on.run_schedules, off.run_schedules, strict=True):
        bound = (longest + copied) * kernel.SHIFT_ABS_S + ROUNDING * b.end_s
        assert np.abs(np.asarray(a.call_start) - np.asarray(b.call_start)).max(initial=0.0) <= bound
        assert np.abs(np.asarray(a.call_end) - np.asarray(b.call_end)).max(initial=0.0) <= bound
        assert a.end_s == pytest.approx(b.end_s, rel=ROUNDING, abs=bound)
        for field in ("compute_s", "comm_s", "exposed_comm_s"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=ROUNDING, abs=bound)
        assert a.time_by_category == b.time_by_category  # added per call, in order, either way
        assert [t[:2] for t in a.transfers.rows()] == [t[:2] for t in b.transfers.rows()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_forward_agrees_with_issuing_every_op(case):
    point = make_point(**CASES[case])
    on, off = _both(SymbolicGenerator().generate(point), point.system)
    _check(on, off)
    assert off.tables.counters[kernel.SHIFTED] == 0


def test_gpt3_pp8_lays_out_most_layer_calls_by_shift():
    """GPT-3 175B, tp 4, pp 8, 12 layers a stage: of each run of 12 layer calls (forward, and backward reading its
        forward's activations), the first is issued, the second checked against it, the other ten laid out (nine, where
    the second is not yet the first shifted and the third is checked)."""
    point = make_point(GPT3, FOUR_NODES, seq_len=2048, global_batch=16, tp=4, pp=8, dp=1, sp=True)
    workload = replace(SymbolicGenerator().generate(point), steady=None)  # the whole step
    on, off = _both(workload, point.system)
    _check(on, off)
    t = on.tables
    continuing = int((t.run_last >= 0).sum())
    runs = int(((t.run_last >= 0) & (np.roll(t.run_last, 1) != t.run_last)).sum())
    assert continuing == 11 * runs and runs > 0
    copied = int(t.counters[kernel.COPIED])
    assert 0 < copied < runs  # the warm-up's and the drain's first runs are issued
    assert 9 * (runs - copied) + 12 * copied <= t.counters[kernel.SHIFTED] <= 10 * (runs - copied) + 12 * copied


def test_layer_runs_are_calls_of_one_plan_reading_the_call_before():
    """Calls 1-3 continue call 0's run (call 3 also reads call 0, as a backward reads its forward); call 4 has
    another plan, call 5 does not read call 4, call 7 reads only call 5 and call 9's plan has a p2p op."""
    plans = np.array([0, 0, 0, 0, 1, 1, 0, 0, 2, 2])
    reads = [[], [0], [1], [2, 0], [3], [3], [5], [5], [7], [8]]
    base = np.array([0, 6, 10])
    local = [[i - base[r] for i in own] for r in (0, 1) for own in reads[base[r] : base[r + 1]]]
    ptr = np.cumsum([0] + [len(own) for own in local])
    inputs = np.array([i for own in local for i in own], dtype=np.int64)
    mails, ops = np.array([0, 0, 1]), np.array([3, 2, 2])
    run_last = layer_runs(base, plans, ptr, inputs, mails, ops)
    assert run_last.tolist() == [-1, 3, 3, 3, -1, -1, -1, -1, -1, -1]


def test_repeats_keep_a_stream_in_order():
    """A repeat whose first interval rounds to before the last one's end starts at that end; the rest move by
    the shift, each rounded once."""
    shift = 0.5 - 2.0**-53  # 0.25 + shift is 0.75 less an ulp
    starts, ends = np.array([0.25, 0.5, 0, 0, 0, 0]), np.array([0.5, 0.75, 0, 0, 0, 0])
    _repeat(starts, ends, False, 0, 2, 2, shift)
    assert starts[2] == ends[1] == 0.75 and starts[4] == ends[3]  # 0.25 + 2 x shift rounds to before 1.25
    assert starts[3] == 0.5 + shift and ends[5] == 0.75 + 2 * shift
    assert (starts[1:] >= ends[:-1]).all() and (ends >= starts).all()
    knots = np.array([0.25, 0.5, 0.5, 0.75, 0, 0, 0, 0])
    _repeat(knots, knots, True, 0, 4, 1, shift)
    assert knots[4] == knots[3] == 0.75 and knots[5] == 0.5 + shift and (np.diff(knots) >= 0).all()


def test_only_plans_whose_every_op_waits_for_the_inputs_are_memo_anchored():
    """Plan 0: its first op waits for the call's inputs, its second for the first's slot, its third for a kernel
    fused into the second (a mark): anchored. Plan 1: its second op waits for nothing (a prefetch could start
    before the inputs are ready), so a stream's end before them could decide its start: not anchored."""
    p_op_ptr = np.array([0, 3, 5])
    o_waits = np.array([True, False, False, True, False])
    o_dep_ptr = np.array([0, 0, 1, 2, 2, 2])
    o_deps = np.array([0, 3])
    o_slot = np.array([0, 1, 2, 0, 1])
    o_mark_ptr = np.array([0, 0, 1, 1, 1, 1])
    o_mark_slot = np.array([3])
    p_slots = np.array([4, 2])
    anchored = anchored_plans(p_op_ptr, o_waits, o_dep_ptr, o_deps, o_slot, o_mark_ptr, o_mark_slot, p_slots)
    assert anchored.tolist() == [True, False]
