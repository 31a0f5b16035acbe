"""Per-call facts of a program, kept on its CallShape: later points of the shape call alike."""

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TypeVar

import numpy as np

from dse.calls import CallColumns
from dse.workload import Call, CallShape, Program

T = TypeVar("T")


def memoised(program: Program, key: tuple, make: Callable[[], T]) -> T:
    """make(), kept on the program's CallShape under `key` when it has one (`made_on`)."""
    shape = program.call_shape()
    return make() if shape is None else made_on(shape, key, make)


def made_on(shape: CallShape, key: tuple, make: Callable[[], T]) -> T:
    """make(), kept on the shape under `key`: for a caller that has checked the shape holds its program's calls
    (the check walks every call). `make` reads what it needs, not the shape's calls as tuples: a shape made of its
    columns (a spliced one) would make them for it."""
    if key not in shape.memo:
        shape.memo[key] = make()
    return shape.memo[key]


def on_columns(shape: CallShape, key: tuple, derive: Callable[[CallColumns], T]) -> T:
    """derive(shape.columns()), kept on the shape under `key` (`made_on`)."""
    return made_on(shape, key, lambda: derive(shape.columns()))


def call_array(program: Program, field: str) -> np.ndarray:
    """`call.<field>` of every call (an int field: block, microbatch, layer, tag)."""
    shape = program.call_shape()
    return _field(program.calls, field) if shape is None else shape_array(shape, field)


def shape_array(shape: CallShape, field: str) -> np.ndarray:
    """`call_array` of a program whose shape is known to hold its calls: a column of the shape's
    (`CallShape.columns`), which a spliced shape is made of."""
    return on_columns(shape, ("calls", field), lambda columns: getattr(columns, field))


def _field(calls: Sequence[Call], field: str) -> np.ndarray:
    return np.fromiter(map(attrgetter(field), calls), np.intp, len(calls))
