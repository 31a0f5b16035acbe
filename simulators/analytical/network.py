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

Today's fabrics (simulators/analytical/fabrics.py) change one dimension's row: leaves under an oversubscribed spine
or a PCIe root complex, and a dragonfly's global links, multiply its buffer term by a taper max(1, x r) (x the share
of traffic leaving a leaf or group, r the ratio); DGX-1's hybrid cube-mesh runs as the rings its NVLinks give the
group; rail-optimised NICs send an all-to-all's cross-rail share over the scale-up dimension first (PXN).

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
sender's block of it, (c_d - 1) M_d / N of the buffer, at b_d. This flat form is the default: it puts two nodes of
eight A100s with 4x200G InfiniBand at 90 GB/s bus bandwidth where nccl-tests measures 86, and DGX H100 nodes at
~370 GB/s, what their NVLink rings and eight 400G NICs (~376 GB/s) carry, which bounds NCCL's rings there.

**Hierarchical and pipelined** (`collectives` on an outer dimension). An all-reduce, reduce-scatter or all-gather
over a group whose span includes a dimension past its first marked `hierarchical` or `pipelined` runs in phases:
the span is cut before each such dimension, each phase (one dimension, or several priced flat as above) runs the
collective on the shard the phases inside it leave, S_k = S / P_k with P_k the members of the inner phases. With
L_k and X_k(S_k) a phase's fixed and buffer terms (its row above; a phase of several dimensions: the flat form's
latencies and slowest crossing):

    hierarchical:   sum_k L_k + sum_k X_k(S / P_k)        (one phase after another)
    pipelined:      sum_k L_k + max_k X_k(S / P_k)        (chunks overlap the phases)

A reduce-scatter runs its phases inward and an all-gather outward, which gives the same sum. An all-reduce is a
reduce-scatter inward, the outermost phase's all-reduce, then an all-gather outward; an inner phase's reduce-scatter
and all-gather together are its all-reduce row (a ring's exactly; through a switch that reduces in the network,
NVLS's reduce-scatter by ld_reduce and all-gather by multicast, which is how NCCL runs NVLS inside a node with IB
SHARP (CollNet) across nodes), so each phase k costs its all-reduce row on S / P_k. E.g. two dimensions of c_0
and c_1 rings: 2(c_0-1)/c_0 S/B_0 + 2(c_1-1)/c_1 S/(c_0 B_1) + 2(c_0-1) a_0 + 2(c_1-1) a_1. Hierarchical is
what ASTRA-sim runs for a group of the whole network (dimension after dimension, one chunk), and a 2D
hierarchical all-reduce; pipelined is NCCL's CollNet and NVLS+SHARP, whose chunks flow through the node's
reduction, the network's and the node's broadcast at once. In-network reduction on the outer dimension (IB SHARP)
then carries each NPU's shard S / P once each way, S/(P e B) + L, instead of a ring's 2(c-1)/c of it: a win from
a few nodes up. A broadcast and an all-to-all have no shard to hand on and stay flat.

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
from simulators.analytical.fabrics import cube_mesh_ring, placed, pxn_share, taper

Span = list[tuple[NetworkDim, int]]
"""The dimensions a process group spans (those where it has more than one coordinate) and that count."""

_SHARDING = frozenset({Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER})
"""Collectives that reduce or gather shards, which a torus runs axis by axis on a shrinking buffer."""


def group_span(ranks: Sequence[int], network: Sequence[NetworkDim]) -> Span:
    """Per dimension, how many distinct coordinates the members have; dimensions it stays inside drop out. A
    dimension whose time depends on where the members sit (a cube-mesh, leaves, dragonfly groups) comes as the
    group sees it (fabrics.placed)."""
    span: Span = []
    inner = 1
    for dim in network:
        coordinates = {(rank // inner) % dim.npus for rank in ranks}
        if len(coordinates) > 1:
            span.append((placed(dim, coordinates), len(coordinates)))
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
    algorithm is faster at this size, as NCCL's tuner picks NVLS only where it wins (its fixed cost is larger); a
    cube-mesh as its rings, a tapered dimension's buffer term slowed by its taper (fabrics.py)."""
    if dim.topology == "hybrid_cube_mesh":
        dim = cube_mesh_ring(dim, list(range(count)))
    slowdown = taper(kind, dim, count)
    fixed = _dim_time(kind, 0.0, dim, count)
    own = fixed + (_dim_time(kind, size, dim, count) - fixed) * slowdown
    if kind is Collective.ALL_REDUCE and dim.reduction_efficiency is not None:
        latency = 2 * dim.latency if dim.reduction_latency_ns is None else dim.reduction_latency_ns * 1e-9
        streamed = size / (dim.bandwidth_GBps * 1e9 * dim.reduction_efficiency) * slowdown
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
        return sum(_phased(collective, size, span))
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


def _phased(kind: Collective, size: float, span: Span) -> tuple[float, float]:
    """A group over several dimensions as (fixed seconds, seconds of the buffer): its phases (`_phases`) one after
    another, or overlapped where the outer one says pipelined, each phase on the shard the ones inside it left."""
    fixed = streamed = 0.0
    for phase in _phases(kind, span):
        latency, seconds = _dim_parts(kind, size, *phase[0]) if len(phase) == 1 else _across(kind, size, phase)
        fixed += latency
        streamed = max(streamed, seconds) if phase[0][0].collectives == "pipelined" else streamed + seconds
        size /= prod(count for _, count in phase)
    return fixed, streamed


def _phases(kind: Collective, span: Span) -> list[Span]:
    """The span cut before every dimension past its first that is not flat, for the collectives that shard (a
    broadcast and an all-to-all have no shard to hand on: one flat phase)."""
    if kind not in _SHARDING:
        return [span]
    phases = [span[:1]]
    for dim, count in span[1:]:
        if dim.collectives == "flat":
            phases[-1].append((dim, count))
        else:
            phases.append([(dim, count)])
    return phases


def _across(kind: Collective, size: float, span: Span) -> tuple[float, float]:
    """A group over several dimensions flat, all of them at once, as (latencies added, the slowest crossing)."""
    group = prod(count for _, count in span)
    members = 1
    slowest = 0.0
    latency = 0.0
    relayed = 0.0
    for dim, count in span:
        alone, seconds = _dim_parts(kind, size, dim, count)
        if kind is Collective.ALL_TO_ALL:
            crossing = seconds * count * members / group
            if dim.rails and members > 1:
                relayed = max(relayed, pxn_share(group, members))
        else:
            crossing = seconds * bus_factor(kind, group) / bus_factor(kind, count) / members
        slowest = max(slowest, crossing)
        latency += alone
        members *= count
    if relayed:
        inner, count = span[0]
        _, seconds = _dim_parts(kind, size, inner, count)
        own = seconds * count / group
        slowest = max(slowest, own + seconds * count / (count - 1) * relayed)
    return latency, slowest


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
    """Seconds of a send of `size` bytes: the outermost dimension where the two ranks differ carries it; across
    rails between different local ranks, the innermost dimension where those differ relays it first (PXN), its
    latency added and the slower of the two links bounding the stream."""
    hops = []
    inner = 1
    for dim in network:
        if (src // inner) % dim.npus != (dst // inner) % dim.npus:
            hops.append(dim)
        inner *= dim.npus
    if not hops:
        return 0.0
    hop = hops[-1]
    if hop.rails and len(hops) > 1:
        relay = hops[0]
        return size / min(hop.bandwidth, relay.bandwidth) + hop.latency + relay.latency
    return size / hop.bandwidth + hop.latency
