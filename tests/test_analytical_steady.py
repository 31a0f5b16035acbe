"""A pipeline's steady state priced once: the step from its SteadyForm against the step's own programs.

The steady form runs p + 4 micro-batches (at most 2p + 2; 6p interleaved) and the cost model adds the period it
finds on that timeline as often as the step has more; the figures must be the whole step's, not approximately but
to rounding, and a timeline that does not repeat must be priced whole.
"""

from dataclasses import replace

import pytest

from dse.spec import DesignPoint
from dse.workload import Tensor, TensorKind
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.steady import schedule_steady
from tests.helpers import make_point

DGX = {"base": "dgx-h100", "network": {1: {"npus": 4}}}
CASES = {
    "1f1b-zero1": dict(tp=2, pp=4, dp=2, zero=1, sp=True, global_batch=128),
    "zb-h1-zero2": dict(tp=2, pp=4, dp=2, zero=2, sp=True, pp_schedule="zb_h1", global_batch=128),
    "1f1b-zero2-selective": dict(tp=2, pp=2, dp=2, zero=2, recompute="selective", global_batch=64),
    "1f1b-zero3-full": dict(tp=2, pp=2, dp=2, zero=3, recompute="full", global_batch=128),
    "pp1-accumulation": dict(tp=2, dp=4, global_batch=64),
    "interleaved-zero3": dict(tp=2, pp=4, dp=2, pp_schedule="interleaved", virtual_stages=2, zero=3, global_batch=128),
    # groups of 5 micro-batches per chunk (Megatron's microbatch_group_size_per_vp_stage), the last of 4
    "interleaved-groups": dict(
        tp=2, pp=4, dp=2, pp_schedule="interleaved", virtual_stages=2, microbatch_group=5, zero=1, global_batch=128
    ),
    "ring-cp": dict(tp=2, cp=2, pp=4, cp_algorithm="ring", global_batch=128),
    "moe-ep4": dict(model="tiny-moe", ep=4, dp=4, pp=2, zero=1, global_batch=128),
    "mla": dict(model="tiny-deepseek", tp=2, pp=2, dp=4, global_batch=128),
    "hybrid": dict(model="tiny-hybrid", tp=2, pp=2, dp=4, recompute="full", global_batch=128),
}


def _whole(workload, point: DesignPoint):
    """The step priced from its own programs: no steady form, another key so the results cache does not answer."""
    return AnalyticalCostModel().simulate(replace(workload, steady=None, point_key="whole"), point.system)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_steady_form_prices_the_step_as_its_own_programs_do(case):
    point = make_point(system=DGX, **CASES[case])
    workload = SymbolicGenerator().generate(point)
    assert workload.steady is not None and workload.steady.repeats > 0
    assert schedule_steady(workload, point.system) is not None, "the steady form's timeline did not repeat"
    steady = AnalyticalCostModel().simulate(workload, point.system)
    whole = _whole(workload, point)
    rel = 1e-9
    assert steady.step_time_s == pytest.approx(whole.step_time_s, rel=rel)
    for s, w in zip(steady.classes, whole.classes, strict=True):
        for field in ("end_s", "compute_s", "comm_s", "exposed_comm_s"):
            assert getattr(s, field) == pytest.approx(getattr(w, field), rel=rel, abs=1e-15), field
        assert s.peak_memory_bytes == pytest.approx(w.peak_memory_bytes, rel=1e-12)
        assert s.memory_at_peak == pytest.approx(w.memory_at_peak, rel=1e-12)
        assert s.time_by_category == pytest.approx(w.time_by_category, rel=rel)


def test_a_links_state_repeats_each_micro_batch_whichever_side_of_a_transfer_is_reached_first():
    """Two stages on two nodes share InfiniBand between their pipeline transfers and their data-parallel traffic.
    Which side of each transfer the engine reached first alternated from one micro-batch to the next, and a side
    reached first parked while its run's later ops took the link before the transfer and stretched it: the whole
    step grew by two different amounts in turn. A transfer now reserves the link on its side as it is issued
    (`engine._reserve`), so the step grows by the same amount every micro-batch and the steady form prices it
    exactly."""
    kwargs = dict(seq_len=8192, tp=1, pp=2, dp=32, zero=1, recompute="none")
    system = {"base": "dgx-h100", "network": {1: {"npus": 8}}}

    def whole(micro_batches: int) -> float:
        point = make_point("llama3-8b", system, global_batch=32 * micro_batches, **kwargs)
        return _whole(SymbolicGenerator().generate(point), point).step_time_s

    t6, t7, t8 = (whole(m) for m in (6, 7, 8))
    assert t8 - t7 == pytest.approx(t7 - t6, rel=1e-9)
    point = make_point("llama3-8b", system, global_batch=32 * 17, **kwargs)
    workload = SymbolicGenerator().generate(point)
    assert schedule_steady(workload, point.system) is not None
    steady = AnalyticalCostModel().simulate(workload, point.system).step_time_s
    assert steady == pytest.approx(_whole(workload, point).step_time_s, rel=1e-9)


def test_the_steady_form_holds_a_few_periods_and_stands_for_the_rest():
    point = make_point(tp=2, pp=4, dp=2, global_batch=128, system=DGX)  # 64 micro-batches
    form = SymbolicGenerator().generate(point).steady
    assert (form.microbatches, form.period, form.repeats) == (8, 1, 56)  # p + 4
    interleaved = make_point(tp=2, pp=4, dp=2, pp_schedule="interleaved", virtual_stages=2, global_batch=132)
    form = SymbolicGenerator().generate(interleaved).steady
    assert (form.microbatches, form.period, form.repeats) == (26, 4, 10)  # 6p and the step's last 2 of a 4-group
    for kind in (dict(pp_schedule="gpipe"), dict(global_batch=16)):  # GPipe; 8 micro-batches, no more than its p + 4
        assert (
            SymbolicGenerator().generate(make_point(**{"tp": 2, "pp": 4, "dp": 2, "global_batch": 128, **kind})).steady
            is None
        )


def test_a_timeline_that_does_not_repeat_is_priced_whole():
    """Llama-2-7B on a network slowed to 12.5 GB/s between nodes and an accelerator sped up to 4 PFLOP/s: a
    communication-bound pipeline whose stages' times per period still differ within the steady form's 11
    micro-batches, so the form is refused and the step is simulated whole. (Llama-3-70B with ZeRO-3 over
    interleaved stages was the example until transfers reserved their links as they are issued, `engine._reserve`:
    its timeline repeats now, and its form prices the step to 1e-12.)"""
    system = {
        "base": "dgx-a100",
        "network": {0: {"bandwidth_GBps": 200}, 1: {"npus": 2, "bandwidth_GBps": 12.5}},
        "accelerator": {"peak_tflops": {"bf16": 4000}},
    }
    point = make_point("llama2-7b", system, seq_len=4096, global_batch=2 * 17, tp=2, pp=4, dp=2, recompute="none")
    workload = SymbolicGenerator().generate(point)
    assert workload.steady is not None and schedule_steady(workload, point.system) is None
    assert AnalyticalCostModel().simulate(workload, point.system) == _whole(workload, point)


def test_an_edited_workload_is_priced_from_its_own_programs():
    point = make_point(tp=2, pp=4, dp=2, global_batch=128, system=DGX)
    workload = SymbolicGenerator().generate(point)
    before = AnalyticalCostModel().simulate(workload, point.system)
    workload.programs[0].tensors.append(Tensor("extra", TensorKind.TEMPORARY, 2**30))
    assert schedule_steady(workload, point.system) is None
    after = AnalyticalCostModel().simulate(workload, point.system)
    grown = 2**30 * (1 + point.system.accelerator.fragmentation)  # the allocator's share grows with the peak
    assert after.classes[0].peak_memory_bytes == pytest.approx(before.classes[0].peak_memory_bytes + grown, rel=1e-9)
    assert after.step_time_s == pytest.approx(before.step_time_s, rel=1e-9)
