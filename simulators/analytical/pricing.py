"""Seconds per op of a block as one rank class runs it.

Every call of a block costs the same, so the engine asks once per (block, class). Only communication depends
on the class: its process groups and peers are those of the class's representative rank, and a group's span is
cached per (axis, class) because the same groups recur in every layer. Ranks of one class whose groups
straddle the network differently (a layout misaligned with the dimensions) are all priced like the
representative, except a ring of sends within the class, which waits for its slowest hop (`hops`). A collective
within one node is read from the accelerator's NCCL tables where it has them (`network.within_node`), a serving
step's MoE dispatch and combine from its DeepEP tables (`network.exchange_time`) and its routed experts from its
fused-MoE table (`expert_block`), where they have them. On an accelerator with memory tiers, a memory-bound op's
bytes are priced by the tiers the step's working set fills (`memory.working_set`).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dse.compute import ComputeModel
from dse.lru import MIB, ByteBoundedLru, IdentityMemo
from dse.system import AcceleratorSpec, SystemSpec
from dse.tables.deepep import DEEPEP_TABLE, MeasuredExchange
from dse.tables.moe import MOE_TABLE, MeasuredMoe
from dse.tables.nccl import NCCL_TABLE, MeasuredCollectives
from dse.workload import Collective, Op, OpKind, RankLayout, Workload
from simulators.analytical.memory import working_set
from simulators.analytical.network import (
    Span,
    collective_time,
    exchange_time,
    group_span,
    p2p_dim,
    p2p_time,
    spanned_dims,
    within_node,
)


class BlockPricer:
    def __init__(self, workload: Workload, system: SystemSpec) -> None:
        self._workload = workload
        self._system = system
        tables = _tables_of(workload, system)
        self._model = tables.model
        self.node = tables.node
        """The NCCL tables that price a collective within one node (`network.within_node`), or None."""
        self.exchange = tables.exchange
        """The DeepEP tables that price a serving step's MoE all-to-all (`exchanged`), or None."""
        self._moe = tables.moe
        self._compute: dict[int, list[float]] = {}
        self._comm: dict[int, list[int]] = {}
        """Per block, its communication ops: the only ones whose seconds depend on the class."""
        self.sources: dict[int, list[str]] = {}
        """Per block, what priced each compute op ('table', 'gemm_table', 'moe_table', 'roofline', ...; '' for
        communication)."""
        self._groups: dict[tuple[str, int], _Group] = {}
        self._hops: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        self._layout_groups: _LayoutGroups | None = None
        self._representatives: dict[int, int] | None = None

    def representative(self, rank_class: int) -> int:
        """The rank whose groups and peers price the class's communication: the class's first rank, as
        `Workload.representative` finds it; every class's is found in one pass over the ranks, and kept."""
        if self._representatives is None:
            self._representatives = _representatives_of(self._workload.class_of)
        rank = self._representatives.get(rank_class)
        return self._workload.representative(rank_class) if rank is None else rank

    def durations(self, block: int, rank_class: int) -> list[float]:
        """Seconds of each op of the block; a p2p op's figure is the transfer its own side would start."""
        out = list(self.compute(block))
        ops = self._workload.blocks[block].ops
        for i in self._comm[block]:
            out[i] = self.communication(ops[i], rank_class)
        return out

    def compute(self, block: int) -> list[float]:
        """Seconds of each compute op of the block (0 for communication), the same for every class."""
        compute = self._compute.get(block)
        if compute is None:
            ops = self._workload.blocks[block].ops
            priced = self.expert_block(
                ops, [self._model.price(op) if op.kind is OpKind.COMPUTE else (0.0, "") for op in ops]
            )
            compute = self._compute[block] = [seconds for seconds, _ in priced]
            self.sources[block] = [source for _, source in priced]
            self._comm[block] = [i for i, op in enumerate(ops) if op.kind is not OpKind.COMPUTE]
        return compute

    def communication(self, op: Op, rank_class: int) -> float:
        """Seconds of a collective or p2p op of the class."""
        if op.kind is OpKind.COLLECTIVE:
            seconds = self.exchanged(op, rank_class)
            if seconds is None:
                node = within_node(self.node, self.dims(op.axis, rank_class))
                seconds = collective_time(op.category, op.comm_bytes, self.span(op.axis, rank_class), node)
            return seconds
        network = self._system.network
        return max(p2p_time(op.comm_bytes, r, p, network) for r, p in self.hops(op.axis, op.peer, rank_class))

    def source(self, block: int, op_index: int, rank_class: int) -> str:
        """What priced an op for this class: its compute source, DEEPEP_TABLE for a MoE all-to-all the DeepEP tables
        priced, NCCL_TABLE for a collective the node's NCCL tables priced, '' for communication the network model
        priced."""
        op = self._workload.blocks[block].ops[op_index]
        if op.kind is OpKind.COMPUTE:
            self.compute(block)  # a plan kept from an earlier point leaves its block unpriced here
            return self.sources[block][op_index]
        if op.kind is not OpKind.COLLECTIVE:
            return ""
        if self.exchanged(op, rank_class) is not None:
            return DEEPEP_TABLE
        return NCCL_TABLE if within_node(self.node, self.dims(op.axis, rank_class)) is not None else ""

    def expert_block(self, ops: Sequence[Op], priced: list[tuple[float, str]]) -> list[tuple[float, str]]:
        """The block's (seconds, source) per op with its routed experts, where it has them, priced together from
        the fused-MoE table (MOE_TABLE), each op at the share of the table's time its own price gives it."""
        experts = self._workload.expert_compute
        if self._moe is None or experts is None:
            return priced
        members = [i for i, op in enumerate(ops) if op.kind is OpKind.COMPUTE and op.name.startswith(experts.prefix)]
        gate = next((ops[i] for i in members if ops[i].name == experts.gemm and ops[i].gemm is not None), None)
        measured = None if gate is None else self._moe.seconds(experts, gate)
        if measured is None:
            return priced
        shares = self._moe.split(measured, [ops[i] for i in members], [priced[i][0] for i in members])
        out = list(priced)
        for i, seconds in zip(members, shares, strict=True):
            out[i] = (seconds, MOE_TABLE)
        return out

    def exchanged(self, op: Op, rank_class: int) -> float | None:
        """Seconds of a serving step's MoE all-to-all from the DeepEP tables, or None where they do not price it."""
        exchange = self._workload.expert_exchange
        if self.exchange is None or exchange is None or op.category != Collective.ALL_TO_ALL:
            return None
        span, dims = self.span(op.axis, rank_class), self.dims(op.axis, rank_class)
        return exchange_time(self.exchange, exchange, op.name, op.comm_bytes, span, dims)

    def hops(self, axis: str, offset: int, rank_class: int) -> list[tuple[int, int]]:
        """The (rank, peer) transfers that price a p2p op of the class.

        A peer in another class (the next pipeline stage) is the representative's own. A peer in the same class
        makes the op one step of a ring the class runs around the axis (context parallelism's K/V shift): every
        member sends at once and every member's next step reads what it received, so the step lasts as long as
        the ring's slowest hop, which is not the representative's when the ring straddles a network dimension
        (four CP ranks on two nodes: two NVLink hops and two InfiniBand hops)."""
        key = (axis, offset, rank_class)
        hops = self._hops.get(key)
        if hops is None:
            layout, rank = self._workload.layout, self.representative(rank_class)
            peer = self.peer(axis, offset, rank_class)[0]
            hops = [(rank, peer)]
            if self._workload.class_of[peer] == rank_class:
                hops = [(r, layout.peer(r, axis, offset)) for r in layout.group(rank, axis)]
            self._hops[key] = hops
        return hops

    def span(self, axis: str, rank_class: int) -> Span:
        return self._group(axis, rank_class).span

    def dims(self, axis: str, rank_class: int) -> tuple[int, ...]:
        """Network dimensions a collective on this axis occupies for this rank class."""
        return self._group(axis, rank_class).dims

    def p2p_dim(self, axis: str, offset: int, rank_class: int) -> int | None:
        """The network dimension a p2p op of this class crosses to its peer (None: the peer is itself)."""
        return self.peer(axis, offset, rank_class)[1]

    def peer(self, axis: str, offset: int, rank_class: int) -> tuple[int, int | None]:
        """The peer of the class's representative `offset` positions along the axis, and the network dimension a
        p2p op to it crosses (`_LayoutGroups.peer`)."""
        return self._layout().peer(axis, offset, self.representative(rank_class))

    def spans(self, axes: tuple[str, ...], rank_class: int) -> tuple[tuple, tuple]:
        """Per axis of the class's groups, its span key and its spread (one lookup of each group for both).

        span key: (dimension index, NPUs spanned) per dimension the group spans; equal keys, equal prices within
        a workload, where `plans.Planner` shares a plan between classes by them.
        spread: the span key with each dimension's value as the group sees it (the system's own dimension, or
        where that is not what the group sees, a cube-mesh's ring or a tapered dimension: `fabrics.placed`), as
        its JSON. With the accelerator (the node's NCCL and DeepEP tables) and the workload's `pricing_settings`,
        all that prices a collective of the class (`communication`: `collective_time` reads the span's dimensions
        and counts, `within_node` and `exchange_time` the indices), whatever the workload and system."""
        return self._layout().spans_of(axes, self.representative(rank_class))

    def _group(self, axis: str, rank_class: int) -> "_Group":
        key = (axis, rank_class)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = self._layout().get(axis, self.representative(rank_class))
        return group

    def _layout(self) -> "_LayoutGroups":
        """The groups of the workload's layout on the system, kept across points (`_groups_of`)."""
        found = self._layout_groups
        if found is None:
            found = self._layout_groups = _groups_of(self._system, self._workload.layout)
        return found


_REPRESENTATIVES: IdentityMemo[dict[int, int]] = IdentityMemo(256)
"""Per array of the ranks' classes, each class's first rank (`_representatives_of`)."""


def _representatives_of(class_of: np.ndarray) -> dict[int, int]:
    """Each class's first rank, kept per array of the ranks' classes: a revisit's workload, and its steady check's
    longer form, hand back the same array to a new pricer, which found them again (a pass over the ranks) at a cost
    of about a tenth of what replaying a revisit's plans costs (`plans.Planner.replay`)."""
    return _REPRESENTATIVES.get(class_of, lambda: _first_ranks(class_of))


def _first_ranks(class_of: np.ndarray) -> dict[int, int]:
    classes, first = np.unique(class_of, return_index=True)
    return dict(zip(classes.tolist(), first.tolist(), strict=True))


@dataclass(frozen=True, slots=True)
class _Tables:
    """What prices a workload's ops on an accelerator besides its blocks: the compute model and the measured tables
    of collectives, MoE exchanges and fused experts, each None where the accelerator or workload has none."""

    model: ComputeModel
    node: MeasuredCollectives | None
    exchange: MeasuredExchange | None
    moe: MeasuredMoe | None


TABLES_BYTES = 2 * MIB
"""Compute models and tables for about 30 (accelerator, workload settings) pairs (TABLES_BYTES_EACH each)."""
TABLES_BYTES_EACH = 64 * 1024
"""An estimate of an entry's bytes beyond the tables other caches keep (a measured CSV's rows, memos); not
measured."""
_TABLES: ByteBoundedLru[tuple, _Tables] = ByteBoundedLru("pricing tables", TABLES_BYTES, lambda _: TABLES_BYTES_EACH)


def _tables_of(workload: Workload, system: SystemSpec) -> _Tables:
    """The tables that price the workload on the system's accelerator, kept per accelerator value (`facets`, its
    JSON) and the workload's settings: building them looks up and stats the table files, about 0.12 ms, and a
    sweep over networks makes a new system, with a new accelerator object of the same value, per point. An
    accelerator with memory tiers prices by the step's working set, so its compute model is built per workload.
    Like the plans kept per accelerator (`plans._context`), a kept entry does not see a table file replaced
    while the process runs."""
    accelerator = system.accelerator
    if accelerator.memory_tiers:
        return _tables(workload, accelerator, working_set(workload.programs, workload.blocks, accelerator))
    key = (facets(system).accelerator, *pricing_settings(workload))
    found = _TABLES.get(key)
    if found is None:
        found = _tables(workload, accelerator, None)
        _TABLES.put(key, found)
    return found


def pricing_settings(workload: Workload) -> tuple:
    """What of a workload besides its blocks and layout `BlockPricer` prices its ops by: its dtype, attention
    kernel, framework all-reduce, and expert exchange and compute (`_tables`, `expert_block`). What keeps priced
    things across workloads keys on these (the tables here, `plans`' kept plans)."""
    return (
        workload.dtype,
        workload.attention_kernel,
        workload.framework_allreduce,
        workload.expert_exchange,
        workload.expert_compute,
    )


def _tables(workload: Workload, accelerator: AcceleratorSpec, placed: float | None) -> _Tables:
    return _Tables(
        model=ComputeModel(accelerator, workload.dtype, workload.attention_kernel, placed),
        node=MeasuredCollectives.of(accelerator, workload.framework_allreduce),
        exchange=None if workload.expert_exchange is None else MeasuredExchange.of(accelerator),
        moe=None if workload.expert_compute is None else MeasuredMoe.of(accelerator, workload.dtype),
    )


@dataclass(frozen=True, slots=True)
class Facets:
    """A system's parts as values: what keeps priced things across systems keys on the parts their prices read
    (`plans`: a block's compute on the accelerator, its collectives on the dimensions their groups span), so that
    a system that differs in another part (a new InfiniBand bandwidth, and a block whose groups stay inside a
    node) finds them. Systems are interned per distinct data (`dse.point.points.validated_system`), but two of
    them share no part's object; a part's JSON is its value (every field, a field left out only at its default)."""

    accelerator: str
    network: tuple[str, ...]
    """Per dimension."""


_FACETS: IdentityMemo[Facets] = IdentityMemo(256)
"""Per system, its facets: a study has a few to thousands of systems; a JSON dump of a DGX H100's accelerator
takes about 20 us, against the hundreds of microseconds its plans save on a point."""


def facets(system: SystemSpec) -> Facets:
    """The system's facets, found by its identity."""
    return _FACETS.get(
        system,
        lambda: Facets(system.accelerator.model_dump_json(), tuple(dim.model_dump_json() for dim in system.network)),
    )


@dataclass(frozen=True, slots=True)
class _Group:
    """How a rank's process group on one axis spans the network: what prices its collectives."""

    span: Span
    dims: tuple[int, ...]
    key: tuple[tuple[int, int], ...]
    spread: tuple


GROUP_BYTES = 4 * MIB
"""Groups of about 10,000 (axis, rank) pairs of layouts on systems (GROUP_BYTES_EACH each), far more than a study
meets."""
GROUP_BYTES_EACH = 400
"""An estimate of a _Group's bytes with its key: a few short tuples and a list (the dimensions are the system's);
counted for an entry of `_LayoutGroups.spans` or `peers` too (a key and two short tuples or ints)."""


@dataclass(slots=True)
class _LayoutGroups:
    """The groups of one layout on one system, found as points ask for them and kept across points: a study's
    points share the system and most layouts, and finding a group's span walks its members over every dimension.
    One cache entry per layout, so that a point looks the cache up once."""

    system: SystemSpec
    """Kept so that the identity the entry's key holds stays its own."""
    layout: RankLayout
    groups: dict[tuple[str, int], _Group]
    spans: dict[tuple[tuple[str, ...], int], tuple[tuple, tuple]]
    """Per (axes, rank), `BlockPricer.spans` of the rank's groups: a point of the layout asks for the same 30-odd
    again, and joining them from the groups cost about 2 us each."""
    peers: dict[tuple[str, int, int], tuple[int, int | None]]
    """Per (axis, offset, rank), `peer`: a skeleton of a block with p2p ops asks for its peers' (their classes
    and the dimensions its sends cross)."""

    def get(self, axis: str, rank: int) -> _Group:
        """The rank's group on the axis."""
        found = self.groups.get((axis, rank))
        if found is None:
            members = self.layout.group(rank, axis)
            network = self.system.network
            span, dims = group_span(members, network), spanned_dims(members, network)
            counts = tuple(count for _, count in span)
            texts = facets(self.system).network
            spread = tuple(
                (d, count, texts[d] if seen is network[d] else seen.model_dump_json())
                for d, (seen, count) in zip(dims, span, strict=True)
            )
            found = self.groups[axis, rank] = _Group(span, dims, tuple(zip(dims, counts, strict=True)), spread)
            _GROUPS.put((id(self.system), self.layout), self)  # its size has grown
        return found

    def peer(self, axis: str, offset: int, rank: int) -> tuple[int, int | None]:
        """The rank `offset` positions along the axis from this one, and the dimension a p2p op to it crosses
        (None: itself)."""
        found = self.peers.get((axis, offset, rank))
        if found is None:
            peer = self.layout.peer(rank, axis, offset)
            found = self.peers[axis, offset, rank] = peer, p2p_dim(rank, peer, self.system.network)
            _GROUPS.put((id(self.system), self.layout), self)  # its size has grown
        return found

    def spans_of(self, axes: tuple[str, ...], rank: int) -> tuple[tuple, tuple]:
        """The span keys and spreads of the rank's groups on the axes (`BlockPricer.spans`)."""
        found = self.spans.get((axes, rank))
        if found is None:
            groups = [self.get(axis, rank) for axis in axes]
            found = tuple([group.key for group in groups]), tuple([group.spread for group in groups])
            self.spans[axes, rank] = found
            _GROUPS.put((id(self.system), self.layout), self)  # its size has grown
        return found


_GROUPS: ByteBoundedLru[tuple[int, RankLayout], _LayoutGroups] = ByteBoundedLru(
    "process groups",
    GROUP_BYTES,
    lambda entry: GROUP_BYTES_EACH * (len(entry.groups) + len(entry.spans) + len(entry.peers)),
)


def _groups_of(system: SystemSpec, layout: RankLayout) -> _LayoutGroups:
    key = (id(system), layout)
    found = _GROUPS.get(key)
    if found is None or found.system is not system:
        found = _LayoutGroups(system, layout, {}, {}, {})
        _GROUPS.put(key, found)
    return found
