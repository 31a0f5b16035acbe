"""Per-call facts of a program, kept on its CallShape: later points of the shape call alike."""

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TypeVar

import numpy as np

from dse.workload import Call, CallShape, Program

T = TypeVar("T")


def memoised(program: Program, key: tuple, derive: Callable[[Sequence[Call]], T]) -> T:
    """derive(calls), kept on the program's CallShape under `key` when it has one."""
    shape = program.call_shape()
    if shape is None:
        return derive(program.calls)
    return on_shape(shape, key, derive)


def on_shape(shape: CallShape, key: tuple, derive: Callable[[Sequence[Call]], T]) -> T:
    """derive(shape.calls), kept on the shape under `key`: for a caller that has checked the shape holds its
    program's calls already (the check walks every call)."""
    if key not in shape.memo:
        shape.memo[key] = derive(shape.calls)
    return shape.memo[key]


def call_array(program: Program, field: str) -> np.ndarray:
    """`call.<field>` of every call (an int field: block, microbatch, layer, tag)."""
    return memoised(program, ("calls", field), lambda calls: _field(calls, field))


def shape_array(shape: CallShape, field: str) -> np.ndarray:
    """`call_array` of a program whose shape is known to hold its calls."""
    return on_shape(shape, ("calls", field), lambda calls: _field(calls, field))


def _field(calls: Sequence[Call], field: str) -> np.ndarray:
    return np.fromiter(map(attrgetter(field), calls), np.intp, len(calls))
