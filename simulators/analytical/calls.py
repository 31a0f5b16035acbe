"""Per-call facts of a program, kept on its CallShape: later points of the shape call alike."""

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from numba import njit

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
    return np.fromiter((getattr(call, field) for call in calls), np.intp, len(calls))


def call_reach(program: Program) -> np.ndarray:
    """How many calls back each call reads: its index minus its earliest input's (0 without inputs)."""

    def derive(calls: Sequence[Call]) -> np.ndarray:
        counts = np.fromiter((len(call.inputs) for call in calls), np.intp, len(calls))
        inputs = np.fromiter((i for call in calls for i in call.inputs), np.intp, int(counts.sum()))
        return reach_of(counts, inputs)

    return memoised(program, REACH_KEY, derive)


REACH_KEY = ("calls", "reach")
"""Where `call_reach` is kept on a shape (`steady` keeps it there from the arrays it has already)."""


@njit(cache=True)
def reach_of(counts: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """`call_reach` from the calls' input counts and their inputs in order."""
    reach = np.zeros(len(counts), dtype=np.intp)
    at = 0
    for c in range(len(counts)):
        if counts[c]:
            low = inputs[at]
            for k in range(at + 1, at + counts[c]):
                low = min(low, inputs[k])
            reach[c] = c - low
        at += counts[c]
    return reach
