"""Communication seconds on many networks at once: network.py's closed forms with each dimension's line rate,
efficiency and latency as arrays (one entry per network), in the same float operations in the same order, so each
entry is the float network.py gives that network (`tests/test_batch_network.py` checks it on random systems).

Networks are priced together when they differ only in those figures (`structure`); the rest (topology, algorithm,
counts, collectives, in-network reduction, leaves; the NCCL and DeepEP tables) decides which formula runs and is
read from one of them. A fabric whose shape depends on a rate (a dragonfly's taper, a cube-mesh's rings) is left to
the scalar code (`vectorizable`).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from math import prod

import numpy as np

from dse.network import NetworkDim
from dse.tables.deepep import GPUS_PER_NODE, MeasuredExchange
from dse.tables.nccl import MeasuredCollectives
from dse.workload import Collective, ExpertExchange, bus_factor
from simulators.analytical.fabrics import pxn_share, taper
from simulators.analytical.network import _SHARDING, _log2, algorithm, torus_shape

VARYING = frozenset({"bandwidth_GBps", "latency_ns", "efficiency", "hardware"})
"""A dimension's fields that vary within a group of networks priced together (`hardware` prices no time)."""
Seconds = np.ndarray | float
"""Seconds per network of a group, or one figure for all of them."""


def structure(network: Sequence[NetworkDim]) -> tuple[str, ...]:
    """What decides the formulas a network's times run: networks with equal structures are priced together."""
    return tuple(dim.model_dump_json(exclude=set(VARYING)) for dim in network)


def vectorizable(network: Sequence[NetworkDim]) -> bool:
    """Whether the network's formulas are closed forms in its rates: a dragonfly's taper divides by its rates and a
    cube-mesh's rings change its topology, so those stay with the scalar code."""
    return not any(dim.topology in ("dragonfly", "hybrid_cube_mesh") for dim in network)


@dataclass(frozen=True, slots=True)
class Rates:
    """One dimension over a group of networks: its structure (`dim`, one network's; placed as the group sees it)
    and its line rate (GB/s), efficiency, bytes/s (`NetworkDim.bandwidth`) and latency (s) per network."""

    dim: NetworkDim
    gbps: np.ndarray
    efficiency: np.ndarray
    bandwidth: np.ndarray
    latency: np.ndarray

    @classmethod
    def of(cls, dims: Sequence[NetworkDim]) -> "Rates":
        """The dimension of each network of a group (the same one of each)."""
        return cls(
            dims[0],
            np.array([dim.bandwidth_GBps for dim in dims], dtype=float),
            np.array([dim.efficiency for dim in dims], dtype=float),
            np.array([dim.bandwidth for dim in dims]),
            np.array([dim.latency for dim in dims]),
        )

    def placed(self, dim: NetworkDim) -> "Rates":
        """These rates under the structure a group sees (`fabrics.placed`)."""
        return Rates(dim, self.gbps, self.efficiency, self.bandwidth, self.latency)

    def at_rate(self, rate: float) -> "Rates":
        """The dimension at another line rate, as `dim.model_copy(update={"bandwidth_GBps": rate})`."""
        gbps = np.full_like(self.gbps, rate)
        return Rates(self.dim, gbps, self.efficiency, rate * 1e9 * self.efficiency, self.latency)


Span = list[tuple[Rates, int]]


def _dim_parts(kind: Collective, size: float, rates: Rates, count: int) -> tuple[Seconds, Seconds]:
    """`network._dim_parts` (a cube-mesh is not vectorizable)."""
    dim = rates.dim
    slowdown = taper(kind, dim, count)
    fixed = _dim_time(kind, 0.0, rates, count)
    own = fixed + (_dim_time(kind, size, rates, count) - fixed) * slowdown
    if kind is Collective.ALL_REDUCE and dim.reduction_efficiency is not None:
        latency = 2 * rates.latency if dim.reduction_latency_ns is None else dim.reduction_latency_ns * 1e-9
        streamed = size / (rates.gbps * 1e9 * dim.reduction_efficiency) * slowdown
        take = latency + streamed <= own
        return np.where(take, latency, fixed), np.where(take, streamed, own - fixed)
    return fixed, own - fixed


def _dim_time(kind: Collective, size: float, rates: Rates, count: int) -> Seconds:
    """`network._dim_time`."""
    dim = rates.dim
    if dim.topology.startswith("torus") and count == dim.npus:
        return _torus_time(kind, size, rates)
    n = count
    algo = algorithm(dim)
    if kind is Collective.BROADCAST:
        if algo in ("tree", "halving_doubling"):
            return size / rates.bandwidth + _log2(n) * rates.latency
        return size / rates.bandwidth + (1 if algo == "direct" else n - 1) * rates.latency
    phases = 2 if kind is Collective.ALL_REDUCE else 1
    if algo == "tree" and kind is Collective.ALL_REDUCE:
        return 2 * (size / rates.bandwidth + _log2(n) * rates.latency)
    hops = {"direct": 1, "halving_doubling": _log2(n)}.get(algo, n - 1)
    if kind is Collective.ALL_TO_ALL and algo == "halving_doubling":
        hops = n - 1
    return phases * ((n - 1) / n * size / rates.bandwidth + hops * rates.latency)


def _torus_time(kind: Collective, size: float, rates: Rates) -> Seconds:
    """`network._torus_time`."""
    total: Seconds = 0.0
    for side in torus_shape(rates.dim):
        if side == 1:
            continue
        if kind is Collective.BROADCAST:
            total += size / rates.bandwidth + (side - 1) * rates.latency
            continue
        phases = 2 if kind is Collective.ALL_REDUCE else 1
        total += phases * ((side - 1) / side * size / rates.bandwidth + (side - 1) * rates.latency)
        if kind in _SHARDING:
            size /= side
    return total


def collective_time(kind: str, size: float, span: Span, node: MeasuredCollectives | None = None) -> Seconds:
    """`network.collective_time` on every network of the group."""
    collective = Collective(kind)
    if len(span) > 1:
        fixed, streamed = _phased(collective, size, span)
        return fixed + streamed
    if node is not None and span and (measured := node.seconds(collective, span[0][1], size)) is not None:
        return _on_this_link(measured, collective, size, *span[0], node.bandwidth_GBps)
    total: Seconds = 0
    for rates, count in span:
        fixed, streamed = _dim_parts(collective, size, rates, count)
        total = total + (fixed + streamed)
    return total


def exchange_time(
    tables: MeasuredExchange, exchange: ExpertExchange, op: str, size: float, span: Span, dims: tuple[int, ...]
) -> Seconds | None:
    """`network.exchange_time` on every network of the group (None for all of them, or for none)."""
    if dims not in ((0,), (0, 1)) or span[0][1] != GPUS_PER_NODE:
        return None
    measured = tables.seconds(exchange, op, span[1][1] if len(span) > 1 else 1, size)
    if measured is None:
        return None
    rates = tables.rates[: len(span)]
    same = reduce(np.logical_and, [dim.gbps == rate for (dim, _), rate in zip(span, rates, strict=True)])
    there = [(dim.at_rate(rate), count) for (dim, count), rate in zip(span, rates, strict=True)]
    kind = Collective.ALL_TO_ALL
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = measured * collective_time(kind, size, span) / collective_time(kind, size, there)
    return np.where(same, measured, scaled)


def _on_this_link(measured: float, kind: Collective, size: float, rates: Rates, count: int, rate: float) -> np.ndarray:
    """`network._on_this_link`."""
    fixed, streamed = _dim_parts(kind, size, rates.at_rate(rate), count)
    there = fixed + streamed
    fixed, streamed = _dim_parts(kind, size, rates, count)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(there > 0, measured * (fixed + streamed) / there, measured)
    return np.where(rates.gbps == rate, measured, scaled)


def _phased(kind: Collective, size: float, span: Span) -> tuple[Seconds, Seconds]:
    """`network._phased`."""
    fixed: Seconds = 0.0
    streamed: Seconds = 0.0
    for phase in _phases(kind, span):
        latency, seconds = _dim_parts(kind, size, *phase[0]) if len(phase) == 1 else _across(kind, size, phase)
        fixed += latency
        streamed = np.maximum(streamed, seconds) if phase[0][0].dim.collectives == "pipelined" else streamed + seconds
        size /= prod(count for _, count in phase)
    return fixed, streamed


def _phases(kind: Collective, span: Span) -> list[Span]:
    """`network._phases`."""
    if kind not in _SHARDING:
        return [span]
    phases = [span[:1]]
    for rates, count in span[1:]:
        if rates.dim.collectives == "flat":
            phases[-1].append((rates, count))
        else:
            phases.append([(rates, count)])
    return phases


def _across(kind: Collective, size: float, span: Span) -> tuple[Seconds, Seconds]:
    """`network._across`."""
    group = prod(count for _, count in span)
    members = 1
    slowest: Seconds = 0.0
    latency: Seconds = 0.0
    relayed = 0.0
    for rates, count in span:
        alone, seconds = _dim_parts(kind, size, rates, count)
        if kind is Collective.ALL_TO_ALL:
            crossing = seconds * count * members / group
            if rates.dim.rails and members > 1:
                relayed = max(relayed, pxn_share(group, members))
        else:
            crossing = seconds * bus_factor(kind, group) / bus_factor(kind, count) / members
        slowest = np.maximum(slowest, crossing)
        latency += alone
        members *= count
    if relayed:
        inner, count = span[0]
        _, seconds = _dim_parts(kind, size, inner, count)
        own = seconds * count / group
        slowest = np.maximum(slowest, own + seconds * count / (count - 1) * relayed)
    return latency, slowest


def crossed(src: int, dst: int, network: Sequence[NetworkDim]) -> tuple[int, ...]:
    """Indices of the dimensions where two ranks' coordinates differ (`network.p2p_time`'s hops)."""
    hops = []
    inner = 1
    for index, dim in enumerate(network):
        if (src // inner) % dim.npus != (dst // inner) % dim.npus:
            hops.append(index)
        inner *= dim.npus
    return tuple(hops)


def p2p_time(size: float, hops: tuple[int, ...], rates: Sequence[Rates]) -> Seconds:
    """`network.p2p_time` of a send crossing these dimensions (`crossed`), on every network of the group."""
    if not hops:
        return 0.0
    hop = rates[hops[-1]]
    if hop.dim.rails and len(hops) > 1:
        relay = rates[hops[0]]
        return size / np.minimum(hop.bandwidth, relay.bandwidth) + hop.latency + relay.latency
    return size / hop.bandwidth + hop.latency
