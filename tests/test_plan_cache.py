"""Plans kept across points (`recipes.RECIPES`, `pricing._GROUPS`) are the plans a planner with empty
caches builds: the same ops, seconds, numbering of streams and categories, and the same plan objects shared between
blocks and classes, whatever other workloads priced on the system before."""

from dataclasses import replace

import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import pricing, recipes
from simulators.analytical.call_layout import call_arrays
from simulators.analytical.plans import Planner
from tests.helpers import make_point
from tests.test_analytical_fastpath import CASES

NAMES = sorted(CASES)
VARIANTS = {
    # Pairs that share most blocks but number their streams differently (ZeRO adds gathers on dp).
    "tp2-pp4-1f1b-zero0": dict(CASES["tp2-pp4-1f1b-zero1"], zero=0),
    "tp2-pp4-1f1b-zero1-full": dict(CASES["tp2-pp4-1f1b-zero1"], recompute="full"),
    "cp2-zero1": dict(CASES["cp2"], zero=1),
}


def _empty() -> None:
    recipes.RECIPES.clear()
    pricing._GROUPS.clear()


def _snapshot(planner: Planner, workload) -> tuple:
    """Every plan the compiled engine asks for, in its order, with which earlier request's object it is."""
    first: dict[int, int] = {}
    rows = []
    for index, program in enumerate(workload.programs):
        for block in call_arrays(program).used:
            plan = planner.plan(block, index)
            shared = first.setdefault(id(plan), len(rows))
            rows.append((block, index, plan.ops, plan.output, plan.category_seconds, sorted(plan.categories), shared))
            assert plan.block == workload.blocks[block]
    return rows, list(planner.streams.items()), list(planner.categories.items())


@pytest.fixture(scope="module")
def workloads():
    systems: dict[str, object] = {}
    out = []
    for name, case in [*((n, CASES[n]) for n in NAMES), *VARIANTS.items()]:
        point = make_point(**case)
        # Points of a study share their system's object: plans are kept by its identity.
        system = systems.setdefault(point.system.model_dump_json(), point.system)
        out.append((name, SymbolicGenerator().generate(point), system))
    return out


@pytest.mark.parametrize("fuse", [True, False])
def test_kept_plans_are_the_plans_built_afresh(workloads, fuse):
    fresh = {}
    for name, workload, system in workloads:
        _empty()
        fresh[name] = _snapshot(Planner(workload, system, fuse), workload)
    _empty()
    for order in (workloads, workloads[::-1], workloads):
        for name, workload, system in order:
            assert _snapshot(Planner(workload, system, fuse), workload) == fresh[name], name
    assert recipes.RECIPES.hits > 0


def test_blocks_of_equal_content_get_plans_of_their_own(workloads):
    """Two blocks of one workload with equal content share a recipe and a kept plan, yet each keeps its own plan
    object, as each had before plans were kept (consumers number plans by identity)."""
    _, workload, system = workloads[0]
    copies = [replace(block) for block in workload.blocks]
    doubled = replace(workload, blocks=[*workload.blocks, *copies])
    _empty()
    planner = Planner(doubled, system, fuse=True)
    count = len(workload.blocks)
    for index in range(len(workload.programs)):
        for block in range(count):
            plan, twin = planner.plan(block, index), planner.plan(count + block, index)
            assert plan is not twin
            assert (plan.ops, plan.category_seconds, plan.categories) == (
                twin.ops,
                twin.category_seconds,
                twin.categories,
            )
