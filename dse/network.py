"""One level of a system's hierarchical network (`NetworkDim`), the same shape as an ASTRA-sim network dimension:
its topology, size, line rate, latency and collective algorithm, and the hardware that builds it.

Beyond ASTRA-sim's rings, switches and fully connected dimensions (and tori, as rings), a dimension can be built as
today's fabrics are (simulators/analytical/fabrics.py prices them):
- a switch of leaves under an oversubscribed spine, or GPUs under PCIe switches sharing their host's root complex
  (`leaf_npus`, `oversubscription`);
- a dragonfly: groups of routers wired all-to-all inside, with global links between groups (`group_npus`,
  `global_bandwidth_GBps`);
- DGX-1's hybrid cube-mesh of NVLinks, which NCCL runs as the rings its links allow;
- rail-optimised scale-out (`rails`): each NPU's NIC on the rail switch of its local rank.

A group over several dimensions runs its collectives flat (NCCL's rings through all of them at once) unless an
outer dimension it spans says `collectives: hierarchical` or `pipelined` (simulators/analytical/network.py has the
closed forms); in-network reduction (`reduction_efficiency`: NVLink SHARP, InfiniBand SHARP) takes part in either.
"""

from math import prod
from typing import Annotated, Literal

from annotated_types import Ge, Le
from pydantic import Field, model_validator

from dse.economics import LinkHardware
from dse.fields import Degree, Latency, Rate, Share, Spec, left_out_at_default

CUBE_MESH_NPUS = 8
"""DGX-1's hybrid cube-mesh joins eight GPUs."""


class NetworkDim(Spec):
    """One level of the hierarchical network, the same shape as an ASTRA-sim network dimension.

    bandwidth_GBps is what one NPU can send into this dimension in one direction; efficiency scales it to what a
    collective achieves (the nccl-tests bus bandwidth over the line rate).
    """

    topology: Literal["ring", "switch", "fully_connected", "torus2d", "torus3d", "dragonfly", "hybrid_cube_mesh"]
    npus: Degree
    bandwidth_GBps: Rate
    latency_ns: Latency
    efficiency: Share = 1.0
    algorithm: Literal["auto", "ring", "direct", "halving_doubling", "tree"] = Field(
        "auto", description="collective algorithm; auto: direct on fully_connected, ring elsewhere"
    )
    shape: list[Degree] | None = Field(
        None,
        max_length=3,
        description="torus side lengths (product = npus); default: as square or cubic as npus allows",
    )
    collectives: Literal["flat", "hierarchical", "pipelined"] = left_out_at_default(
        "flat",
        description="how an all-reduce, reduce-scatter or all-gather over this dimension and ones inside it crosses "
        "this one: flat: NCCL's rings through every dimension at once; hierarchical: reduce-scatter inside first, "
        "this dimension's collective on the shard, all-gather back, one phase after another (ASTRA-sim's, a 2D "
        "hierarchical all-reduce); pipelined: those phases overlapped chunk by chunk, the slowest bounding the time "
        "(NCCL's CollNet and NVLS with InfiniBand SHARP); no effect on the first dimension",
    )
    reduction_efficiency: Share | None = left_out_at_default(
        None,
        description="a switch that reduces in the network (NVLink SHARP, InfiniBand SHARP): an all-reduce crosses "
        "each NPU's link once each way, at this share of the line rate; unset: the NPUs reduce",
    )
    reduction_latency_ns: Latency | None = left_out_at_default(
        None,
        description="fixed cost of an all-reduce through the switch (NCCL's NVLS); an all-reduce runs the faster "
        "of that and the NPUs' own algorithm at its size; unset: twice latency_ns",
    )

    leaf_npus: Degree | None = left_out_at_default(
        None,
        description="a switch built of leaf switches (or PCIe switches under one root complex): this dimension's "
        "positions under one leaf, in order (a leaf of 32 ports under nodes of 8 GPUs holds 4, a rail switch of 32 "
        "ports 32); with oversubscription",
    )
    oversubscription: Annotated[float, Ge(1), Le(1e6)] | None = left_out_at_default(
        None,
        description="a leaf's downlinks over its uplinks (2: 2:1): when every NPU of a leaf runs its collective, "
        "the share of its traffic that leaves the leaf goes at the line rate over this ratio; with leaf_npus",
    )
    group_npus: Degree | None = left_out_at_default(
        None,
        description="dragonfly: this dimension's positions in one group (its routers' NPUs, wired all-to-all)",
    )
    global_bandwidth_GBps: Rate | None = left_out_at_default(
        None,
        description="dragonfly: what one group's global links carry out of it in one direction, all together, "
        "spread evenly over the other groups",
    )
    rails: bool = left_out_at_default(
        False,
        description="rail-optimised scale-out: each NPU's NIC on the rail switch of its local rank (its position in "
        "the dimensions inside); traffic between different local ranks first crosses the scale-up dimension to the "
        "peer's rail (NCCL's PXN)",
    )

    hardware: LinkHardware | None = left_out_at_default(
        None, description="what this dimension's NICs, switches and cables cost and draw (cost and energy objectives)"
    )

    @model_validator(mode="after")
    def _check_shape(self) -> "NetworkDim":
        if self.shape is not None:
            if not self.topology.startswith("torus"):
                raise ValueError(f"shape is only for torus topologies, not '{self.topology}'; remove it")
            if len(self.shape) != int(self.topology[-2]) or prod(self.shape) != self.npus:
                raise ValueError(f"shape {self.shape} must have {self.topology[-2]} sides whose product is npus")
        if self.reduction_efficiency is not None and self.topology != "switch":
            raise ValueError(
                f"reduction_efficiency is only for a switch, which can reduce in the network, not '{self.topology}';"
                " remove it"
            )
        if self.reduction_latency_ns is not None and self.reduction_efficiency is None:
            raise ValueError("reduction_latency_ns needs reduction_efficiency (the switch's reduction); set it")
        if (message := self._fabric_error()) is not None:
            raise ValueError(message)
        return self

    def _fabric_error(self) -> str | None:
        """Why the leaf, dragonfly, cube-mesh or rail fields do not fit this dimension, or None."""
        if (self.leaf_npus is None) != (self.oversubscription is None):
            return "leaf_npus and oversubscription go together (leaves of that size under that ratio); set both"
        if self.leaf_npus is not None and self.topology != "switch":
            return f"leaf_npus and oversubscription are for a switch, not '{self.topology}'; remove them"
        dragonfly = self.topology == "dragonfly"
        if dragonfly != (self.group_npus is not None and self.global_bandwidth_GBps is not None):
            if dragonfly:
                return "a dragonfly needs group_npus and global_bandwidth_GBps (its groups and global links); set them"
            return f"group_npus and global_bandwidth_GBps are for a dragonfly, not '{self.topology}'; remove them"
        if self.topology == "hybrid_cube_mesh" and self.npus != CUBE_MESH_NPUS:
            return f"a hybrid_cube_mesh joins {CUBE_MESH_NPUS} GPUs (DGX-1), not {self.npus}; set npus: 8"
        if self.rails and self.topology != "switch":
            return f"rails is for a switch (rail switches), not '{self.topology}'; remove it"
        return self._hardware_error()

    def _hardware_error(self) -> str | None:
        """Why `hardware`'s switches do not fit this dimension (a topology of direct links has none; a leaf must
        have ports for its NPUs and its uplinks), or None."""
        ports = None if self.hardware is None else self.hardware.switch_ports
        if ports is None:
            return None
        if self.topology not in ("switch", "dragonfly"):
            return (
                f"hardware.switch_ports: a '{self.topology}' dimension has direct links and no switches; remove "
                "switch_ports (and switch_price_usd, switch_power_W)"
            )
        if self.leaf_npus is not None and self.oversubscription is not None:
            needed = self.leaf_npus * (1 + 1 / self.oversubscription)
            if needed > ports:
                return (
                    f"hardware.switch_ports: a leaf of {self.leaf_npus} NPUs at {self.oversubscription:g}:1 needs "
                    f"{needed:g} ports, more than its {ports}; lower leaf_npus or raise switch_ports"
                )
        return None

    @property
    def bandwidth(self) -> float:
        """Achievable bytes/s per NPU."""
        return self.bandwidth_GBps * 1e9 * self.efficiency

    @property
    def latency(self) -> float:
        return self.latency_ns * 1e-9
