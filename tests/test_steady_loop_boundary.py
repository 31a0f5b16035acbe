"""A pipeline whose period is set by the loop round its stages, on both sides of where its shorter steady form
starts to pass: each side prices the step as the whole step uncut does.

GPT-3 175B (unfused attention) at tp 8, pp 8, without sp, on 1,024 H100s: every stage's send is a full activation
over InfiniBand, and below about 77.5 GB/s the micro-batch's time is the loop's (its compute and two sends round
the stages), not a stage's own pair. An offset from the first backward then travels the loop and comes back every
pp micro-batches, so the shorter form (p + 4) cannot show the period and the longer one (4p) is priced, at a
period of pp; faster InfiniBand makes each stage's own work the period, and the shorter form passes
(benchmarks/vs_calculon.py's configuration 62; helper D's finding, stop 52). A steady route that passed the
checks on a timeline that really repeats only every pp micro-batches would be off by about 1e-4 of the step: the
whole step, simulated uncut, is the reference on every class's figures.
"""

from dataclasses import replace

import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel, steady
from tests.helpers import make_point

GPT3 = {"base": "gpt3-175b", "flash_attention": False, "dropout": True}


def _priced(ib_GBps: float) -> tuple[str, list[float], list[float]]:
    """Which form the steady route took, and its figures and the whole step's (step time, then per class its
    compute, communication and exposed communication seconds), each priced afresh (`_simulate`: the result cache
    takes a workload and its whole step for one point)."""
    system = {"base": "dgx-h100", "network": {0: {"bandwidth_GBps": 450}, 1: {"npus": 128, "bandwidth_GBps": ib_GBps}}}
    point = make_point(
        GPT3, system, seq_len=2048, global_batch=1536, micro_batch=2, tp=8, pp=8, dp=16, sp=False, pp_schedule="1f1b"
    )
    workload = SymbolicGenerator().generate(point)
    found = steady.schedule_steady(workload, point.system)
    assert found is not None and workload.steady is not None
    form = "shorter" if found.programs is workload.steady.programs else "longer"
    model = AnalyticalCostModel()
    figures = []
    for priced in (workload, replace(workload, steady=None)):
        result = model._simulate(priced, point.system)
        figures.append(
            [result.step_time_s, *(x for c in result.classes for x in (c.compute_s, c.comm_s, c.exposed_comm_s))]
        )
    return form, figures[0], figures[1]


@pytest.mark.parametrize(("ib_GBps", "form"), [(60.0, "longer"), (90.0, "shorter")])
def test_each_side_of_the_loop_bound_prices_the_whole_step(ib_GBps: float, form: str) -> None:
    taken, steady_figures, whole = _priced(ib_GBps)
    assert taken == form
    for got, want in zip(steady_figures, whole, strict=True):
        assert got == pytest.approx(want, rel=1e-11, abs=1e-15)
