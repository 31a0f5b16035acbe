"""What a kept plan is keyed by (`plans._context`, `Planner._prefixes`, `BlockPricer.spans`) is everything its
seconds and skeleton depend on, and no more: on a system that differs from an earlier one in any one field a
price reads, the plans are those a planner with empty caches builds there, bit for bit (a key that missed the field
would hand back the earlier system's plan); and on a system that differs only in a dimension a block's groups do
not span, a block without p2p ops gets the plan the earlier system built, its very seconds (what a revisit with
another InfiniBand saves)."""

from collections.abc import Callable

from dse.system import SystemSpec
from simulators.analytical import op_rows, pricing, recipes
from simulators.analytical.plans import Planner
from tests.test_plan_cache import _snapshot, workloads  # noqa: F401  (the fixture)


def _accelerator(field: str, value: Callable) -> Callable[[SystemSpec], SystemSpec]:
    def changed(system: SystemSpec) -> SystemSpec:
        accelerator = system.accelerator
        update = {field: value(getattr(accelerator, field))}
        return system.model_copy(update={"accelerator": accelerator.model_copy(update=update)})

    return changed


def _dim(index: int, field: str, value: Callable) -> Callable[[SystemSpec], SystemSpec]:
    def changed(system: SystemSpec) -> SystemSpec:
        network = list(system.network)
        dim = network[index % len(network)]
        network[index % len(network)] = dim.model_copy(update={field: value(getattr(dim, field))})
        return system.model_copy(update={"network": network})

    return changed


CHANGES = {
    "peak FLOP/s": _accelerator("peak_tflops", lambda peaks: {dtype: 1.5 * peak for dtype, peak in peaks.items()}),
    "kernel launch": _accelerator("kernel_launch_us", lambda us: us + 3.0),
    "inner bandwidth": _dim(0, "bandwidth_GBps", lambda gbps: gbps / 2),
    "inner latency": _dim(0, "latency_ns", lambda ns: 2 * ns + 100),
    "inner efficiency": _dim(0, "efficiency", lambda share: share / 2),
    "outer bandwidth": _dim(-1, "bandwidth_GBps", lambda gbps: gbps / 2),
    "outer latency": _dim(-1, "latency_ns", lambda ns: 2 * ns + 100),
    "outer efficiency": _dim(-1, "efficiency", lambda share: share / 2),
}


def _empty() -> None:
    recipes.RECIPES.clear()
    recipes._SEEN.clear()
    pricing._GROUPS.clear()
    pricing._FACETS.clear()
    op_rows._ROWS.clear()


def test_a_field_a_price_reads_is_in_the_key(workloads):  # noqa: F811
    moved = dict.fromkeys(CHANGES, 0)
    for name, workload, system in workloads:
        _empty()
        before = _snapshot(Planner(workload, system, True), workload)
        for change, changed in CHANGES.items():
            other = changed(system)
            _empty()
            fresh = _snapshot(Planner(workload, other, True), workload)
            _empty()
            _snapshot(Planner(workload, system, True), workload)
            assert _snapshot(Planner(workload, other, True), workload) == fresh, (name, change)
            moved[change] += fresh != before
    assert all(moved.values()), moved  # every change moved some workload's plans: none of the checks is idle


def test_a_block_keeps_its_plan_on_a_system_that_differs_where_its_groups_do_not_reach(workloads):  # noqa: F811
    kept = rebuilt = 0
    for name, workload, system in workloads:
        outer = len(system.network) - 1
        other = CHANGES["outer bandwidth"](system)
        _empty()
        first, second = Planner(workload, system, True), Planner(workload, other, True)
        pricer = pricing.BlockPricer(workload, system)
        for index in range(len(workload.programs)):
            for block in range(len(workload.blocks)):
                recipe = recipes.find_recipe(workload.blocks[block], True)
                spans = pricer.spans(recipe.axes, index)[0]
                inside = not recipe.p2p and all(d != outer for key in spans for d, _ in key)
                plan, again = first.plan(block, index), second.plan(block, index)
                assert (plan.seconds is again.seconds) == inside, (name, block, index)  # kept, or priced anew
                kept += inside
                rebuilt += not inside
    assert kept and rebuilt
