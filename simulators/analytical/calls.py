"""Per-call fields of a program as arrays, kept on its CallShape: later points of the shape call alike."""

import numpy as np

from dse.workload import Program


def call_array(program: Program, field: str) -> np.ndarray:
    """`call.<field>` of every call (an int field: block, microbatch, layer, tag)."""
    shape = program.call_shape()
    calls = program.calls if shape is None else shape.calls
    key = ("calls", field)
    values = None if shape is None else shape.memo.get(key)
    if values is None:
        values = np.fromiter((getattr(call, field) for call in calls), np.intp, len(calls))
        if shape is not None:
            shape.memo[key] = values
    return values


def call_reach(program: Program) -> np.ndarray:
    """How many calls back each call reads: its index minus its earliest input's (0 without inputs)."""
    shape = program.call_shape()
    calls = program.calls if shape is None else shape.calls
    values = None if shape is None else shape.memo.get(("calls", "reach"))
    if values is None:
        values = np.fromiter((c - min(call.inputs, default=c) for c, call in enumerate(calls)), np.intp, len(calls))
        if shape is not None:
            shape.memo[("calls", "reach")] = values
    return values
