"""Collective and point-to-point times on the hierarchical network, innermost dimension first.

Rank r sits at NPU r, so its coordinate in dimension i is (r // P_i) % npus_i with P_i the NPUs of the inner
dimensions. Bandwidths already include the dimension's efficiency, so the times are what nccl-tests would measure
for the same buffer sizes.

Inside one dimension of n NPUs, per-NPU bandwidth B and latency a, a buffer of S bytes costs (nccl-tests sizes;
an all-reduce is a reduce-scatter then an all-gather, so twice the one-phase figure):

    algorithm          reduce-scatter / all-gather / all-to-all     all-reduce                 broadcast
    ring               (n-1)/n S/B + (n-1) a                          2 (n-1)/n S/B + 2(n-1) a   S/B + (n-1) a
    direct             (n-1)/n S/B + a                                2 (n-1)/n S/B + 2 a        S/B + a
    halving_doubling   (n-1)/n S/B + log2(n) a                        2 (n-1)/n S/B + 2 log2(n) a  (tree)
    tree (pipelined)   (ring)                                         2 S/B + 2 log2(n) a        S/B + log2(n) a

`auto` picks direct on a fully connected dimension and ring elsewhere (NCCL's choice for large buffers on
NVSwitch and InfiniBand). A torus runs a ring along each of its axes in turn, each axis carrying the shard the
previous ones left (the bandwidth terms add up to one ring's), with B the bandwidth of one link in one direction.
All-to-all on a ring is priced at the injection bound, which is optimistic for a large ring (multi-hop traffic is
not modelled).

A switch that reduces in the network (`reduction_efficiency` e: NVLink SHARP, which NCCL's NVLS algorithm uses on
NVSwitch nodes, or InfiniBand SHARP) runs an all-reduce as S/(e B_line) + L: each NPU sends its buffer into the
switch once and receives the sum once, where a ring sends and receives 2(n-1)/n of it. L is the switch path's fixed
cost (`reduction_latency_ns`, default 2a); where it is larger than the ring's, small all-reduces take the ring, the
faster of the two at their size, as NCCL's tuner chooses. Its other collectives keep the dimension's algorithm.

A group that spans several dimensions runs as NCCL does on such a network: every dimension at once, each member
on its own links, so the slowest crossing bounds the time and each dimension's latency adds to it. Its rings (all-
reduce, reduce-scatter, all-gather, broadcast) run through all N members, and every member inside a block of an
outer dimension drives one of them across it on its own link (a channel per NIC):

    f(N) S / min_d(M_d b_d) + the dimensions' latencies,   f = 2(N-1)/N (all-reduce), (N-1)/N, 1 (broadcast)

with b_d the dimension's own bus bandwidth for the collective (read off its row above: B for a ring, 2(n-1)/n e
B_line with in-network reduction) and M_d the group's members inside one of its blocks (the inner counts'
product): outward bandwidth grows with the members behind it, as eight NICs per node do. An all-to-all sends each
member's share of the buffer straight to it, so dimension d carries the shares of the members outside the
sender's block of it, (c_d - 1) M_d / N of the buffer, at b_d. A hierarchical decomposition (reduce-scatter
inward, all-reduce across, all-gather outward, as ASTRA-sim runs it) crosses the outer dimension with as many
bytes for many nodes (2(m-1)/m against 2(N-1)/N), but one phase after another: it puts two nodes of eight A100s
with 4x200G InfiniBand at 100 GB/s bus bandwidth where nccl-tests measures 86 (this model: 90), and DGX H100 nodes
at 200-300 GB/s, well under the ~376 GB/s their eight 400G NICs carry, which bounds NCCL's rings there.

Where the accelerator has measured NCCL tables (`kernel_tables.nccl`, dse.tables.nccl), a collective whose group
lies within one node (spans the first dimension only) over a GPU count the tables ran is their time instead, on a
first dimension of another bandwidth scaled by this model's time there over its time at the measured line rate (the
same dimension otherwise): the measured latencies and protocol steps carry over and only the link's rate changes.
The tables measured the node's own topology, efficiency and latency, so those of the first dimension price only the
collectives the tables do not (other GPU counts, broadcasts) and the groups that leave the node.

Where it has measured DeepEP tables (`kernel_tables.deepep`, dse.tables.deepep), a serving step's MoE dispatch and
combine over an EP group of 8 GPUs in each of its nodes (within one first-dimension block, or across blocks of the
second dimension) is their time at its tokens per rank, scaled as above by this model's time on the group's
dimensions over its time on them at the measured nodes' line rates (`exchange_time`).
"""

from collections.abc import Sequence
from math import ceil, log2, prod

from dse.system import NetworkDim
from dse.tables.deepep import GPUS_PER_NODE, MeasuredExchange
from dse.tables.nccl import MeasuredCollectives
from dse.workload import Collective, ExpertExchange, bus_factor

Span = list[tuple[NetworkDim, int]]
"""The dimensions a process group spans (those where it has more than one coordinate) and that count."""

_SHARDING = frozenset({Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER})
"""Collectives that reduce or gather shards, which a torus runs axis by axis on a shrinking buffer."""


def group_span(ranks: Sequence[int], network: Sequence[NetworkDim]) -> Span:
    """Per dimension, how many distinct coordinates the members have; dimensions it stays inside drop out."""
    span: Span = []
    inner = 1
    for dim in network:
        count = len({(rank // inner) % dim.npus for rank in ranks})
        if count > 1:
            span.append((dim, count))
        inner *= dim.npus
    return span


def spanned_dims(ranks: Sequence[int], network: Sequence[NetworkDim]) -> tuple[int, ...]:
    """Indices of the dimensions a group spans: the links its collectives occupy."""
    out = []
    inner = 1
    for index, dim in enumerate(network):
        if len({(rank // inner) % dim.npus for rank in ranks}) > 1:
            out.append(index)
        inner *= dim.npus
    return tuple(out)


def _log2(n: int) -> int:
    return max(1, ceil(log2(n)))


def algorithm(dim: NetworkDim) -> str:
    """The algorithm a dimension runs: its own choice, or auto's per topology."""
    if dim.algorithm != "auto":
        return dim.algorithm
    return "direct" if dim.topology == "fully_connected" else "ring"


def torus_shape(dim: NetworkDim) -> list[int]:
    """Side lengths of a torus dimension: its shape, or the most balanced factorisation of npus."""
    if dim.shape is not None:
        return list(dim.shape)
    sides = int(dim.topology[-2])
    shape = []
    rest = dim.npus
    for remaining in range(sides, 0, -1):
        side = max(d for d in range(1, rest + 1) if rest % d == 0 and d <= round(rest ** (1 / remaining)) + 1e-9)
        shape.append(side)
        rest //= side
    return sorted(shape)


def _dim_parts(kind: Collective, size: float, dim: NetworkDim, count: int) -> tuple[float, float]:
    """One dimension's share of a collective over `count` of its NPUs as (fixed seconds, seconds of the buffer):
    its algorithm's, or for an all-reduce on a switch that reduces in the network whichever of that and its own
    algorithm is faster at this size, as NCCL's tuner picks NVLS only where it wins (its fixed cost is larger)."""
    own = _dim_time(kind, size, dim, count)
    fixed = _dim_time(kind, 0.0, dim, count)
    if kind is Collective.ALL_REDUCE and dim.reduction_efficiency is not None:
        latency = 2 * dim.latency if dim.reduction_latency_ns is None else dim.reduction_latency_ns * 1e-9
        streamed = size / (dim.bandwidth_GBps * 1e9 * dim.reduction_efficiency)
        if latency + streamed <= own:
            return latency, streamed
    return fixed, own - fixed


def _dim_time(kind: Collective, size: float, dim: NetworkDim, count: int) -> float:
    """A dimension's own algorithm over `count` of its NPUs (see the module's table)."""
    if dim.topology.startswith("torus") and count == dim.npus:
        return _torus_time(kind, size, dim)
    n = count
    algo = algorithm(dim)
    if kind is Collective.BROADCAST:
        if algo in ("tree", "halving_doubling"):
            return size / dim.bandwidth + _log2(n) * dim.latency
        return size / dim.bandwidth + (1 if algo == "direct" else n - 1) * dim.latency
    phases = 2 if kind is Collective.ALL_REDUCE else 1
    if algo == "tree" and kind is Collective.ALL_REDUCE:
        return 2 * (size / dim.bandwidth + _log2(n) * dim.latency)
    hops = {"direct": 1, "halving_doubling": _log2(n)}.get(algo, n - 1)
    if kind is Collective.ALL_TO_ALL and algo == "halving_doubling":
        hops = n - 1
    return phases * ((n - 1) / n * size / dim.bandwidth + hops * dim.latency)


def _torus_time(kind: Collective, size: float, dim: NetworkDim) -> float:
    """A ring along each axis of the torus in turn, shrinking the buffer like nested dimensions do."""
    total = 0.0
    for side in torus_shape(dim):
        if side == 1:
            continue
        if kind is Collective.BROADCAST:
            total += size / dim.bandwidth + (side - 1) * dim.latency
            continue
        phases = 2 if kind is Collective.ALL_REDUCE else 1
        total += phases * ((side - 1) / side * size / dim.bandwidth + (side - 1) * dim.latency)
        if kind in _SHARDING:
            size /= side
    return total


def collective_time(kind: str, size: float, span: Span, node: MeasuredCollectives | None = None) -> float:
    """Seconds of a collective of `size` bytes (nccl-tests convention) over a group with this span (see the
    module's docstring). An empty span (a group of one) costs nothing. node: the measured tables of the first
    dimension's node, given for a group within it (`within_node`); None: the model prices the group."""
    collective = Collective(kind)
    if len(span) > 1:
        return _across(collective, size, span)
    if node is not None and span and (measured := node.seconds(collective, span[0][1], size)) is not None:
        return _on_this_link(measured, collective, size, *span[0], node.bandwidth_GBps)
    return sum(sum(_dim_parts(collective, size, dim, count)) for dim, count in span)


def within_node(node: MeasuredCollectives | None, dims: tuple[int, ...]) -> MeasuredCollectives | None:
    """The node's tables for a group spanning these dimensions: only a group within the first one is in one node."""
    return node if dims == (0,) else None


def exchange_time(
    tables: MeasuredExchange, exchange: ExpertExchange, op: str, size: float, span: Span, dims: tuple[int, ...]
) -> float | None:
    """Seconds of a serving step's MoE all-to-all `op` of `size` bytes over a group with this span, occupying
    these dimensions, from the DeepEP tables; None where they do not price it (a group of other than 8 GPUs per
    node, or not on the first two dimensions; a shape, EP size or token count they lack): the model prices it."""
    if dims not in ((0,), (0, 1)) or span[0][1] != GPUS_PER_NODE:
        return None
    measured = tables.seconds(exchange, op, span[1][1] if len(span) > 1 else 1, size)
    rates = tables.rates[: len(span)]
    if measured is None or all(dim.bandwidth_GBps == rate for (dim, _), rate in zip(span, rates, strict=True)):
        return measured
    there = [
        (dim.model_copy(update={"bandwidth_GBps": rate}), count) for (dim, count), rate in zip(span, rates, strict=True)
    ]
    kind = Collective.ALL_TO_ALL
    return measured * collective_time(kind, size, span) / collective_time(kind, size, there)


def _on_this_link(measured: float, kind: Collective, size: float, dim: NetworkDim, count: int, rate: float) -> float:
    """A measured time on a first dimension whose line rate is not the measured `rate`: scaled by the model's
    times on the two (see the module's docstring)."""
    if dim.bandwidth_GBps == rate:
        return measured
    there = sum(_dim_parts(kind, size, dim.model_copy(update={"bandwidth_GBps": rate}), count))
    return measured * sum(_dim_parts(kind, size, dim, count)) / there if there > 0 else measured


def _across(kind: Collective, size: float, span: Span) -> float:
    """A group over several dimensions: all of them at once, bound by the slowest crossing, latencies added."""
    group = prod(count for _, count in span)
    members = 1
    slowest = 0.0
    latency = 0.0
    for dim, count in span:
        alone, seconds = _dim_parts(kind, size, dim, count)
        if kind is Collective.ALL_TO_ALL:
            crossing = seconds * count * members / group
        else:
            crossing = seconds * bus_factor(kind, group) / bus_factor(kind, count) / members
        slowest = max(slowest, crossing)
        latency += alone
        members *= count
    return slowest + latency


def p2p_dim(src: int, dst: int, network: Sequence[NetworkDim]) -> int | None:
    """Index of the dimension a send from src to dst crosses: the outermost one where their coordinates differ."""
    hop = None
    inner = 1
    for index, dim in enumerate(network):
        if (src // inner) % dim.npus != (dst // inner) % dim.npus:
            hop = index
        inner *= dim.npus
    return hop


def p2p_time(size: float, src: int, dst: int, network: Sequence[NetworkDim]) -> float:
    """Seconds of a send of `size` bytes: the outermost dimension where the two ranks differ carries it."""
    hop = None
    inner = 1
    for dim in network:
        if (src // inner) % dim.npus != (dst // inner) % dim.npus:
            hop = dim
        inner *= dim.npus
    return 0.0 if hop is None else size / hop.bandwidth + hop.latency
