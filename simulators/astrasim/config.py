"""ASTRA-sim's configuration files for a system: network.yml, system.json and the remote-memory file.

Our network dimensions map onto ASTRA-sim's so that its collectives reproduce the analytical model's closed forms
(simulators/analytical/network.py) with `preferred-dataset-splits` and `active-chunks-per-dimension` at 1:

- bandwidth: ASTRA-sim's GB/s are 2^30 B/s; ours (`NetworkDim.bandwidth`) already include the efficiency. Ours is
  what one NPU sends into the dimension; ASTRA-sim's is per link, and a fully connected dimension gives each NPU
  n-1 links, so each gets 1/(n-1) of it (a direct algorithm then takes (n-1)/n S/B per phase, as the closed form).
- latency: ASTRA-sim charges it per hop. The closed forms charge a dimension's `latency_ns` once per algorithm step
  (a ring's n-1 steps, direct's one); a step is one hop between ring neighbours or across a fully connected
  dimension and two through a switch (NPU -> switch -> NPU), so a switch gets half the latency per hop.
- a torus dimension becomes one Ring dimension per side of its `torus_shape`, innermost first, each at the
  dimension's bandwidth and latency: the closed form runs a ring along each axis in turn, as ASTRA-sim runs a
  group over several dimensions one after another. `expanded_sizes` gives the NPU counts the Chakra export must use.
- collective implementation per dimension from its algorithm (`network.algorithm`: auto is direct on a fully
  connected dimension, ring elsewhere): ring, direct, halvingDoubling, and tree as ASTRA-sim's doubleBinaryTree
  for all-reduce. The closed forms run a tree dimension's other collectives as a ring, and a halving-doubling
  dimension's all-to-all as a ring's n-1 steps (ASTRA-sim's halvingDoubling has no all-to-all), so those go to
  ASTRA-sim's ring.

Where the two disagree by design (measured at n = 8 with one chunk): ASTRA-sim relays a ring all-to-all around the
ring, (n-1)/2 times the injection bound the closed form charges; the congestion-unaware backend sends a direct
algorithm's n-1 messages through a switch at once, each at the NPU's full bandwidth (n-1 times faster than its link
allows); its halvingDoubling on a Ring topology pays one hop per ring position between partners; its
doubleBinaryTree all-reduce is not pipelined (4 S/B against 2 S/B). The congestion-aware backend stores and
forwards a message at the switch, so every collective through a Switch dimension takes twice the bandwidth term.
Ring, switch (ring or halving-doubling) and fully connected (direct) all-reduce, reduce-scatter and all-gather
agree within 0.2% on the unaware backend (all-gather once the export writes its input shard as comm_size),
all-to-all too on a fully connected dimension. Across dimensions: a group of the whole world runs dimension after
dimension, reduce-scatter inward and all-gather outward, which is the closed form of `collectives: hierarchical` on
every outer dimension: all-reduce, reduce-scatter and all-gather agree within 0.1% from 4 KiB to 64 MiB on a ring of
4 x switch of 4, a switch of 8 x switch of 4 and three switches of 2 (tests/test_collectives_hierarchical.py); the
default flat form (every dimension at once) is 37% faster at 64 MiB on the first. A smaller group over two
dimensions runs as one ring at the inner dimension's bandwidth (-50%); a send whose ends differ in several
dimensions goes at the innermost one's bandwidth (-75%; a pipeline send across nodes differs in one and agrees).
`collectives: pipelined` (NCCL's overlapped phases) and a switch's in-network reduction (`reduction_efficiency`:
NVLS, InfiniBand SHARP) have no counterpart: ASTRA-sim runs one chunk's phases in turn, and its NPUs reduce.

Today's fabrics (simulators/analytical/fabrics.py), where ASTRA-sim's analytical backend can express them:
- a hybrid cube-mesh becomes one Ring of its 8 GPUs at bandwidth_GBps, the rings NCCL runs over the whole node
  (a smaller group's fewer links are the closed form's alone: ASTRA-sim runs it as a ring at that rate);
- rails become a plain Switch: ASTRA-sim sends cross-rail traffic straight, without PXN's scale-up hop;
- leaves under an oversubscribed spine or root complex (`oversubscription`) and a dragonfly have no counterpart (its
  Switch is non-blocking, it has no global links): astra_dims refuses them in one line naming the field.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from dse.system import NetworkDim, SystemSpec
from simulators.analytical.network import algorithm, torus_shape
from simulators.astrasim.options import AstraSimOptions
from simulators.astrasim.runner import AstraSimError

ASTRA_GB = 2**30
"""Bytes per second in one of ASTRA-sim's GB/s."""
TOPOLOGY = {"ring": "Ring", "switch": "Switch", "fully_connected": "FullyConnected"}
HOPS_PER_STEP = {"Ring": 1, "Switch": 2, "FullyConnected": 1}
IMPLEMENTATION = {"ring": "ring", "direct": "direct", "halving_doubling": "halvingDoubling", "tree": "doubleBinaryTree"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
RUN_AS_RING = {
    ("tree", "all-gather"),
    ("tree", "reduce-scatter"),
    ("tree", "all-to-all"),
    ("halving_doubling", "all-to-all"),
}
"""(algorithm, collective) pairs the closed forms price as a ring (see the module docstring)."""
NO_REDUCTION_COST_GBPS = 1e9
"""local-mem-bw when compute comes from our model: ASTRA-sim also prices a collective's local reductions at it,
which the closed forms leave out, so it is set high enough to cost nothing."""


@dataclass(frozen=True)
class AstraDim:
    """One ASTRA-sim network dimension."""

    topology: str
    npus: int
    bandwidth_GBps: float
    """ASTRA-sim GB/s (2^30 B/s)."""
    latency_ns: float
    """Per hop."""
    algorithm: str
    """Ours (network.algorithm's names)."""

    def implementation(self, collective: str) -> str:
        """ASTRA-sim's name of the collective's algorithm on this dimension."""
        return "ring" if (self.algorithm, collective) in RUN_AS_RING else IMPLEMENTATION[self.algorithm]


def astra_dims(system: SystemSpec) -> list[AstraDim]:
    """The system's network as ASTRA-sim dimensions, innermost first (a torus expanded into its rings), without
    dimensions of one NPU (a single node's `network: {1: {npus: 1}}`), which ASTRA-sim refuses and nothing crosses;
    AstraSimError for a fabric it cannot express (module docstring)."""
    return [part for index, dim in enumerate(system.network) for part in _dims_of(dim, index)]


def _dims_of(dim: NetworkDim, index: int) -> list[AstraDim]:
    if dim.npus == 1:
        return []
    if dim.oversubscription is not None or dim.topology == "dragonfly":
        field = "topology: dragonfly" if dim.topology == "dragonfly" else "oversubscription"
        raise AstraSimError(
            f"system.network.{index}.{field}: ASTRA-sim's analytical backend has no tapered fabric (its switches are "
            "non-blocking); use the analytical cost model, or a plain switch"
        )
    bandwidth = dim.bandwidth / ASTRA_GB
    if dim.topology == "hybrid_cube_mesh":
        return [AstraDim("Ring", dim.npus, bandwidth, dim.latency_ns, algorithm(dim))]
    if dim.topology.startswith("torus"):
        return [AstraDim("Ring", side, bandwidth, dim.latency_ns, "ring") for side in torus_shape(dim) if side > 1]
    topology = TOPOLOGY[dim.topology]
    if topology == "FullyConnected":
        bandwidth /= max(1, dim.npus - 1)
    per_hop = dim.latency_ns / HOPS_PER_STEP[topology]
    return [AstraDim(topology, dim.npus, bandwidth, per_hop, algorithm(dim))]


def expanded_sizes(system: SystemSpec) -> list[int]:
    """NPUs per ASTRA-sim dimension: what the Chakra export's `network` must be for its involved_dim to match."""
    return [d.npus for d in astra_dims(system)]


def network_yaml(dims: list[AstraDim]) -> str:
    """network.yml (flow-style lists, which ASTRA-sim's yaml-cpp reads)."""

    def row(values: list) -> str:
        return "[ " + ", ".join(str(v) for v in values) + " ]"

    return (
        f"topology: {row([d.topology for d in dims])}\n"
        f"npus_count: {row([d.npus for d in dims])}\n"
        f"bandwidth: {row([repr(d.bandwidth_GBps) for d in dims])}\n"
        f"latency: {row([repr(d.latency_ns) for d in dims])}\n"
    )


def system_json(
    dims: list[AstraDim], system: SystemSpec, dtype: str, options: AstraSimOptions, trace: bool = False
) -> dict:
    """system.json: collective implementations, chunking, scheduling and how compute is priced; with trace, ASTRA-sim
    logs every node's issue and completion (timeline.py)."""
    config: dict = {
        "scheduling-policy": options.scheduling_policy,
        "endpoint-delay": 1,  # 0 is refused (README); 1 ns per message is below every latency we model
        "active-chunks-per-dimension": options.active_chunks_per_dimension,
        "preferred-dataset-splits": options.preferred_dataset_splits,
        **{f"{kind}-implementation": [d.implementation(kind) for d in dims] for kind in COLLECTIVES},
        "collective-optimization": "localBWAware",
        "boost-mode": 0,
    }
    accelerator = system.accelerator
    if options.compute == "roofline":
        efficiency = accelerator.compute_efficiency.get("gemm", 1.0)
        config["peak-perf"] = accelerator.peak_flops(dtype) * efficiency * accelerator.clock_share / 1e12
        config["local-mem-bw"] = accelerator.hbm_bandwidth * accelerator.memory_efficiency / 1e9
        config["roofline-enabled"] = 1
    else:
        config["local-mem-bw"] = NO_REDUCTION_COST_GBPS
        config["roofline-enabled"] = 0
    if trace:
        config["trace-enabled"] = 1
    return config


REMOTE_MEMORY = {"memory-type": "NO_MEMORY_EXPANSION"}


def write_configs(folder: Path, system: SystemSpec, dtype: str, options: AstraSimOptions, trace: bool) -> None:
    """network.yml, system.json and remote_memory.json into the run folder."""
    dims = astra_dims(system)
    (folder / "network.yml").write_text(network_yaml(dims))
    config = system_json(dims, system, dtype, options, trace)
    (folder / "system.json").write_text(json.dumps(config, indent=1) + "\n")
    (folder / "remote_memory.json").write_text(json.dumps(REMOTE_MEMORY) + "\n")
