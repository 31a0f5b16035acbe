"""The batch path (`simulate_many`) on a step whose steady state repeats every pp micro-batches on some systems and
every one on others: each system priced from the form the per-point path uses (`steady.schedule_steady`), the
shorter one, the longer one or the whole step, to its figures.

Tiny-Llama at tp 8 without sp on four nodes of a DGX H100 (`test_steady_period_pp`): with InfiniBand at 20 GB/s
and more every micro-batch is alike; at 5 to 12 GB/s the sends queue on the slow link and the timeline repeats only
every four (the longer form's period); at 3 GB/s not even that within the longer form, which leaves the whole step.
"""

from dataclasses import replace

import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel, batch
from simulators.analytical.batch import price_many
from simulators.analytical.steady import schedule_steady
from tests.helpers import make_point
from tests.test_analytical_batch import _same

BANDWIDTHS_GBPS = {3: None, 5: 18, 8: 18, 12: 18, 20: 8, 50: 8, 100: 8}
"""InfiniBand GB/s, and the micro-batches of the form the step is priced from there (8: the shorter form, 18: the
longer, None: the whole step's 42)."""


def _point(bandwidth_GBps: float):
    system = {"base": "dgx-h100", "network": {1: {"npus": 4, "bandwidth_GBps": bandwidth_GBps}}}
    return make_point("tiny-llama", system, seq_len=1024, global_batch=42, tp=8, pp=4, dp=1, sp=False)


def test_the_systems_are_periodic_at_period_1_at_pp_only_or_not_at_all():
    """The per-point path's own reading of each system, which the batch must reproduce."""
    for bandwidth, form in BANDWIDTHS_GBPS.items():
        point = _point(bandwidth)
        workload = SymbolicGenerator().generate(point)
        shorter_only = replace(workload, steady=replace(workload.steady, build_longer=None))
        assert (schedule_steady(shorter_only, point.system) is not None) == (form == 8), bandwidth
        assert (schedule_steady(workload, point.system) is not None) == (form is not None), bandwidth


def test_the_batch_prices_each_system_from_the_per_point_paths_form_to_its_figures(monkeypatch):
    workload = SymbolicGenerator().generate(_point(5))
    systems = [_point(bandwidth).system for bandwidth in BANDWIDTHS_GBPS]
    evaluations: list[tuple[int | None, list[float]]] = []
    evaluate = batch._evaluate

    def spy(evaluated, priced, timings, room, form=None, periods=()):
        evaluations.append((form and form.microbatches, sorted(s.network[1].bandwidth_GBps for s in priced)))
        return evaluate(evaluated, priced, timings, room, form, periods)

    monkeypatch.setattr(batch, "_evaluate", spy)
    priced = price_many(workload, systems)
    longer = sorted(b for b, form in BANDWIDTHS_GBPS.items() if form != 8)
    assert evaluations == [(8, sorted(BANDWIDTHS_GBPS)), (18, longer), (None, [3])]
    exact = AnalyticalCostModel(exact=True)
    for system, figures in zip(systems, priced, strict=True):
        _same(figures, exact.simulate(workload, system), rel=1e-9)
        whole = exact.simulate(replace(workload, steady=None, point_key="whole"), system)
        assert figures.step_time_s == pytest.approx(whole.step_time_s, rel=1e-9)
