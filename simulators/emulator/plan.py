"""What each rank of a replay executes, read from the folder of the emulator contract (no torch needed).

Sizes come from `chakra.read` (the IR: whole buffers, the nccl-tests convention, whatever the .et files'
comm_size convention), durations, control dependencies, process groups and p2p ends from the .et nodes
themselves, which `chakra.read` does not keep.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from chakra.schema.protobuf import et_def_pb2 as pb

from dse.point import chakra
from dse.workload import Op, OpKind
from simulators.emulator.contract import TRACE_PREFIX, EmulatorError

KINDS = {pb.COMP_NODE: "compute", pb.COMM_COLL_NODE: "collective", pb.COMM_SEND_NODE: "send", pb.COMM_RECV_NODE: "recv"}


@dataclass(frozen=True, slots=True)
class Step:
    """One node of a rank's trace, as the replay runs it."""

    kind: str
    """compute, collective, send or recv."""
    name: str
    deps: tuple[int, ...]
    """Indices (in this rank's list) of the steps it waits for: data and control dependencies."""
    seconds: float = 0.0
    """A compute step's modelled duration."""
    collective: str = ""
    """all_reduce, all_gather, reduce_scatter, all_to_all or broadcast."""
    nbytes: int = 0
    """The whole buffer (all-gather: the gathered output; reduce-scatter: the input)."""
    group: int = 0
    """A collective's process group id (a key of the comm-groups JSON)."""
    peer: int = -1
    """A send's destination or a recv's source (global rank)."""
    tag: int = 0


@dataclass(frozen=True)
class Plan:
    groups: dict[int, list[int]]
    """Every process group, id -> member ranks, in the order every rank creates them."""
    ranks: list[list[Step]]


def load_plan(folder: str | Path, scale: float = 1.0) -> Plan:
    """Every rank's steps, sizes multiplied by `scale`."""
    folder = Path(folder)
    groups_file = folder / f"{TRACE_PREFIX}.comm_groups.json"
    if not groups_file.is_file():
        raise EmulatorError(f"{folder}: no {groups_file.name}; the folder must hold the Chakra export")
    groups = {int(pg): [int(r) for r in members] for pg, members in json.loads(groups_file.read_text()).items()}
    ir = chakra.read(folder, TRACE_PREFIX)
    ranks = []
    for rank, block in enumerate(ir.blocks):
        _, nodes = chakra.read_nodes(folder / f"{TRACE_PREFIX}.{rank}.et")
        nodes = [n for n in nodes if n.type in KINDS]
        if len(nodes) != len(block.ops):
            raise EmulatorError(f"rank {rank}: {len(nodes)} nodes but chakra.read gave {len(block.ops)} ops")
        index = {n.id: i for i, n in enumerate(nodes)}
        ranks.append([_step(n, op, index, scale) for n, op in zip(nodes, block.ops, strict=True)])
    return Plan(dict(sorted(groups.items())), ranks)


def _step(node: pb.Node, op: Op, index: dict[int, int], scale: float) -> Step:
    a = chakra.attrs(node)
    deps = tuple(sorted({index[d] for d in (*node.data_deps, *node.ctrl_deps) if d in index}))
    kind = KINDS[node.type]
    if kind == "compute":
        return Step(kind, node.name, deps, seconds=node.duration_micros * 1e-6)
    nbytes = max(1, round(op.comm_bytes * scale))
    if kind == "collective":
        return Step(kind, node.name, deps, collective=op.category, nbytes=nbytes, group=int(a["pg_name"]))
    peer = int(a["comm_dst"]) if op.kind is OpKind.SEND else int(a["comm_src"])
    return Step(kind, node.name, deps, nbytes=nbytes, peer=peer, tag=int(a.get("comm_tag", 0)))
