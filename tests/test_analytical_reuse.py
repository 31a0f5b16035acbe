"""What the cost model keeps on a program's CallShape (the generator's reused schedule skeleton) equals what it
derives afresh, and is not used once the program's calls no longer match the shape."""

from dse.workload import OpKind
from generators.symbolic import SymbolicGenerator
from generators.symbolic import generator as module
from simulators.analytical import AnalyticalCostModel, cost_model
from simulators.analytical.fastpath import _layout, program_layout
from tests.helpers import make_point

DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}
SHAPE = dict(tp=2, pp=4, dp=2, sp=True, zero=2, global_batch=32, system=DGX)


def _p2p(workload) -> frozenset[int]:
    return frozenset(
        b for b, block in enumerate(workload.blocks) if any(op.kind in (OpKind.SEND, OpKind.RECV) for op in block.ops)
    )


def test_a_layout_kept_on_the_shape_equals_a_fresh_one():
    module._SKELETONS.clear()
    first = SymbolicGenerator().generate(make_point(recompute="none", **SHAPE))
    second = SymbolicGenerator().generate(make_point(recompute="full", **SHAPE))
    p2p = _p2p(second)
    for a, b in zip(first.programs, second.programs, strict=True):
        assert a.shape is b.shape and b.call_shape() is b.shape
        kept = program_layout(a, p2p)
        assert program_layout(b, p2p) is kept  # the second point reads the first one's
        assert kept == _layout(list(b.calls), p2p)


def test_a_shape_that_no_longer_holds_the_calls_is_ignored():
    workload = SymbolicGenerator().generate(make_point(**SHAPE))
    program = workload.programs[1]
    shape = program.shape
    assert shape is not None and program.call_shape() is shape
    last = program.calls[-1]
    program.calls[-1] = last._replace(inputs=last.inputs[:1])
    assert program.call_shape() is None
    p2p = _p2p(workload)
    assert program_layout(program, p2p) == _layout(program.calls, p2p)
    program.calls[-1] = last
    assert program.call_shape() is shape


def test_results_with_and_without_the_shapes_agree_exactly():
    point = make_point(**SHAPE)
    module._SKELETONS.clear()
    SymbolicGenerator().generate(point)
    reused = SymbolicGenerator().generate(point)
    fresh = SymbolicGenerator().generate(point)
    for program in fresh.programs:
        program.shape = None
    model = AnalyticalCostModel()
    a = model.simulate(reused, point.system)
    cost_model._RESULTS.clear()  # the results cache would hand `a` back: the two workloads are equal
    b = model.simulate(fresh, point.system)
    assert a.step_time_s == b.step_time_s
    assert [c.peak_memory_bytes for c in a.classes] == [c.peak_memory_bytes for c in b.classes]
    assert [c.time_by_category for c in a.classes] == [c.time_by_category for c in b.classes]


def test_points_with_the_same_saved_bytes_share_activation_tensors_equal_to_fresh_ones():
    """ZeRO 0 and 1 differ in optimizer memory, not in calls or activations: the second point reuses the first's
    activation tensors, and they equal those of a fresh generation."""
    module._SKELETONS.clear()
    fresh = SymbolicGenerator().generate(make_point(**{**SHAPE, "zero": 1}))
    module._SKELETONS.clear()
    first = SymbolicGenerator().generate(make_point(**{**SHAPE, "zero": 0}))
    reused = SymbolicGenerator().generate(make_point(**{**SHAPE, "zero": 1}))
    assert [p.tensors for p in reused.programs] == [p.tensors for p in fresh.programs]
    assert reused.programs[0].tensors[-1] is first.programs[0].tensors[-1]
    assert any(t.kind == "optimizer_state" for t in reused.programs[0].tensors)
