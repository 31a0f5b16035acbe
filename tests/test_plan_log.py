"""A planner that asks as an earlier planner of a workload of the same structure (its blocks' p2p ops and
collectives' axes, layout and classes) on a network of the same shape did follows its log (`plans._Log`): it hands
the same places, and the plans a planner without a log hands for its blocks on its own system, bit for bit; one that
asks otherwise leaves the log and still hands what a planner without one would."""

from dataclasses import replace

from simulators.analytical import plans
from simulators.analytical.call_layout import call_arrays
from simulators.analytical.plans import Planner
from tests.test_plan_cache import workloads  # noqa: F401  (the fixture)
from tests.test_plans_across_systems import _empty, _faster


def _asked(planner: Planner, workload, order: list[int]) -> tuple:
    """Per program in `order`, the places `plans` gives and their plans' contents, with which earlier place each
    plan object first had; and the streams and categories numbered."""
    first: dict[int, int] = {}
    rows = []
    for index in order:
        places = planner.plans(call_arrays(workload.programs[index]).used, index)
        for place in places:
            plan = planner.handed[place]
            rows.append((place, plan.ops, plan.category_seconds, first.setdefault(id(plan), place)))
    return rows, list(planner.streams.items()), list(planner.categories.items())


def _fresh(workload, system, order: list[int]) -> tuple:
    """What a planner without a log (and nothing kept) gives."""
    _empty()
    plans._LOGS.clear()
    return _asked(Planner(workload, system, True), workload, order)


def test_a_revisit_follows_the_log_and_hands_what_a_lookup_does(workloads):  # noqa: F811
    for name, workload, system in workloads:
        order = list(range(len(workload.programs)))
        second, third = _faster(system, 1.3), _faster(system, 1.7)
        want = _fresh(workload, third, order)
        _empty()
        plans._LOGS.clear()
        _asked(Planner(workload, system, True), workload, order)
        _asked(Planner(workload, second, True), workload, order)
        revisit = Planner(replace(workload, point_key="another"), third, True)  # as the generator hands it back
        assert _asked(revisit, workload, order) == want, name
        assert revisit._log is not None and revisit._asked == len(order), name
        assert len(plans._LOGS) == 1, name


def test_a_planner_asking_otherwise_leaves_the_log_and_hands_what_a_lookup_does(workloads):  # noqa: F811
    for name, workload, system in workloads:
        order = list(range(len(workload.programs)))
        other = order[1:] + order[:1] if len(order) > 1 else order
        want = _fresh(workload, system, other)
        _empty()
        plans._LOGS.clear()
        _asked(Planner(workload, _faster(system, 1.3), True), workload, order)
        planner = Planner(workload, system, True)
        assert _asked(planner, workload, other) == want, name
        if other != order:
            assert planner._log is None, name
        for index in order:  # and a plan asked for after it left: the one its places name
            for block, place in zip(
                used := call_arrays(workload.programs[index]).used, planner.plans(used, index), strict=True
            ):
                assert planner.plan(block, index) is planner.handed[place], name


def _resized(workload, by: float):
    """The workload with every op's work and bytes scaled: its blocks of other content, of the same structure (as
    another micro-batch size gives)."""
    blocks = [
        replace(
            block,
            ops=tuple(
                replace(op, flops=by * op.flops, bytes=by * op.bytes, comm_bytes=by * op.comm_bytes, gemm=None)
                for op in block.ops
            ),
        )
        for block in workload.blocks
    ]
    return replace(workload, blocks=blocks, point_key="resized")


def test_a_workload_of_the_same_structure_follows_the_log_and_hands_what_a_lookup_does(workloads):  # noqa: F811
    for name, workload, system in workloads:
        order = list(range(len(workload.programs)))
        resized = _resized(workload, 2.0)
        want = _fresh(resized, system, order)
        assert want[0] != _fresh(workload, system, order)[0], name  # other content: other seconds
        _empty()
        plans._LOGS.clear()
        first = Planner(workload, system, True)
        _asked(first, workload, order)
        follower = Planner(resized, system, True)
        assert follower._log is first._log, name
        assert _asked(follower, resized, order) == want, name
        assert follower._log is first._log and follower._asked == len(order), name
        assert len(plans._LOGS) == 1, name


def test_a_workload_of_another_structure_has_a_log_of_its_own(workloads):  # noqa: F811
    name, workload, system = workloads[0]
    plans._LOGS.clear()
    Planner(workload, system, True)
    Planner(replace(workload, blocks=list(workload.blocks), point_key="another"), system, True)
    assert len(plans._LOGS) == 1
    Planner(replace(workload, blocks=[*workload.blocks, workload.blocks[0]]), system, True)
    assert len(plans._LOGS) == 2, name
    Planner(workload, _faster(system, 1.3), False)  # unfused: its places may differ
    assert len(plans._LOGS) == 3, name
