"""A plan's skeleton (what of it does not depend on the system's speeds: `skeletons.Skeleton`) is kept from the
first system its block's content is planned on: on every later system that differs only in its speeds, the plans
and the engine's tables reuse the skeletons and op rows, and their seconds are those built afresh on that system,
bit for bit."""

import numpy as np

from dse.system import SystemSpec
from simulators.analytical import op_rows, pricing, recipes
from simulators.analytical.call_layout import call_arrays, joined_calls
from simulators.analytical.compiled_engine import CompiledScheduler, _Layout
from simulators.analytical.plans import Planner
from tests.test_plan_cache import _snapshot, workloads  # noqa: F401  (the fixture)


def _faster(system: SystemSpec, by: float) -> SystemSpec:
    """The system with other speeds but the same shape: its chip's FLOP/s scaled up and its links down."""
    accelerator = system.accelerator
    peaks = {dtype: by * peak for dtype, peak in accelerator.peak_tflops.items()}
    return system.model_copy(
        update={
            "accelerator": accelerator.model_copy(update={"peak_tflops": peaks}),
            "network": [dim.model_copy(update={"bandwidth_GBps": dim.bandwidth_GBps / by}) for dim in system.network],
        }
    )


def _empty() -> None:
    recipes.RECIPES.clear()
    recipes._SEEN.clear()
    pricing._GROUPS.clear()
    op_rows._ROWS.clear()


def _tables(workload, system) -> dict[str, np.ndarray]:
    scheduler = CompiledScheduler(workload, system)
    calls = [call_arrays(program) for program in workload.programs]
    scheduler._plan_places = [scheduler._planner.plans(own.used, index) for index, own in enumerate(calls)]
    tables = _Layout(scheduler, joined_calls(calls, True), None).tables()
    return {name: getattr(tables, name) for name in tables._fields if name[:2] in ("o_", "p_")}


def test_plans_on_later_systems_reuse_skeletons_and_equal_fresh_ones(workloads):  # noqa: F811
    for name, workload, system in workloads:
        second, third = _faster(system, 1.3), _faster(system, 1.7)
        _empty()
        fresh = _snapshot(Planner(workload, third, True), workload)
        _empty()
        before = recipes.SKELETONS.built
        _snapshot(Planner(workload, system, True), workload)
        built = recipes.SKELETONS.built
        assert built > before, name
        reused = recipes.SKELETONS.reused
        _snapshot(Planner(workload, second, True), workload)
        assert _snapshot(Planner(workload, third, True), workload) == fresh, name
        assert recipes.SKELETONS.built == built, name  # every skeleton was kept from the first system
        assert recipes.SKELETONS.reused > reused, name


def test_tables_on_later_systems_reuse_rows_and_equal_fresh_ones(workloads):  # noqa: F811
    for name, workload, system in workloads:
        second, third = _faster(system, 1.3), _faster(system, 1.7)
        _empty()
        fresh = _tables(workload, third)
        _empty()
        _tables(workload, system)
        entries, hits = len(op_rows._ROWS), op_rows._ROWS.hits
        kept = _tables(workload, second)
        again = _tables(workload, third)
        assert len(op_rows._ROWS) == entries and op_rows._ROWS.hits == hits + 2, name
        assert set(again) == set(fresh)
        for field, want in fresh.items():
            assert want.dtype == again[field].dtype and want.tobytes() == again[field].tobytes(), (name, field)
        assert kept["o_seconds"].tobytes() != again["o_seconds"].tobytes(), name  # the speeds did change them
