"""Batch pricing (`batch.price_many`, behind `simulate_many`) against the per-point path, system by system.

The batch evaluates the reference schedule (`exact=True`) for every system at once, over the steady form where the
workload has one, so it must give the reference's figures to rounding (1e-9 relative is far looser than what it
reaches, ~1e-13), and the default path's within its 1% (`test_analytical_fastpath`). The
systems are drawn at random over everything a hardware sweep varies: FLOP/s, HBM bandwidth and size, link
bandwidths, latencies and algorithms, the runtime reserve and the compute slowdown under communication.
"""

import random

import pytest

from dse.errors import InfeasibleError
from dse.interfaces import BatchCostModel
from dse.system import SystemSpec
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.batch import price_many
from tests.helpers import make_point

DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}
CASES = {
    "tp2-pp4-1f1b-microbatches": dict(tp=2, pp=4, dp=2, sp=True, zero=1, global_batch=64, system=DGX),
    "dp8-zero3": dict(dp=8, zero=3, global_batch=16, system=DGX),
    "interleaved": dict(tp=2, pp=4, dp=2, pp_schedule="interleaved", virtual_stages=2, global_batch=32, system=DGX),
    "interleaved-steady": dict(
        tp=2, pp=2, dp=2, pp_schedule="interleaved", virtual_stages=2, global_batch=96, system=DGX
    ),
    "gpipe-full-recompute-ring": dict(pp=4, dp=2, pp_schedule="gpipe", recompute="full", global_batch=16),
    "zb-h1-ring-cp": dict(
        tp=2, cp=2, pp=2, zero=2, cp_algorithm="ring", pp_schedule="zb_h1", global_batch=16, system=DGX
    ),
}
SYSTEMS = 20


def _systems(case: dict, count: int, seed: int) -> list[SystemSpec]:
    rng = random.Random(seed)
    drawn = []
    for _ in range(count):
        overrides = {
            "system.accelerator.peak_tflops.bf16": rng.uniform(100, 3000),
            "system.accelerator.hbm_bandwidth_GBps": rng.uniform(800, 8000),
            "system.accelerator.hbm_GiB": rng.choice([16, 40, 80, 141]),
            "system.accelerator.runtime_reserve_GiB": rng.uniform(0, 4),
            "system.accelerator.overlap_slowdown": rng.choice([0.0, 0.1, 0.3]),
            "system.network.0.bandwidth_GBps": rng.uniform(20, 1800),
            "system.network.0.latency_ns": rng.uniform(100, 10000),
            "system.network.0.algorithm": rng.choice(["auto", "ring", "tree"]),
            "system.network.1.bandwidth_GBps": rng.uniform(2, 400),
            "system.network.1.latency_ns": rng.uniform(500, 30000),
        }
        drawn.append(make_point(**case, overrides=overrides).system)
    return drawn


def _same(batch, point, rel: float) -> None:
    tolerance = dict(rel=rel, abs=1e-12)
    assert batch.step_time_s == pytest.approx(point.step_time_s, **tolerance)
    assert batch.compute_time_s == pytest.approx(point.compute_time_s, **tolerance)
    assert batch.comm_time_s == pytest.approx(point.comm_time_s, **tolerance)
    assert batch.exposed_comm_time_s == pytest.approx(point.exposed_comm_time_s, **tolerance)
    assert batch.peak_memory_bytes == pytest.approx(point.peak_memory_bytes, rel=1e-12)
    for b, p in zip(batch.classes, point.classes, strict=True):
        assert (b.name, b.ranks) == (p.name, p.ranks)
        assert b.end_s == pytest.approx(p.end_s, **tolerance)
        assert b.time_by_category == pytest.approx(p.time_by_category, rel=1e-9, abs=1e-12)
        assert b.memory_at_peak == pytest.approx(p.memory_at_peak, rel=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_equals_the_reference_and_the_fast_path_on_random_systems(case):
    point = make_point(**CASES[case])
    workload = SymbolicGenerator().generate(point)
    systems = _systems(CASES[case], SYSTEMS, seed=len(case))
    batch = price_many(workload, systems)
    exact, fast = AnalyticalCostModel(exact=True), AnalyticalCostModel()
    steps = set()
    for system, priced in zip(systems, batch, strict=True):
        _same(priced, exact.simulate(workload, system), rel=1e-9)
        _same(priced, fast.simulate(workload, system), rel=1e-2)
        steps.add(round(priced.step_time_s, 12))
    assert len(steps) == SYSTEMS  # every system priced on its own durations


def test_systems_that_differ_in_memory_only_share_times_and_differ_in_what_fits():
    case = CASES["tp2-pp4-1f1b-microbatches"]
    workload = SymbolicGenerator().generate(make_point(**case))
    systems = [make_point(**case, overrides={"system.accelerator.hbm_GiB": hbm}).system for hbm in (0.5, 80, 141)]
    small, h100, h200 = price_many(workload, systems)
    assert small.step_time_s == h100.step_time_s == h200.step_time_s
    assert small.peak_memory_bytes == h100.peak_memory_bytes
    assert small.peak_memory_bytes > 0.5 * 2**30  # so only the larger ones fit
    assert h100.peak_memory_bytes < 80 * 2**30


def test_one_call_mixes_network_shapes_and_reports_systems_too_small_in_place():
    case = dict(tp=2, pp=2, dp=2, global_batch=16)
    workload = SymbolicGenerator().generate(make_point(**case))
    ring = make_point(**case).system
    flat = make_point(**case, system={"base": "dgx-h100", "network": {1: {"npus": 1}}}).system
    small = make_point(**case, overrides={"system.network.1.npus": 1}).system
    priced = price_many(workload, [ring, small, flat])
    exact = AnalyticalCostModel(exact=True)
    _same(priced[0], exact.simulate(workload, ring), rel=1e-9)
    _same(priced[2], exact.simulate(workload, flat), rel=1e-9)
    assert isinstance(priced[1], InfeasibleError)
    assert "has 4 NPUs" in str(priced[1])


def test_simulate_many_batches_from_batch_from_systems_and_prices_fewer_one_by_one(monkeypatch):
    """A dozen systems cost less one by one than recording a tape (`cost_model.BATCH_FROM`); either way the figures
    are the reference schedule over the steady form's."""
    from simulators.analytical import cost_model

    case = CASES["tp2-pp4-1f1b-microbatches"]
    workload = SymbolicGenerator().generate(make_point(**case))
    systems = _systems(case, 4, seed=5)
    batched = []
    monkeypatch.setattr(cost_model, "price_many", lambda *args: batched.append(1) or price_many(*args))
    one_by_one = AnalyticalCostModel().simulate_many(workload, systems)
    assert not batched
    assert one_by_one == [AnalyticalCostModel().simulate(workload, system) for system in systems]
    monkeypatch.setattr(cost_model, "BATCH_FROM", 4)
    for batch, single in zip(AnalyticalCostModel(exact=True).simulate_many(workload, systems), one_by_one, strict=True):
        _same(batch, single, rel=1e-9)
    assert batched


def test_the_analytical_model_offers_batch_pricing_and_a_timeline_model_prices_one_by_one():
    assert isinstance(AnalyticalCostModel(), BatchCostModel)
    case = CASES["dp8-zero3"]
    workload = SymbolicGenerator().generate(make_point(**case))
    systems = _systems(case, 2, seed=1)
    with_timeline = AnalyticalCostModel().with_timeline().simulate_many(workload, systems)
    assert all(result.timeline for result in with_timeline)
    for timed, batch in zip(with_timeline, price_many(workload, systems), strict=True):
        _same(batch, timed, rel=1e-9)


def test_systems_whose_timeline_is_not_periodic_are_priced_on_the_whole_step(monkeypatch):
    """A steady form is used only where each system's timeline shows its period (`batch_steady`); a system whose
    checks fail is evaluated on the whole step. With no tolerance every check fails, and the figures still agree."""
    from simulators.analytical import batch_steady

    case = CASES["tp2-pp4-1f1b-microbatches"]
    workload = SymbolicGenerator().generate(make_point(**case))
    assert workload.steady is not None
    systems = _systems(case, 3, seed=2)
    monkeypatch.setattr(batch_steady, "TOLERANCE_S", -1.0)
    exact = AnalyticalCostModel(exact=True)
    for system, priced in zip(systems, price_many(workload, systems), strict=True):
        _same(priced, exact.simulate(workload, system), rel=1e-9)


def test_a_workload_priced_again_reuses_its_recorded_structure_unless_it_changed():
    """The tape and what is built on it are kept per workload and network shape (`batch_structure`): a sweep's
    later batches of one workload skip the recording, and give the same figures."""
    from dataclasses import replace

    from simulators.analytical.batch_structure import structure

    case = CASES["tp2-pp4-1f1b-microbatches"]
    workload = SymbolicGenerator().generate(make_point(**case))
    systems = _systems(case, 3, seed=3)
    shorter = replace(workload, programs=workload.steady.programs, steady=None)
    kept = structure(shorter, systems[0])
    assert structure(shorter, systems[1]) is kept
    assert structure(replace(workload, steady=None), systems[0]) is not kept  # the whole step: a tape of its own
    assert structure(shorter, systems[0]) is kept
    assert structure(replace(shorter, tokens=shorter.tokens + 1), systems[0]) is not kept  # not the same workload
    wider = make_point(**{**case, "system": {"base": "dgx-h100", "network": {1: {"npus": 4}}}}).system
    assert structure(shorter, wider) is not structure(shorter, systems[0])  # another network shape
    first, again = (price_many(workload, systems) for _ in range(2))
    for a, b in zip(first, again, strict=True):
        assert a == b
