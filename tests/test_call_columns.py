"""A shape's calls as columns (`CallColumns`) hold the same calls as its tuples, either made from the other; a shape
made of columns (a spliced skeleton's) makes no tuples until its calls are read."""

from dse.calls import Call, CallColumns, CallShape

CALLS = (
    Call(0),
    Call(1, (0,), 3, 0, 5),
    Call(2, (0, 1), -1, 1, 0),
    Call(1, (), 4, -1, 0),
    Call(3, (2, 1, 0), 5, 2, 7),
)


def test_columns_hold_the_calls_and_give_them_back():
    columns = CallColumns.of(CALLS)
    assert columns.input_counts.tolist() == [0, 1, 2, 0, 3]
    assert columns.inputs.tolist() == [0, 0, 1, 2, 1, 0]
    made = columns.calls()
    assert made == CALLS
    assert all(type(x) is int for call in made for x in (call.block, *call.inputs, call.layer, call.tag))


def test_a_span_and_a_join_are_the_calls_sliced_and_joined():
    columns = CallColumns.of(CALLS)
    assert columns.span(1, 4).calls() == CALLS[1:4]
    assert CallColumns.joined([columns.span(0, 2), columns.span(2, 5)]).calls() == CALLS
    assert columns.span(2, 3).same(CallColumns.of(CALLS[2:3]))
    assert not columns.span(1, 2).same(columns.span(3, 4))


def test_a_shape_of_columns_makes_its_calls_only_when_read():
    shape = CallShape(columns=CallColumns.of(CALLS))
    calls = shape.program_calls()
    assert len(shape) == len(calls) == len(CALLS) and shape._calls is None
    assert shape.holds(calls) and shape._calls is None
    assert list(calls) == list(CALLS) and shape.calls is shape.calls
    assert CallShape(CALLS).columns().same(CallColumns.of(CALLS))
