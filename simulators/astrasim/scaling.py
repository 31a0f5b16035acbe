"""Large worlds: the same step on fewer data-parallel replicas, so that ASTRA-sim prices a 1024-GPU point in
seconds instead of many minutes (it simulates every rank; a 128-GPU Llama-3-70B step takes it ~90 s).

Data-parallel replicas run the same programs; only the collectives over the replica axis see how many there are.
The scaled world keeps d of the D replicas (the network dimension that holds the replica axis shrinks by D/d) and
gives each collective over that axis the size at which its closed-form time over d members equals its time over
D members (simulators/analytical/network.py, which ASTRA-sim reproduces on one dimension: see config.py). Every
op's compute, every other collective and every pipeline transfer stays as it was, so each rank class runs the same
schedule in the scaled world as in the full one.

The replica axis is `dp` (or, where FSDP's groups split it, `dp_rep`: the replicas of a hybrid-sharded world). It
must lie inside one network dimension that is not a torus (a group over several dimensions runs dimension after
dimension in ASTRA-sim, whose phases no single size keeps), and no point-to-point op may run over it.
"""

from dataclasses import replace

import numpy as np

from dse.system import SystemSpec
from dse.workload import Block, OpKind, RankLayout, Workload
from simulators.analytical.network import collective_time, group_span
from simulators.astrasim.runner import AstraSimError

REPLICA_AXES = ("dp_rep", "dp")
"""Axes whose members are whole replicas, outermost kind first."""


def replica_axis(layout: RankLayout) -> str | None:
    names = dict(layout.axes)
    return next((axis for axis in REPLICA_AXES if names.get(axis, 1) > 1), None)


def scaled_world(workload: Workload, system: SystemSpec, max_npus: int) -> tuple[Workload, SystemSpec]:
    """The workload and system with as few replicas as bring the world to max_npus (at least 2, so that the
    replica collectives still run); the inputs themselves when the world already fits or has no replicas."""
    layout = workload.layout
    axis = replica_axis(layout)
    if layout.world <= max_npus or axis is None:
        return workload, system
    full = layout.size(axis)
    dim = _dimension_of(layout, axis, system)
    npus = system.network[dim].npus
    fits = [d for d in range(2, full) if full % d == 0 and npus * d % full == 0]
    if not fits:
        return workload, system
    small = [d for d in fits if layout.world // full * d <= max_npus]
    replicas = max(small) if small else min(fits)
    network = list(system.network)
    network[dim] = network[dim].model_copy(update={"npus": npus * replicas // full})
    scaled_system = system.model_copy(update={"network": network})
    scaled_layout = RankLayout(tuple((name, replicas if name == axis else size) for name, size in layout.axes))
    blocks = [_resized(block, axis, layout, system, scaled_layout, scaled_system) for block in workload.blocks]
    class_of = _class_of(workload, scaled_layout)
    scaled = replace(workload, layout=scaled_layout, blocks=blocks, class_of=class_of)
    return scaled, scaled_system


def _dimension_of(layout: RankLayout, axis: str, system: SystemSpec) -> int:
    """The network dimension that holds every member of the axis's groups; AstraSimError where none does."""
    low, high = layout.stride(axis), layout.stride(axis) * layout.size(axis)
    inner = 1
    for index, dim in enumerate(system.network):
        if low % inner == 0 and (inner * dim.npus) % high == 0 and low >= inner:
            if dim.topology.startswith("torus"):
                break
            return index
        inner *= dim.npus
    raise AstraSimError(
        f"cannot scale the world down: the '{axis}' axis (ranks {low} apart, {layout.size(axis)} of them) does not "
        f"lie inside one ring, switch or fully connected dimension of system '{system.name}'; unset "
        "cost_model_options.max_npus to simulate every NPU"
    )


def _resized(
    block: Block, axis: str, layout: RankLayout, system: SystemSpec, scaled: RankLayout, scaled_system: SystemSpec
) -> Block:
    """The block with each collective over the replica axis at the size that keeps its time."""
    ops = list(block.ops)
    for index, op in enumerate(ops):
        if axis not in op.axis.split("+"):
            continue
        if op.kind is not OpKind.COLLECTIVE:
            raise AstraSimError(
                f"cannot scale the world down: block '{block.name}' sends point to point over '{op.axis}'; unset "
                "cost_model_options.max_npus to simulate every NPU"
            )
        full = collective_time(op.category, op.comm_bytes, group_span(layout.group(0, op.axis), system.network))
        span = group_span(scaled.group(0, op.axis), scaled_system.network)
        fixed = collective_time(op.category, 0.0, span)
        per_byte = (collective_time(op.category, op.comm_bytes, span) - fixed) / op.comm_bytes if op.comm_bytes else 0
        size = (full - fixed) / per_byte if per_byte else op.comm_bytes
        ops[index] = replace(op, comm_bytes=max(0.0, size))
    return replace(block, ops=tuple(ops))


def _class_of(workload: Workload, scaled: RankLayout) -> np.ndarray:
    """Each scaled rank's class: that of the full world's rank at the same coordinates."""
    full = workload.layout
    ranks = np.arange(scaled.world)
    same = np.zeros(scaled.world, dtype=int)
    for name, _ in scaled.axes:
        same += (ranks // scaled.stride(name)) % scaled.size(name) * full.stride(name)
    return workload.class_of[same]
