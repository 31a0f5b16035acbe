"""The per-program plan lookup (`Planner.plans`), the recipes found by a block's identity (`recipes._SEEN`) and the
op rows kept per set of plans (`op_rows._ROWS`) give what the per-block lookups and a fresh conversion
give."""

import numpy as np

from simulators.analytical import op_rows, recipes
from simulators.analytical.call_layout import call_arrays
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.plans import Planner
from tests.test_plan_cache import workloads  # noqa: F401  (the fixture)


def test_plans_are_plan_per_block(workloads):  # noqa: F811
    for _, workload, system in workloads:
        batched, single = Planner(workload, system, True), Planner(workload, system, True)
        for index, program in enumerate(workload.programs):
            used = call_arrays(program).used
            got = [batched.handed[place] for place in batched.plans(used, index)]
            assert len(got) == len(used)
            for block, plan in zip(used, got, strict=True):
                want = single.plan(block, index)
                assert plan.ops == want.ops and plan.category_seconds == want.category_seconds
                assert batched.plan(block, index) is plan
        assert batched.streams == single.streams and batched.categories == single.categories
        assert len({id(plan) for plan in batched.handed}) == len(batched.handed)  # each object has one place


def test_recipe_by_identity_is_the_cached_one(workloads):  # noqa: F811
    _, workload, _ = workloads[0]
    block = workload.blocks[0]
    first = recipes.find_recipe(block, True)
    assert recipes.find_recipe(block, True) is first
    recipes.RECIPES.clear()  # no longer cached: the identity entry is not used
    again = recipes.find_recipe(block, True)
    assert again is not first and again.runs == first.runs


def test_kept_op_rows_are_fresh_rows(workloads):  # noqa: F811
    for _, workload, system in workloads[:4]:
        op_rows._ROWS.clear()
        fresh = CompiledScheduler(workload, system).run()
        entries = len(op_rows._ROWS)
        kept = CompiledScheduler(workload, system).run()  # the same kept plans: its rows are found, none added
        assert entries == 1 and len(op_rows._ROWS) == entries
        for a, b in zip(fresh, kept, strict=True):
            assert (a.end_s, a.compute_s, a.comm_s, a.exposed_comm_s) == (
                b.end_s,
                b.compute_s,
                b.comm_s,
                b.exposed_comm_s,
            )
            assert np.array_equal(a.call_end, b.call_end) and a.time_by_category == b.time_by_category
