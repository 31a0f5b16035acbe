"""Today's fabrics as the closed forms of simulators/analytical/network.py see them: what an oversubscribed
fat-tree, a PCIe tree, a dragonfly, DGX-1's hybrid cube-mesh and rail-optimised NICs change in one dimension's time.

**Leaves under a taper** (a switch with `leaf_npus` and `oversubscription` r: leaf switches under an oversubscribed
spine, or GPUs under PCIe switches whose uplinks share the host's root complex). A leaf holds `leaf_npus` positions
of the dimension, in order; its uplinks carry leaf_npus B / r. The rule assumes what a training step does: every NPU
under the leaf runs a collective like this one at the same time (the data-parallel groups of every tensor-parallel
rank), so a share x of each NPU's traffic leaving the leaf needs x r of the line rate from the uplinks, and the
collective's bandwidth term is multiplied by max(1, x r). With m members of the group under each leaf it touches
(its fewest) and c members in all:

    rings (all-reduce, reduce-scatter, all-gather, broadcast; in-network reduction, which reduces at the leaf):
        x = 1/m: each of NCCL's rings enters and leaves a leaf once per m members
    all-to-all: x = (c - m)/(c - 1): the share of its peers outside its leaf
    a group under one leaf (m = c): x = 0

So a ring across leaves slows only where fewer than r members share a leaf, while an all-to-all pays nearly the
full ratio: an 8-GPU PCIe Gen5 node of two 4-GPU switches (r = 4) runs its rings at the line rate and its
all-to-all at 7/16 of it.

**Dragonfly** (`group_npus` positions per group, routers all-to-all inside; `global_bandwidth_GBps` G out of each
group, spread evenly over the g - 1 others). Inside a group it is a switch. Across groups it is the taper above with
the group as the leaf and two ratios: an all-to-all spreads over every global link, r = group_npus B / G; a ring
sends all of a group's crossing traffic to the next group, over the direct links of that pair, G / (g - 1), or, with
adaptive (UGAL) routing, also over two-hop paths through the other groups, which use two global links each: the
ring's share is the better of the two, r = group_npus B / max(G / (g - 1), G / 2). The dimension's latency_ns is a
minimal path's (local, global, local hops), charged per algorithm step.

**Hybrid cube-mesh** (DGX-1: eight V100s, six NVLinks each, `CUBE_MESH_LINKS`). NCCL builds its rings over the
NVLinks between the group's GPUs, one ring per direction of a link; a group gets as many rings as its least
connected member has links to the others (the whole node: 6, three bidirectional rings, as NVIDIA's DGX-1 paper
describes it; the groups of strided parallel axes reach that bound: checked by hand for the halves, the even and
odd GPUs and every pair). It runs as a ring at bandwidth_GBps x links / 6 (bandwidth_GBps is a GPU's six links
together). A pair joined by no NVLink (0 and 5) would go through the host; the parallel axes' groups never are.

**Rails** (`rails` on a scale-out switch: each NPU's NIC on the rail switch of its local rank). NCCL's rings and
trees enter and leave each node on the same rail, so they run as on any switch. An all-to-all (and a send) between
different local ranks takes NCCL's PXN path: over the scale-up dimension to the GPU of the peer's local rank in its
own node, then along that rail (network.py adds that share to the scale-up dimension's load).
"""

from collections.abc import Iterable

from dse.network import NetworkDim
from dse.workload import Collective

CUBE_MESH_LINKS = (
    (0, 1, 1, 2, 2, 0, 0, 0),
    (1, 0, 2, 1, 0, 2, 0, 0),
    (1, 2, 0, 2, 0, 0, 1, 0),
    (2, 1, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 1, 1, 2),
    (0, 2, 0, 0, 1, 0, 2, 1),
    (0, 0, 1, 0, 1, 2, 0, 2),
    (0, 0, 0, 1, 2, 1, 2, 0),
)
"""NVLinks between DGX-1 (V100) GPUs i and j (nvidia-smi topo -m: NV1, NV2): two fully connected quads whose
corners are joined across, six links per GPU (NVIDIA, "DGX-1 with Tesla V100 System Architecture", 2017)."""
LINKS_PER_GPU = 6


class PlacedDim(NetworkDim):
    """A tapered dimension (leaves or dragonfly groups) as one group sits on it: `group_span` gives it for a group
    whose members per leaf or group are not what a compact group of its count has."""

    per_block: int
    """The group's members under each leaf (or in each dragonfly group) it touches: the fewest."""


def placed(dim: NetworkDim, coordinates: Iterable[int]) -> NetworkDim:
    """The dimension as a group at these coordinates of it sees it: a cube-mesh as the ring NCCL gets over the
    group's links, a tapered dimension with the group's members per block; any other as it is."""
    coordinates = sorted(set(coordinates))
    if dim.topology == "hybrid_cube_mesh":
        return cube_mesh_ring(dim, coordinates)
    block = _block(dim)
    if block is None:
        return dim
    counts: dict[int, int] = {}
    for position in coordinates:
        counts[position // block] = counts.get(position // block, 0) + 1
    fewest = min(counts.values())
    if fewest == min(len(coordinates), block):
        return dim
    return PlacedDim.model_construct(**dict(dim), per_block=fewest)


def cube_mesh_ring(dim: NetworkDim, coordinates: list[int]) -> NetworkDim:
    """NCCL's rings over the cube-mesh GPUs at these coordinates, as one ring dimension (module docstring)."""
    links = min(sum(CUBE_MESH_LINKS[i][j] for j in coordinates) for i in coordinates) if len(coordinates) > 1 else 0
    share = max(links, 1) / LINKS_PER_GPU
    return dim.model_copy(update={"topology": "ring", "bandwidth_GBps": dim.bandwidth_GBps * share})


def _block(dim: NetworkDim) -> int | None:
    """Positions per leaf or dragonfly group; None for a dimension without a taper."""
    if dim.topology == "dragonfly":
        return dim.group_npus
    return dim.leaf_npus


def taper(kind: Collective, dim: NetworkDim, count: int) -> float:
    """What a tapered dimension multiplies a collective's bandwidth term by for a group of `count` of its
    positions (compact unless `placed` said otherwise): max(1, x r), module docstring."""
    block = _block(dim)
    if block is None or count < 2:
        return 1.0
    members = dim.per_block if isinstance(dim, PlacedDim) else min(count, block)
    if members >= count:
        return 1.0
    crossing = (count - members) / (count - 1) if kind is Collective.ALL_TO_ALL else 1 / members
    return max(1.0, crossing * _ratio(kind, dim, block))


def _ratio(kind: Collective, dim: NetworkDim, block: int) -> float:
    """The taper's ratio r for the collective: the oversubscription, or a dragonfly's group over its global links."""
    if dim.topology != "dragonfly":
        assert dim.oversubscription is not None
        return dim.oversubscription
    assert dim.global_bandwidth_GBps is not None
    reach = dim.global_bandwidth_GBps
    if kind is not Collective.ALL_TO_ALL:
        groups = -(-dim.npus // block)
        reach = max(reach / max(groups - 1, 1), reach / 2)
    return block * dim.bandwidth_GBps / reach


def pxn_share(members: int, inner: int) -> float:
    """Share of an all-to-all's buffer a member sends over the scale-up dimension on its way to other rails (NCCL's
    PXN): of the `members - inner` peers in other nodes, those of another local rank, (inner - 1)/inner of them."""
    return (members - inner) * (inner - 1) / inner / members
