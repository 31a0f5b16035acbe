"""What the compiled engine's glue keeps across points gives what building it afresh gives: the programs' calls
joined and laid out by their plans' structure (`call_layout.JOINED`), the tables that price a workload on an
accelerator's value (`pricing._TABLES`) and a system's result-cache key (`cost_model._system_key`)."""

from dataclasses import replace

import numpy as np
import pytest

from dse.workload import Workload
from generators.symbolic import SymbolicGenerator
from simulators.analytical import call_layout, cost_model, pricing
from simulators.analytical import engine_kernel as kernel
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.engine import ClassSchedule
from simulators.analytical.pricing import BlockPricer
from tests.helpers import make_point
from tests.test_analytical_fastpath import CASES

LAID_OUT = ("call_plan", "run_last", "mail_ptr", "mailbox", "compute_ptr", "comm_ptr", "t_ptr")


class _Recording(CompiledScheduler):
    def schedules(self, t: kernel.EngineTables) -> list[ClassSchedule]:
        self.tables = t
        return super().schedules(t)


def _run(workload: Workload, system, fast_forward: bool = True) -> tuple[_Recording, list[ClassSchedule]]:
    scheduler = _Recording(workload, system, fast_forward=fast_forward)
    return scheduler, scheduler.run()


def _same(a: list[ClassSchedule], b: list[ClassSchedule]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.end_s, x.compute_s, x.comm_s, x.exposed_comm_s) == (y.end_s, y.compute_s, y.comm_s, y.exposed_comm_s)
        assert x.time_by_category == y.time_by_category
        assert np.array_equal(x.call_start, y.call_start) and np.array_equal(x.call_end, y.call_end)
        assert x.transfers.rows() == y.transfers.rows()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fast_forward", [True, False])
def test_kept_call_layouts_schedule_as_fresh_ones(case, fast_forward):
    point = make_point(**CASES[case])
    workload = SymbolicGenerator().generate(point)
    call_layout.JOINED.clear()
    first, fresh = _run(workload, point.system, fast_forward)
    layouts = _layouts()
    assert layouts  # the generated programs' calls are kept on their shapes
    again, kept = _run(workload, point.system, fast_forward)
    _same(fresh, kept)
    assert _layouts() == layouts  # read from the cache, not laid out again
    for name in LAID_OUT:  # the kernel reads copies
        assert np.array_equal(getattr(again.tables, name), getattr(first.tables, name))
        assert not np.shares_memory(getattr(again.tables, name), getattr(first.tables, name))


def _layouts() -> list[int]:
    return [id(laid) for entry in call_layout.JOINED.values() for laid in entry.laid_out.values()]


def test_a_layout_kept_for_one_system_serves_another():
    """Another system object gets plans of its own, numbered alike: the second point reads the first's layout and
    schedules as it would have afresh."""
    point = make_point(**CASES["tp2-pp4-1f1b-zero1"])
    other = point.system.model_copy()  # plans are kept per system object: the second point builds its own
    generator = SymbolicGenerator()
    call_layout.JOINED.clear()
    _run(generator.generate(point), point.system)
    layouts = _layouts()
    workload = generator.generate(point)
    _, kept = _run(workload, other)
    assert _layouts() == layouts
    call_layout.JOINED.clear()
    _, fresh = _run(workload, other)
    _same(fresh, kept)


def test_pricing_tables_are_kept_per_accelerator_value_and_settings():
    point = make_point(**CASES["tp2-pp4-1f1b-zero1"])
    workload = SymbolicGenerator().generate(point)
    pricing._TABLES.clear()
    a, b = BlockPricer(workload, point.system), BlockPricer(workload, point.system)
    assert a._model is b._model and a.node is b.node
    accelerator = point.system.accelerator
    # another system of an equal accelerator (a sweep over networks makes one per point) finds the same tables
    alike = point.system.model_copy(update={"accelerator": accelerator.model_copy(), "name": "another network"})
    assert BlockPricer(workload, alike)._model is a._model
    faster = accelerator.model_copy(update={"peak_tflops": {k: 2 * v for k, v in accelerator.peak_tflops.items()}})
    other = BlockPricer(workload, point.system.model_copy(update={"accelerator": faster}))
    assert other._model is not a._model and other._model.accelerator is faster
    dtype = "fp8" if workload.dtype != "fp8" else "bf16"
    other_dtype = BlockPricer(replace(workload, dtype=dtype), point.system)
    assert other_dtype._model is not a._model and other_dtype._model.dtype == dtype


def test_the_system_key_is_its_json_dumped_once_per_object():
    point = make_point(**CASES["tp2-pp4-1f1b-zero1"])
    key = cost_model._system_key(point.system)
    assert key == point.system.model_dump_json()
    assert cost_model._system_key(point.system) is key
    other = point.system.model_copy()
    assert cost_model._system_key(other) == key and cost_model._system_key(other) is not key
