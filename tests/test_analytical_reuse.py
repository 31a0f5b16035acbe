"""What the cost model keeps on a program's CallShape (the generator's reused schedule skeleton) equals what it
derives afresh, and is not used once the program's calls no longer match the shape."""

import numpy as np

from dse.workload import NO_CALL, TableTensors, Tensor, TensorKind, tensor_columns
from generators.symbolic import SymbolicGenerator
from generators.symbolic import skeleton as module
from simulators.analytical import AnalyticalCostModel, cost_model
from simulators.analytical.call_layout import call_arrays
from tests.helpers import make_point

DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}
SHAPE = dict(tp=2, pp=4, dp=2, sp=True, zero=2, grad_reduce="per_microbatch", global_batch=32, system=DGX)


def _fresh(calls) -> tuple[np.ndarray, ...]:
    return (
        np.array([c.block for c in calls]),
        np.array([c.tag for c in calls]),
        np.array([len(c.inputs) for c in calls]),
        np.array([i for c in calls for i in c.inputs]),
    )


def _arrays(program) -> tuple[np.ndarray, ...]:
    kept = call_arrays(program)
    return kept.blocks, kept.tags, kept.input_counts, kept.inputs


def test_the_call_arrays_kept_on_the_shape_equal_fresh_ones():
    module._SKELETONS.clear()
    first = SymbolicGenerator().generate(make_point(recompute="none", **SHAPE))
    second = SymbolicGenerator().generate(make_point(recompute="full", **SHAPE))
    for a, b in zip(first.programs, second.programs, strict=True):
        assert a.shape is b.shape and b.call_shape() is b.shape
        kept = call_arrays(a)
        assert call_arrays(b) is kept  # the second point reads the first one's
        assert all(np.array_equal(x, y) for x, y in zip(_arrays(b), _fresh(b.calls), strict=True))


def test_a_shape_that_no_longer_holds_the_calls_is_ignored():
    workload = SymbolicGenerator().generate(make_point(**SHAPE))
    program = workload.programs[1]
    shape = program.shape
    assert shape is not None and program.call_shape() is shape
    last = program.calls[-1]
    program.calls[-1] = last._replace(inputs=last.inputs[:1])
    assert program.call_shape() is None
    assert all(np.array_equal(x, y) for x, y in zip(_arrays(program), _fresh(program.calls), strict=True))
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


def test_points_of_one_shape_share_the_table_of_activation_tensors_and_equal_fresh_ones():
    """ZeRO 0 and 1 differ in optimizer memory, not in calls or activations: the second point's programs hold the
    first's table of activation tensors with their own sizes. Unmade, they give the memory sweep the columns of
    the tensors a fresh generation makes; made, they equal those tensors."""
    module._SKELETONS.clear()
    fresh = SymbolicGenerator().generate(make_point(**{**SHAPE, "zero": 1})).steady.programs
    module._SKELETONS.clear()
    first = SymbolicGenerator().generate(make_point(**{**SHAPE, "zero": 0})).steady.programs
    reused = SymbolicGenerator().generate(make_point(**{**SHAPE, "zero": 1})).steady.programs
    for a, b in zip(reused, fresh, strict=True):
        assert isinstance(a.tensors, TableTensors) and a.tensors._table is first[a.rank_class].tensors._table
        for made, unmade in zip(tensor_columns(list(b.tensors)), a.tensors.columns(), strict=True):
            assert np.array_equal(made, unmade)
    assert [p.tensors for p in reused] == [p.tensors for p in fresh]
    assert any(t.kind == "optimizer_state" for t in reused[0].tensors)
    assert [t.bytes for t in reused[0].tensors if t.kind == "optimizer_state"] != [
        t.bytes for t in first[0].tensors if t.kind == "optimizer_state"
    ]


def test_table_tensors_changed_as_a_list_give_their_new_columns_and_snapshot():
    module._SKELETONS.clear()
    SymbolicGenerator().generate(make_point(**SHAPE))
    tensors = SymbolicGenerator().generate(make_point(**SHAPE)).steady.programs[0].tensors
    assert isinstance(tensors, TableTensors)
    before, count = tensors.snapshot(), len(tensors.columns().bytes)
    assert list(tensors[:3]) == list(tensors)[:3] and list(tensors.copy()) == list(tensors)  # UserList makes these
    assert tensors.snapshot() == ("rows", tuple(tensors))  # made by the reads above
    tensors.append(Tensor("extra", TensorKind.TEMPORARY, 2.0**30))
    assert tensors.snapshot() != before
    columns = tensors.columns()
    assert len(columns.bytes) == count + 1 and columns.bytes[-1] == 2.0**30 and columns.producer[-1] == NO_CALL
