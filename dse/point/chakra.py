"""IR <-> Chakra execution traces (the format ASTRA-sim reads).

Export writes `OUT/<prefix>.<rank>.et` for every rank and `OUT/<prefix>.comm_groups.json` (ASTRA-sim's
`--comm-group-configuration`: `{"<pg_name>": [ranks...]}`). Units are converted here, at the edge, to what
ASTRA-sim reads (../shared/astra-sim/README.md, measured against the binary):
- `num_ops` is FLOPs, at least 1: ASTRA-sim's roofline prices a node as num_ops / min(peak, bw num_ops /
  tensor_size), which is 0/0 for a node without FLOPs (an embedding lookup, a free view) and never finishes; with
  1 it is tensor_size / bw, the memory-bound time, or 1/peak for a node that moves nothing.
- `tensor_size` and `comm_size` are bytes. comm_size is the nccl-tests buffer the IR uses (an all-reduce's and
  a reduce-scatter's input, an all-to-all's buffer), except for an all-gather, whose comm_size ASTRA-sim reads as
  each rank's input shard (it sends n - 1 of them), as Chakra's own PyTorch converter writes it: the IR's gathered
  buffer divided by the group's size. The reader multiplies it back.
- `duration_micros` (used when ASTRA-sim's roofline is off) is the op's time by our compute model
  (`dse.compute.ComputeModel`: GEMM tile shares, the attention kernel's table, launch costs), in whole
  microseconds rounded along each rank's compute stream (`stream_micros`), so their sum, the stream's busy time,
  is the model's to within half a microsecond however many small kernels the step has.
- `pg_name` is a decimal string id >= 1, `involved_dim` says which network dimensions a group spans.
Files are deterministic: node ids are issue order, group ids follow the sorted axis names and the lowest rank of
each group, and p2p tags come from the pipeline schedule, so identical input gives byte-identical files.

Dependencies: `data_deps` are the IR's data dependencies; `ctrl_deps` keep each rank's compute stream in issue
order (the pipeline schedule) and each process group's collectives in one order on every member.

The reader turns Chakra files (ours or traces captured elsewhere) back into a Workload with one program per rank.
"""

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import decodeMessage as decode_message
from chakra.src.third_party.utils.protolib import encodeMessage as encode_message

from dse.compute import ComputeModel
from dse.errors import DseError
from dse.system import AcceleratorSpec
from dse.workload import Block, Call, Collective, Op, OpKind, Program, RankLayout, Workload, expand

SCHEMA_VERSION = "0.0.4"
COMM_TYPE = {
    Collective.ALL_REDUCE: pb.ALL_REDUCE,
    Collective.ALL_GATHER: pb.ALL_GATHER,
    Collective.REDUCE_SCATTER: pb.REDUCE_SCATTER,
    Collective.ALL_TO_ALL: pb.ALL_TO_ALL,
    Collective.BROADCAST: pb.BROADCAST,
}
COLLECTIVE_OF = {v: k for k, v in COMM_TYPE.items()}
TAG_STRIDE = 1 << 12
"""comm_tag = slot * TAG_STRIDE + how many p2p ops of its kind come before it in its call (a ring step's send and
the neighbour's matching recv count alike). See `comm_tag` for the slot."""
TAG_SLOTS = (1 << 31) // TAG_STRIDE


def comm_tag(call: Call, call_index: int, axis: str, position: int) -> int:
    """A p2p op's tag, the same at both ends and never reused between a pair of ranks within a step.

    Pipeline transfers (axis pp) cross between programs, so the slot comes from their schedule tag, which both
    stages compute alike (the tied-weight exchange's 0 included); every other p2p op is a ring step whose peers run
    the same program, so its call's place in the program names it. Even and odd slots keep the two apart."""
    slot = 2 * call.tag if axis == "pp" else 2 * call_index + 1
    if slot >= TAG_SLOTS or position >= TAG_STRIDE:
        raise ChakraError(
            f"p2p op {position} of call {call_index} needs comm_tag slot {slot}, beyond int32's {TAG_SLOTS}; "
            "export a step with fewer micro-batches"
        )
    return slot * TAG_STRIDE + position


class ChakraError(DseError):
    """A Chakra file that cannot be read or a workload that cannot be exported."""


@dataclass(frozen=True)
class CommGroups:
    """Every process group the workload uses, numbered from 1: (axis, lowest rank) -> pg id."""

    ids: dict[tuple[str, int], int]
    members: dict[int, list[int]]

    @classmethod
    def of(cls, layout: RankLayout, axes: Sequence[str]) -> "CommGroups":
        ids: dict[tuple[str, int], int] = {}
        members: dict[int, list[int]] = {}
        for axis in sorted(set(axes)):
            for group in layout.groups(axis):
                pg = len(members) + 1
                ids[(axis, group[0])] = pg
                members[pg] = group
        return cls(ids, members)

    def of_rank(self, layout: RankLayout, rank: int, axis: str) -> int:
        return self.ids[(axis, layout.group(rank, axis)[0])]


def involved_dims(members: Sequence[int], network: Sequence[int]) -> list[bool]:
    """Which network dimensions (sizes innermost first) a group's members differ in."""
    out = []
    stride = 1
    for size in network:
        coords = {(r // stride) % size for r in members}
        out.append(len(coords) > 1)
        stride *= size
    return out


def comm_size(op: Op, layout: RankLayout) -> float:
    """A collective's comm_size as ASTRA-sim reads it: an all-gather's is each rank's input shard (see above)."""
    if op.category == Collective.ALL_GATHER:
        return op.comm_bytes / layout.size(op.axis)
    return op.comm_bytes


def _attr(name: str, **value: object) -> pb.AttributeProto:
    return pb.AttributeProto(name=name, **value)


def _encoded(message: object) -> bytes:
    buffer = io.BytesIO()
    encode_message(buffer, message)
    return buffer.getvalue()


def _io(ids: Sequence[int], sizes: Sequence[int], itemsize: int) -> pb.IOInfo:
    """A PyTorch-ET style tensor list: [tensor_id, storage_id, offset, numel, itemsize, device] per tensor."""
    numels = [max(1, size // itemsize) for size in sizes]
    # Written out by hand (what json.dumps writes, a tenth of its time): a large step has a million of these.
    values = ",".join(f'[{i},{i},0,{n},{itemsize},"cuda"]' for i, n in zip(ids, numels, strict=True))
    return pb.IOInfo(
        values=f"[{values}]",
        shapes="[" + ",".join(f"[{n}]" for n in numels) + "]",
        types="[" + ", ".join(['"Tensor"'] * len(numels)) + "]",
    )


def stream_micros(seconds: Sequence[float]) -> list[int]:
    """Whole microseconds for kernels that run one after another, rounded where the stream's running time falls
    (error diffusion) instead of one by one: rounding a thousand 2.4 us kernels down would lose a third of them."""
    out = []
    elapsed = 0.0
    written = 0
    for s in seconds:
        elapsed += s * 1e6
        micros = max(0, round(elapsed) - written)
        written += micros
        out.append(micros)
    return out


class _Exporter:
    def __init__(
        self, workload: Workload, network: Sequence[int], itemsize: int, accelerator: AcceleratorSpec | None = None
    ):
        self.compute = (
            None
            if accelerator is None
            else ComputeModel(accelerator, workload.dtype, attention_kernel=workload.attention_kernel)
        )
        self.w = workload
        self.network = list(network)
        self.itemsize = itemsize
        if int(np.prod(self.network)) != workload.layout.world:
            raise ChakraError(
                f"system network has {int(np.prod(self.network))} NPUs but the workload has "
                f"{workload.layout.world} ranks; export with the point's own system"
            )
        self.axes = sorted({op.axis for b in workload.blocks for op in b.ops if op.kind is OpKind.COLLECTIVE})

    @cached_property
    def groups(self) -> CommGroups:
        """Built when the files are written: seconds for a world of 2^18 ranks, which `estimate` does not need."""
        return CommGroups.of(self.w.layout, self.axes)

    @cached_property
    def involved(self) -> dict[int, list[bool]]:
        return {pg: involved_dims(m, self.network) for pg, m in self.groups.members.items()}

    def estimate(self) -> int:
        """About the bytes `write` would write (see `estimate_bytes`)."""
        layout = self.w.layout
        groups = sum(layout.world // layout.size(axis) for axis in self.axes)
        # Each rank's own attributes at their widest: the last group's id, the last rank as a peer.
        group_attrs = _group_attrs(str(groups), [False] * len(self.network))
        peer_attrs = _peer_attrs(layout.world - 1, layout.world - 1)
        sizes: dict[int, tuple[int, int, int]] = {}
        for program in self.w.programs:
            for index, call in enumerate(program.calls):
                if call.block not in sizes:
                    sizes[call.block] = self._call_size(program, index, group_attrs, peer_attrs)
        ranks = np.bincount(self.w.class_of, minlength=len(self.w.programs))
        header = len(self.metadata())
        traces = 0.0
        for program, count in zip(self.w.programs, ranks, strict=True):
            encoded = tensors = ops = digits = 0.0
            for call in program.calls:
                size = sizes[call.block]
                encoded, tensors, ops = encoded + size[0], tensors + size[1], ops + size[2]
                digits += size[2] * _mean_digits(int(size[2]))
            # Each tensor's id is written twice as text; in the program its ids have the digits of its place.
            longer_ids = 2 * tensors * (_mean_digits(int(ops)) - digits / max(ops, 1))
            traces += int(count) * (header + encoded + longer_ids)
        member = len(str(layout.world)) + 2  # a rank in the groups file: its digits, a comma and a space
        return round(traces + len(self.axes) * layout.world * member)

    def _call_size(
        self, program: Program, index: int, group_attrs: list[pb.AttributeProto], peer_attrs: list[pb.AttributeProto]
    ) -> tuple[int, int, int]:
        """A program's call encoded after the calls it reads, as `write` encodes it: its bytes, its tensors
        (written with their ids) and its ops."""
        call = program.calls[index]
        inputs = [program.calls[i]._replace(inputs=()) for i in call.inputs]
        calls = [*inputs, call._replace(inputs=tuple(range(len(inputs))))]
        nodes, flat = self.class_nodes(Program(program.rank_class, program.name, calls))
        encoded = tensors = count = 0
        for (node, op), position in zip(nodes, flat, strict=True):
            if position.call != len(inputs):
                continue
            count += 1
            if op.kind is not OpKind.COMPUTE:
                node = _extended(node, group_attrs if op.kind is OpKind.COLLECTIVE else peer_attrs)
            encoded += len(_encoded(node))
            tensors += len(node.data_deps) + 1
        return encoded, tensors, count

    def class_nodes(self, program: Program) -> tuple[list, list[tuple]]:
        """The rank-independent part of a class's nodes, and per node what a rank fills in."""
        flat = list(expand(self.w, program))
        out_size = [int(f.op.comm_bytes if f.op.is_comm else (f.op.out_bytes or f.op.bytes)) for f in flat]
        nodes = []
        last_compute = -1
        last_coll: dict[str, int] = {}
        durations = iter(self.durations(flat))
        for f in flat:
            op = f.op
            ctrl: list[int] = []
            if op.kind is OpKind.COMPUTE:
                if last_compute >= 0:
                    ctrl.append(last_compute)
                last_compute = f.index
            elif op.kind is OpKind.COLLECTIVE:
                if op.axis in last_coll:
                    ctrl.append(last_coll[op.axis])
                last_coll[op.axis] = f.index
            deps = sorted(set(f.deps))
            node = pb.Node(id=f.index, name=op.name, ctrl_deps=ctrl, data_deps=deps)
            if op.kind is OpKind.COMPUTE:
                node.duration_micros = next(durations)
            node.inputs.CopyFrom(_io(deps, [out_size[d] for d in deps], self.itemsize))
            node.outputs.CopyFrom(_io([f.index], [out_size[f.index]], self.itemsize))
            attrs = [_attr("is_cpu_op", bool_val=False)]
            if op.kind is OpKind.COMPUTE:
                node.type = pb.COMP_NODE
                attrs += [
                    _attr("num_ops", int64_val=max(1, round(op.flops * op.density))),
                    _attr("tensor_size", uint64_val=round(op.bytes)),
                    _attr("op_category", string_val=op.category),
                    _attr("model_flops", int64_val=round(op.flops)),
                ]
            elif op.kind is OpKind.COLLECTIVE:
                node.type = pb.COMM_COLL_NODE
                attrs += [
                    _attr("comm_type", int64_val=COMM_TYPE[Collective(op.category)]),
                    _attr("comm_size", int64_val=round(comm_size(op, self.w.layout))),
                    _attr("axis", string_val=op.axis),
                ]
            else:
                node.type = pb.COMM_SEND_NODE if op.kind is OpKind.SEND else pb.COMM_RECV_NODE
                call = program.calls[f.call]
                position = sum(g.op.kind is op.kind for g in flat[self._call_start(flat, f) : f.index])
                attrs += [
                    _attr("comm_size", int64_val=round(op.comm_bytes)),
                    _attr("tensor_size", uint64_val=round(op.comm_bytes)),
                    _attr("comm_tag", int32_val=comm_tag(call, f.call, op.axis, position)),
                    _attr("axis", string_val=op.axis),
                ]
            node.attr.extend(attrs)
            nodes.append((node, op))
        return nodes, flat

    def durations(self, flat: list) -> list[int]:
        """duration_micros of the program's compute ops in issue order (all 0 without an accelerator)."""
        compute = [f.op for f in flat if f.op.kind is OpKind.COMPUTE]
        if self.compute is None:
            return [0] * len(compute)
        seconds: dict[Op, float] = {}  # a layer's ops recur in every call of its block
        for op in compute:
            if op not in seconds:
                seconds[op] = self.compute.price(op)[0]
        return stream_micros([seconds[op] for op in compute])

    @staticmethod
    def _call_start(flat: list, f: object) -> int:
        i = f.index  # type: ignore[attr-defined]
        while i > 0 and flat[i - 1].call == f.call:  # type: ignore[attr-defined]
            i -= 1
        return i

    def metadata(self) -> bytes:
        layout = ",".join(f"{a}={n}" for a, n in self.w.layout.axes)
        meta = pb.GlobalMetadata(version=SCHEMA_VERSION)
        meta.attr.extend(
            [
                _attr("dse_layout", string_val=layout),
                _attr("dse_tokens", int64_val=self.w.tokens),
                _attr("dse_model_flops", double_val=self.w.model_flops),
                _attr("dse_dtype", string_val=self.w.dtype),
                _attr("dse_point", string_val=self.w.point_key),
            ]
        )
        return _encoded(meta)

    def write(self, out: Path, prefix: str) -> list[Path]:
        out.mkdir(parents=True, exist_ok=True)
        layout = self.w.layout
        header = self.metadata()
        paths = []
        for program in self.w.programs:
            nodes, _ = self.class_nodes(program)
            fixed: dict[int, bytes] = {}
            cache: dict[tuple[int, int, int], bytes] = {}
            for i, (node, op) in enumerate(nodes):
                if op.kind is OpKind.COMPUTE:
                    fixed[i] = _encoded(node)
            for rank in self.w.ranks_of(program.rank_class):
                rank = int(rank)
                parts = [header]
                pgs = {
                    a: self.groups.of_rank(layout, rank, a)
                    for a in {op.axis for _, op in nodes if op.kind is OpKind.COLLECTIVE}
                }
                for i, (node, op) in enumerate(nodes):
                    if i in fixed:
                        parts.append(fixed[i])
                        continue
                    key = (i, pgs[op.axis], 0) if op.kind is OpKind.COLLECTIVE else (i, rank, 0)
                    blob = cache.get(key)
                    if blob is None:
                        blob = _encoded(self._rank_node(node, op, rank, key[1]))
                        cache[key] = blob
                    parts.append(blob)
                path = out / f"{prefix}.{rank}.et"
                path.write_bytes(b"".join(parts))
                paths.append(path)
        groups = {str(pg): members for pg, members in self.groups.members.items()}
        (out / f"{prefix}.comm_groups.json").write_text(json.dumps(groups, sort_keys=False) + "\n")
        return paths

    def _rank_node(self, template: pb.Node, op: Op, rank: int, pg: int) -> pb.Node:
        if op.kind is OpKind.COLLECTIVE:
            return _extended(template, _group_attrs(str(pg), self.involved[pg]))
        peer = self.w.layout.peer(rank, op.axis, op.peer)
        src, dst = (rank, peer) if op.kind is OpKind.SEND else (peer, rank)
        return _extended(template, _peer_attrs(src, dst))


def _mean_digits(n: int) -> float:
    """The mean number of decimal digits of the integers 0 to n - 1."""
    total, low = 0, 0
    for digits in range(1, len(str(max(n - 1, 0))) + 1):
        high = min(n, 10**digits)
        total += digits * (high - low)
        low = high
    return total / max(n, 1)


def _group_attrs(pg_name: str, involved: list[bool]) -> list[pb.AttributeProto]:
    """A collective's attributes that differ between ranks: its process group and the dimensions it spans."""
    return [_attr("pg_name", string_val=pg_name), _attr("involved_dim", bool_list=pb.BoolList(values=involved))]


def _peer_attrs(src: int, dst: int) -> list[pb.AttributeProto]:
    """A send's or receive's attributes that differ between ranks: its two ends."""
    return [_attr("comm_src", int32_val=src), _attr("comm_dst", int32_val=dst)]


def _extended(template: pb.Node, attrs: list[pb.AttributeProto]) -> pb.Node:
    """A copy of a class's node with one rank's attributes added."""
    node = pb.Node()
    node.CopyFrom(template)
    node.attr.extend(attrs)
    return node


def export(
    workload: Workload,
    out_dir: str | Path,
    network: Sequence[int],
    prefix: str = "trace",
    itemsize: int = 2,
    accelerator: AcceleratorSpec | None = None,
) -> list[Path]:
    """Write one .et file per rank and the communicator-group JSON; returns the .et paths in rank order.

    network: the NPUs of each network dimension, innermost first (the system's `network[i].npus`).
    accelerator: when given, compute nodes also carry duration_micros from our compute model (ASTRA-sim uses it
    when its own roofline is off).
    """
    paths = _Exporter(workload, network, itemsize, accelerator).write(Path(out_dir), prefix)
    return sorted(paths, key=lambda p: int(p.name.rsplit(".", 2)[1]))


def estimate_bytes(
    workload: Workload, network: Sequence[int], itemsize: int = 2, accelerator: AcceleratorSpec | None = None
) -> int:
    """About how many bytes `export` would write, measured rather than guessed: each block the programs call is
    encoded once as `export` encodes it (with each rank's attributes at their widest), and every rank's file is
    the sum over its calls, with its header; then the communicator groups file. Encoding the blocks once, and
    building no group, sizes a world of 2^20 ranks in a fraction of a second, before anything is written; within
    a few percent of the files written (tests/test_command_inputs.py)."""
    return _Exporter(workload, network, itemsize, accelerator).estimate()


# -- reading -------------------------------------------------------------------------------------------------


def read_nodes(path: str | Path) -> tuple[pb.GlobalMetadata, list[pb.Node]]:
    """Decode one .et file with mlc-chakra: its metadata and its nodes in file order."""
    meta = pb.GlobalMetadata()
    nodes = []
    with open(path, "rb") as f:
        if not decode_message(f, meta):
            raise ChakraError(f"{path}: not a Chakra execution trace (no metadata message)")
        while True:
            node = pb.Node()
            if not decode_message(f, node):
                break
            nodes.append(node)
    return meta, nodes


def attrs(node: pb.Node) -> dict[str, object]:
    out: dict[str, object] = {}
    for a in node.attr:
        which = a.WhichOneof("value")
        value = getattr(a, which) if which else None
        out[a.name] = list(value.values) if hasattr(value, "values") else value
    return out


def _layout_of(meta: pb.GlobalMetadata, world: int) -> RankLayout:
    for a in meta.attr:
        if a.name == "dse_layout":
            return RankLayout(tuple((k, int(v)) for k, v in (p.split("=") for p in a.string_val.split(","))))
    return RankLayout((("rank", world),))


def _meta(meta: pb.GlobalMetadata, name: str, default: object) -> object:
    for a in meta.attr:
        if a.name == name:
            return getattr(a, a.WhichOneof("value"))
    return default


def _group_size(groups: dict, pg_name: object, layout: RankLayout, axis: str, world: int) -> int:
    """Members of a collective's group: from the communicator-group file, else our layout's axis, else the world
    (ASTRA-sim runs a collective without a group over every NPU)."""
    if pg_name and str(pg_name) in groups:
        return len(groups[str(pg_name)])
    return layout.size(axis) if axis in dict(layout.axes) else world


def read(directory: str | Path, prefix: str = "trace") -> Workload:
    """Chakra files `<prefix>.<rank>.et` back into the IR: one block and one program per rank.

    Collective axes come from our `axis` attribute, else `pg<pg_name>`; p2p peers become offsets along the
    axis when the layout is known, else along the flat rank axis.
    """
    directory = Path(directory)
    files = sorted(directory.glob(f"{prefix}.*.et"), key=lambda p: int(p.name.rsplit(".", 2)[1]))
    if not files:
        raise ChakraError(f"{directory}: no files named {prefix}.<rank>.et")
    blocks, programs = [], []
    meta = pb.GlobalMetadata()
    layout = None
    groups_file = directory / f"{prefix}.comm_groups.json"
    groups = json.loads(groups_file.read_text()) if groups_file.is_file() else {}
    for rank, path in enumerate(files):
        meta, nodes = read_nodes(path)
        layout = layout or _layout_of(meta, len(files))
        index = {n.id: i for i, n in enumerate(nodes)}
        ops = []
        for n in nodes:
            a = attrs(n)
            deps = tuple(sorted(index[d] for d in n.data_deps if d in index))
            name = n.name
            if n.type == pb.COMP_NODE:
                flops = float(a.get("model_flops", a.get("num_ops", 0)))
                executed = float(a.get("num_ops", 0))
                density = executed / flops if flops else 1.0
                category = str(a.get("op_category", "other"))
                ops.append(
                    Op(name, OpKind.COMPUTE, category, flops, float(a.get("tensor_size", 0)), density, deps=deps)
                )
            elif n.type == pb.COMM_COLL_NODE:
                collective = COLLECTIVE_OF.get(int(a.get("comm_type", 0)))
                if collective is None:
                    raise ChakraError(f"{path}: node {n.id} has an unsupported comm_type {a.get('comm_type')}")
                axis = str(a.get("axis") or f"pg{a.get('pg_name', '')}")
                size = float(a["comm_size"])
                if collective is Collective.ALL_GATHER:  # each rank's shard in the file, the gathered buffer here
                    size *= _group_size(groups, a.get("pg_name"), layout, axis, len(files))
                ops.append(
                    Op(
                        name,
                        OpKind.COLLECTIVE,
                        collective.value,
                        comm_bytes=size,
                        axis=axis,
                        deps=deps,
                    )
                )
            elif n.type in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE):
                kind = OpKind.SEND if n.type == pb.COMM_SEND_NODE else OpKind.RECV
                src, dst = int(a["comm_src"]), int(a["comm_dst"])
                other = dst if kind is OpKind.SEND else src
                axis = str(a.get("axis", "rank"))
                if axis not in dict(layout.axes):
                    axis = layout.axes[0][0]
                stride = layout.stride(axis)
                size = float(a.get("comm_size", a.get("tensor_size", 0)))
                ops.append(
                    Op(name, kind, kind.value, comm_bytes=size, axis=axis, peer=(other - rank) // stride, deps=deps)
                )
        blocks.append(Block(f"rank{rank}", tuple(ops)))
        programs.append(Program(rank, f"rank{rank}", [Call(rank)]))
    assert layout is not None
    return Workload(
        str(_meta(meta, "dse_point", directory.name)),
        layout,
        blocks,
        programs,
        np.arange(len(files)),
        int(_meta(meta, "dse_tokens", 0)),
        float(_meta(meta, "dse_model_flops", 0.0)),
        str(_meta(meta, "dse_dtype", "bf16")),
    )
