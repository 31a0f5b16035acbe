"""A block's op seconds on every system of a batch at once (`BatchPricer.seconds`), as `pricing.BlockPricer`
prices them system by system.

Compute ops depend on the accelerator alone: each distinct accelerator's BlockPricer prices them, once per block.
Communication depends on the network (and the NCCL and DeepEP tables, which come with the accelerator's kernel
tables): networks of one structure (`batch_network.structure`) are priced together, each collective and send in a
few array operations over the group (`batch_network`), and a collective or send of equal size over a group of
equal span once for every block and class that runs it. A group whose fabric is not a closed form in its rates
(`batch_network.vectorizable`) is priced network by network by the scalar code.
"""

from dataclasses import dataclass
from functools import reduce
from typing import Any

import numpy as np

from dse.system import SystemSpec
from dse.workload import Collective, Op, OpKind, Workload
from simulators.analytical import batch_network
from simulators.analytical.batch_network import Rates, Seconds, crossed
from simulators.analytical.network import within_node
from simulators.analytical.pricing import BlockPricer


@dataclass(frozen=True, slots=True)
class _Group:
    """Networks of one structure and tables: `members` (indices among the batch's distinct networks) are priced
    together by the first's pricer (spans, peers, tables) with each dimension's `rates`, or one by one by `scalar`
    where the fabric is not vectorizable."""

    members: np.ndarray
    pricer: BlockPricer
    system: SystemSpec
    rates: list[Rates] | None
    scalar: list[BlockPricer]
    seen: dict[tuple[Any, ...], Seconds]
    """Seconds per (kind, size, span or the dimensions each send crosses): equal keys, equal prices."""


class BatchPricer:
    """Prices blocks on every system of a batch: `timings` are the systems' (accelerator, network) timing keys."""

    def __init__(self, workload: Workload, systems: list[SystemSpec], timings: list[tuple[str, str]]) -> None:
        self._workload = workload
        accelerators: dict[str, int] = {}
        networks: dict[str, int] = {}
        self._acc_of = np.array([accelerators.setdefault(accelerator, len(accelerators)) for accelerator, _ in timings])
        self._net_of = np.array([networks.setdefault(network, len(networks)) for _, network in timings])
        first_acc = [systems[int(np.argmax(self._acc_of == a))] for a in range(len(accelerators))]
        self._acc = [BlockPricer(workload, system) for system in first_acc]
        self._networks = len(networks)
        by_structure: dict[tuple[Any, ...], list[SystemSpec]] = {}
        indices: dict[tuple[Any, ...], list[int]] = {}
        for n in range(len(networks)):
            system = systems[int(np.argmax(self._net_of == n))]
            accelerator = system.accelerator
            tables = accelerator.kernel_tables.model_dump_json() if accelerator.kernel_tables is not None else None
            key = (batch_network.structure(system.network), accelerator.reads_tables, tables)
            by_structure.setdefault(key, []).append(system)
            indices.setdefault(key, []).append(n)
        self._groups = [_group(workload, members, np.array(indices[key])) for key, members in by_structure.items()]
        self._compute: dict[int, np.ndarray] = {}

    def seconds(self, block: int, rank_class: int) -> np.ndarray:
        """ops x systems: each op's seconds on each system, as `BlockPricer.durations` gives them. The array is
        the transpose of a systems x ops one, as before: a column's sum over its ops (`durations_of`) runs along
        memory, which numpy sums in its own order, so the layout is part of the floats."""
        compute = self._compute.get(block)
        if compute is None:
            compute = self._compute[block] = np.array([pricer.compute(block) for pricer in self._acc])
        ops = self._workload.blocks[block].ops
        comm = np.zeros((self._networks, len(ops)))
        for i, op in enumerate(ops):
            if op.kind is not OpKind.COMPUTE:
                for group in self._groups:
                    comm[group.members, i] = self._communication(group, op, rank_class)
        return (compute[self._acc_of] + comm[self._net_of]).T

    def _communication(self, group: _Group, op: Op, rank_class: int) -> Seconds:
        """A collective's or send's seconds on each network of the group (`BlockPricer.communication`)."""
        if group.rates is None:
            return np.array([pricer.communication(op, rank_class) for pricer in group.scalar])
        pricer = group.pricer
        if op.kind is OpKind.COLLECTIVE:
            span, dims = pricer.span(op.axis, rank_class), pricer.dims(op.axis, rank_class)
            exchange = self._workload.expert_exchange
            exchanged = pricer.exchange is not None and exchange is not None and op.category == Collective.ALL_TO_ALL
            shape = tuple((d, count, id(dim)) for d, (dim, count) in zip(dims, span, strict=True))
            key: tuple[Any, ...] = (op.category, op.comm_bytes, op.name if exchanged else "", shape)
            found = group.seen.get(key)
            if found is None:
                rates = [(group.rates[d].placed(dim), count) for d, (dim, count) in zip(dims, span, strict=True)]
                if exchanged:
                    assert pricer.exchange is not None and exchange is not None
                    found = batch_network.exchange_time(pricer.exchange, exchange, op.name, op.comm_bytes, rates, dims)
                if found is None:
                    node = within_node(pricer.node, dims)
                    found = batch_network.collective_time(op.category, op.comm_bytes, rates, node)
                group.seen[key] = found
            return found
        network = group.system.network
        hops = tuple(crossed(r, p, network) for r, p in pricer.hops(op.axis, op.peer, rank_class))
        key = (op.kind, op.comm_bytes, hops)
        found = group.seen.get(key)
        if found is None:
            times = [batch_network.p2p_time(op.comm_bytes, crossing, group.rates) for crossing in hops]
            found = group.seen[key] = reduce(np.maximum, times)
        return found


def _group(workload: Workload, systems: list[SystemSpec], members: np.ndarray) -> _Group:
    """The group of these systems' networks (one system per network)."""
    first = systems[0]
    if not batch_network.vectorizable(first.network):
        scalar = [BlockPricer(workload, system) for system in systems]
        return _Group(members, scalar[0], first, None, scalar, {})
    rates = [Rates.of([system.network[d] for system in systems]) for d in range(len(first.network))]
    return _Group(members, BlockPricer(workload, first), first, rates, [], {})
