"""CallShape.holds answers as comparing every call would, though an unedited program's calls skip the comparison."""

import copy
import pickle
from collections.abc import Callable

import pytest

from dse.calls import Call, CallShape, ShapeCalls
from generators.symbolic import skeleton
from generators.symbolic.generator import SymbolicGenerator
from tests.helpers import make_point

DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}

CALLS = (Call(0), Call(1, (0,)), Call(2, (1,), 3, 4, 5))

EDITS: list[Callable[[list[Call]], object]] = [
    lambda calls: calls.__setitem__(0, Call(7)),
    lambda calls: calls.__setitem__(slice(0, 1), [Call(7)]),
    lambda calls: calls.__delitem__(0),
    lambda calls: calls.__iadd__([Call(7)]),
    lambda calls: calls.__imul__(2),
    lambda calls: calls.append(Call(7)),
    lambda calls: calls.extend([Call(7)]),
    lambda calls: calls.insert(0, Call(7)),
    lambda calls: calls.pop(),
    lambda calls: calls.remove(CALLS[0]),
    lambda calls: calls.clear(),
    lambda calls: calls.sort(key=lambda call: -call.block),
    lambda calls: calls.reverse(),
]


def test_a_shapes_own_copy_holds_it_until_edited():
    shape = CallShape(CALLS)
    calls = shape.program_calls()
    assert type(calls) is ShapeCalls and calls == list(CALLS) and not calls.edited
    assert shape.holds(calls) and calls.shape is shape


@pytest.mark.parametrize("edit", EDITS)
def test_every_edit_in_place_is_noted_and_checked_by_comparison(edit):
    shape = CallShape(CALLS)
    calls = shape.program_calls()
    edit(calls)
    assert calls.edited
    assert shape.holds(calls) == (tuple(calls) == CALLS)


def test_calls_put_back_as_they_were_hold_again():
    shape = CallShape(CALLS)
    calls = shape.program_calls()
    calls[-1] = Call(9)
    assert not shape.holds(calls)
    calls[-1] = CALLS[-1]
    assert shape.holds(calls)


def test_copies_and_other_lists_are_compared_call_by_call():
    shape = CallShape(CALLS)
    for calls in (
        list(CALLS),
        copy.copy(shape.program_calls()),
        copy.deepcopy(shape.program_calls()),
        pickle.loads(pickle.dumps(shape.program_calls())),
        CallShape(CALLS).program_calls(),
    ):
        assert shape.holds(calls)
    assert not shape.holds([*CALLS, Call(0)])
    assert not shape.holds(list(CALLS[:-1]))


def test_generated_programs_hold_their_shapes_walked_or_filled():
    point = make_point(tp=2, pp=4, dp=2, global_batch=32, system=DGX)
    skeleton._SKELETONS.clear()
    skeleton._STEPS.clear()
    walked = SymbolicGenerator().generate(point)
    filled = SymbolicGenerator().generate(point)
    for a, b in zip(walked.programs, filled.programs, strict=True):
        assert a.shape is b.shape is not None
        assert a.call_shape() is a.shape and b.call_shape() is b.shape
        assert a.calls == b.calls and a.calls is not b.calls
        assert list(a.tensors) == list(b.tensors)
