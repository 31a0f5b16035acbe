"""The durations a batch's tape reads, on every system of the batch (`batch.price_many`).

Block ops are priced by the per-point code (`pricing.BlockPricer`), once per distinct accelerator for compute ops
and once per distinct network for communication, and summed per tape column as the planner sums a fused run.
"""

from dataclasses import dataclass

import numpy as np

from dse.system import SystemSpec
from dse.workload import OpKind, Workload
from simulators.analytical.pricing import BlockPricer
from simulators.analytical.tape import Tape


@dataclass(frozen=True, slots=True)
class Priced:
    durations: np.ndarray
    """(columns + 1) x systems: every tape column's seconds on every system, and a row of zeros for 'no column'."""
    plan_categories: np.ndarray
    """plans x categories x systems: busy seconds per category of one call of each plan, p2p transfers left out
    (their time is known only once paired), as `plans.Plan.category_seconds`."""


def durations_of(workload: Workload, tape: Tape, systems: list[SystemSpec], timings: list[tuple[str, str]]) -> Priced:
    """Every duration the tape reads, on every system.

    Block ops are priced by the per-point code, once per distinct accelerator (compute ops) and once per distinct
    network (communication), and summed per column as the planner sums a fused run."""
    accelerators: dict[str, int] = {}
    networks: dict[str, int] = {}
    acc_of = np.array([accelerators.setdefault(accelerator, len(accelerators)) for accelerator, _ in timings])
    net_of = np.array([networks.setdefault(network, len(networks)) for _, network in timings])
    acc_pricers = [BlockPricer(workload, systems[int(np.argmax(acc_of == a))]) for a in range(len(accelerators))]
    net_pricers = [BlockPricer(workload, systems[int(np.argmax(net_of == n))]) for n in range(len(networks))]
    ops: dict[tuple[int, int], np.ndarray] = {}

    def seconds_of(pair: tuple[int, int]) -> np.ndarray:
        found = ops.get(pair)
        if found is None:
            found = ops[pair] = _block_seconds(workload, pair, acc_pricers, net_pricers, acc_of, net_of)
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
    return Priced(durations, plan_categories)


def _block_seconds(
    workload: Workload,
    pair: tuple[int, int],
    acc_pricers: list[BlockPricer],
    net_pricers: list[BlockPricer],
    acc_of: np.ndarray,
    net_of: np.ndarray,
) -> np.ndarray:
    """ops x systems: each block op's seconds on each system (`BlockPricer.durations`)."""
    compute = np.array([op.kind is OpKind.COMPUTE for op in workload.blocks[pair[0]].ops])
    by_acc = np.array([pricer.durations(*pair) for pricer in acc_pricers]) * compute
    by_net = np.array([pricer.durations(*pair) for pricer in net_pricers]) * ~compute
    return (by_acc[acc_of] + by_net[net_of]).T
