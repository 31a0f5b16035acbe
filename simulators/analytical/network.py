"""Collective and point-to-point times on the hierarchical network, innermost dimension first.

Rank r sits at NPU r, so its coordinate in dimension i is (r // P_i) % npus_i with P_i the NPUs of the inner
dimensions. A ring or a switch dimension runs the ring algorithm (NCCL builds rings over NVSwitch and IB
switches too); a fully connected one runs the direct algorithm, which pays the bandwidth term of the ring but
only one latency per phase. A group that spans several dimensions runs hierarchically, as ASTRA-sim and NCCL
do: it reduce-scatters from the innermost dimension outward and all-gathers back, so each outer dimension only
carries the shard the inner ones left. Bandwidths already include the dimension's efficiency, so the times are
what nccl-tests would measure for the same buffer sizes.
"""

from collections.abc import Sequence

from dse.spec import NetworkDim
from dse.workload import Collective

Span = list[tuple[NetworkDim, int]]
"""The dimensions a process group spans (those where it has more than one coordinate) and that count."""

_SHARDING = frozenset({Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER})
"""Collectives whose outer dimensions only carry what the inner ones left: 1/c of it per spanned dim."""


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


def _dim_time(kind: Collective, size: float, dim: NetworkDim, count: int) -> float:
    """One dimension's share: the ring's (c-1)/c of the buffer per NPU, twice for an all-reduce (RS + AG)."""
    steps = count - 1
    volume = size if kind is Collective.BROADCAST else steps / count * size
    hops = 1 if dim.topology == "fully_connected" else steps
    phases = 2 if kind is Collective.ALL_REDUCE else 1
    return phases * (volume / dim.bandwidth + hops * dim.latency)


def collective_time(kind: str, size: float, span: Span) -> float:
    """Seconds of a collective of `size` bytes (nccl-tests convention) over a group with this span.

    An empty span (a group of one) costs nothing. All-to-all and broadcast move the whole buffer on every
    dimension; the others shrink it by each dimension's count on the way out.
    """
    collective = Collective(kind)
    total = 0.0
    for dim, count in span:
        total += _dim_time(collective, size, dim, count)
        if collective in _SHARDING:
            size /= count
    return total


def p2p_time(size: float, src: int, dst: int, network: Sequence[NetworkDim]) -> float:
    """Seconds of a send of `size` bytes: the outermost dimension where the two ranks differ carries it."""
    hop = None
    inner = 1
    for dim in network:
        if (src // inner) % dim.npus != (dst // inner) % dim.npus:
            hop = dim
        inner *= dim.npus
    return 0.0 if hop is None else size / hop.bandwidth + hop.latency
