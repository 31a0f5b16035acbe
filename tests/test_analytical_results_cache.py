"""The cost model's results cache: a point priced again in one process is read back, never for other settings,
another system or a workload that differs under the same key."""

import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel, cost_model
from simulators.result_cache import ResultCache
from tests.helpers import make_point

DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}


@pytest.fixture
def priced(monkeypatch):
    """Counts the schedules actually computed (fast, from the steady form or whole, and reference), from an empty
    cache."""
    counts = {"fast": 0, "exact": 0}
    fast, steady, exact = cost_model.schedule_compiled, cost_model.schedule_steady, cost_model.schedule

    def counting_fast(*args, **kwargs):
        counts["fast"] += 1
        return fast(*args, **kwargs)

    def counting_steady(*args, **kwargs):
        schedules = steady(*args, **kwargs)
        counts["fast"] += schedules is not None
        return schedules

    def counting_exact(*args, **kwargs):
        counts["exact"] += 1
        return exact(*args, **kwargs)

    monkeypatch.setattr(cost_model, "schedule_compiled", counting_fast)
    monkeypatch.setattr(cost_model, "schedule_steady", counting_steady)
    monkeypatch.setattr(cost_model, "schedule", counting_exact)
    monkeypatch.setattr(cost_model, "_RESULTS", ResultCache())
    return counts


def test_a_point_priced_again_is_read_back_and_equal(priced):
    point = make_point(tp=2, pp=2, dp=2, global_batch=16, system=DGX)
    model = AnalyticalCostModel()
    first = model.simulate(SymbolicGenerator().generate(point), point.system)
    again = model.simulate(SymbolicGenerator().generate(point), point.system)
    assert priced == {"fast": 1, "exact": 0}
    assert again == first
    again.classes[0].time_by_category.clear()  # the caller's copy: the cached result stays whole
    assert model.simulate(SymbolicGenerator().generate(point), point.system) == first


def test_other_settings_or_another_system_are_priced_afresh(priced):
    point = make_point(tp=2, pp=2, dp=2, global_batch=16, system=DGX)
    workload = SymbolicGenerator().generate(point)
    AnalyticalCostModel().simulate(workload, point.system)
    AnalyticalCostModel(exact=True).simulate(workload, point.system)
    slower = point.system.model_copy(
        update={"accelerator": point.system.accelerator.model_copy(update={"fragmentation": 0.5})}
    )
    AnalyticalCostModel().simulate(workload, slower)
    assert priced == {"fast": 2, "exact": 1}


def test_a_workload_that_differs_under_the_same_key_is_priced_afresh(priced):
    point = make_point(tp=2, pp=2, dp=2, global_batch=16, system=DGX)
    workload = SymbolicGenerator().generate(point)
    model = AnalyticalCostModel()
    before = model.simulate(workload, point.system)
    program = workload.programs[0]
    program.tensors[-1] = program.tensors[-1]._replace(bytes=program.tensors[-1].bytes + 2**30)  # edited in place
    after = model.simulate(workload, point.system)
    assert priced["fast"] == 2
    assert after.classes[0].peak_memory_bytes > before.classes[0].peak_memory_bytes


def test_calls_edited_in_place_after_pricing_are_priced_afresh(priced):
    """A snapshot holds an unedited ShapeCalls itself rather than a copy: an edit made to those calls after pricing
    (which the list notes) must not find the result priced before it."""
    point = make_point(tp=2, pp=2, dp=2, global_batch=16, system=DGX)
    workload = SymbolicGenerator().generate(point)
    program = workload.programs[0]  # the programs built before pricing: the snapshot holds their calls
    model = AnalyticalCostModel()
    before = model.simulate(workload, point.system)
    assert model.simulate(workload, point.system) == before and priced["fast"] == 1  # read back
    program.calls[-1] = program.calls[-1]  # the same call again, but written in place: the list notes an edit
    again = model.simulate(workload, point.system)
    assert priced["fast"] == 2
    assert again == before  # the same calls, priced again
