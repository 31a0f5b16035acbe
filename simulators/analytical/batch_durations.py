"""The durations a batch's tape reads, on every system of the batch (`batch.price_many`).

Block ops are priced on every system at once (`batch_pricing.BatchPricer`, the per-point code's floats) and summed per
tape column as the planner sums a fused run.
"""

from dataclasses import dataclass

import numpy as np

from dse.system import SystemSpec
from dse.workload import OpKind, Workload
from simulators.analytical.batch_pricing import BatchPricer
from simulators.analytical.tape import Tape


@dataclass(frozen=True, slots=True)
class Priced:
    durations: np.ndarray
    """(columns + 1) x systems: every tape column's seconds on every system, and a row of zeros for 'no column'."""
    plan_categories: np.ndarray
    """plans x categories x systems: busy seconds per category of one call of each plan, p2p transfers left out
    (their time is known only once paired), as `plans.Plan.category_seconds`."""
    finite: bool
    """Whether every one of plan_categories is finite: then a plan no call of a window runs adds exactly nothing to
    its sums (0 x inf would be NaN), so `batch_steady` skips it."""


def durations_of(workload: Workload, tape: Tape, systems: list[SystemSpec], timings: list[tuple[str, str]]) -> Priced:
    """Every duration the tape reads, on every system.

    Block ops are priced on every system at once and summed per column as the planner sums a fused run."""
    pricer = BatchPricer(workload, systems, timings)
    ops: dict[tuple[int, int], np.ndarray] = {}

    def seconds_of(pair: tuple[int, int]) -> np.ndarray:
        found = ops.get(pair)
        if found is None:
            found = ops[pair] = pricer.seconds(*pair)
        return found

    durations = np.zeros((len(tape.columns) + 1, len(systems)))
    for index, column in enumerate(tape.columns):
        durations[index] = seconds_of((column.block, column.rank_class))[column.lo : column.hi + 1].sum(axis=0)
    categories = {name: index for index, name in enumerate(tape.categories)}
    plan_categories = np.zeros((len(tape.plans), len(categories), len(systems)))
    for index, pair in enumerate(zip(tape.plan_block, tape.plan_class, strict=True)):
        seconds = seconds_of(pair)
        for op, row in zip(workload.blocks[pair[0]].ops, seconds, strict=True):
            if op.kind in (OpKind.COMPUTE, OpKind.COLLECTIVE):
                plan_categories[index, categories[op.category]] += row
    return Priced(durations, plan_categories, bool(np.isfinite(plan_categories).all()))
