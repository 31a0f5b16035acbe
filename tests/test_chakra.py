"""Chakra export and import: every file decodes with mlc-chakra, units and groups are what ASTRA-sim reads, the
output is byte-identical run to run, and reading it back gives the IR's ops."""

import itertools
import json
from collections import Counter

import pytest
from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import decodeMessage
from helpers import make_point

from dse.cli.main import main
from dse.compute import ComputeModel
from dse.point import chakra
from dse.workload import OpKind, expand
from generators.symbolic import SymbolicGenerator

GEN = SymbolicGenerator()
NETWORK = [4, 2]  # tiny-ring: a ring of 4, then a switch of 2


def export(point, tmp_path, name="out"):
    workload = GEN.generate(point)
    paths = chakra.export(workload, tmp_path / name, [d.npus for d in point.system.network])
    return workload, paths


def decode_all(path):
    """Decode with mlc-chakra's own reader: the metadata message, then nodes until the end."""
    with open(path, "rb") as f:
        meta = pb.GlobalMetadata()
        assert decodeMessage(f, meta)
        nodes = []
        while True:
            node = pb.Node()
            if not decodeMessage(f, node):
                break
            nodes.append(node)
    return meta, nodes


def p2p_ends(paths) -> tuple[Counter, Counter]:
    """Sends and receives of a trace set, each counted by (source, destination, tag, size): equal when every
    send has its receive."""
    sends, recvs = Counter(), Counter()
    for path in paths:
        for n in decode_all(path)[1]:
            if n.type in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE):
                a = chakra.attrs(n)
                key = (a["comm_src"], a["comm_dst"], a["comm_tag"], a["comm_size"])
                (sends if n.type == pb.COMM_SEND_NODE else recvs)[key] += 1
    return sends, recvs


@pytest.fixture(scope="module")
def dense3d(tmp_path_factory):
    point = make_point("tiny-llama", global_batch=8, tp=2, pp=2, dp=2, sp=True, zero=1)
    return point, *export(point, tmp_path_factory.mktemp("chakra"))


def test_every_rank_gets_a_file_that_decodes_with_mlc_chakra(dense3d):
    _point, workload, paths = dense3d
    assert [p.name for p in paths] == [f"trace.{r}.et" for r in range(8)]
    for rank, path in enumerate(paths):
        meta, nodes = decode_all(path)
        assert meta.version
        program = workload.programs[int(workload.class_of[rank])]
        assert len(nodes) == sum(len(workload.blocks[c.block].ops) for c in program.calls)
        assert [n.id for n in nodes] == list(range(len(nodes)))
        assert all(d < n.id for n in nodes for d in (*n.data_deps, *n.ctrl_deps))


def test_units_are_flops_and_bytes_and_match_the_ir(dense3d):
    _point, workload, paths = dense3d
    _, nodes = decode_all(paths[0])
    flat = list(expand(workload, workload.programs[0]))
    for node, f in zip(nodes, flat, strict=True):
        a = chakra.attrs(node)
        if f.op.kind is OpKind.COMPUTE:
            assert node.type == pb.COMP_NODE
            assert a["num_ops"] == max(1, round(f.op.flops * f.op.density))  # 0/0 in ASTRA-sim's roofline
            assert a["tensor_size"] == round(f.op.bytes)
        elif f.op.kind is OpKind.COLLECTIVE:
            assert node.type == pb.COMM_COLL_NODE
            shard = workload.layout.size(f.op.axis) if f.op.category == "all_gather" else 1
            assert a["comm_size"] == round(f.op.comm_bytes / shard)
            assert a["comm_type"] == chakra.COMM_TYPE[f.op.category]
        assert sorted(node.data_deps) == sorted(set(f.deps))
    # A TP+SP layer's forward all-gather gathers b*s*h*2 bytes (b = 1 sequence per DP rank); ASTRA-sim reads an
    # all-gather's comm_size as each rank's input shard, 1/tp of it. A reduce-scatter's is its whole input.
    gathers = [chakra.attrs(n)["comm_size"] for n in nodes if n.name == "ln1.all_gather"]
    assert gathers and set(gathers) == {1 * 256 * 256 * 2 // 2}
    scatters = {chakra.attrs(n)["comm_size"] for n in nodes if n.name == "wo.reduce_scatter"}
    assert scatters == {1 * 256 * 256 * 2}


def test_process_groups_have_string_ids_and_involved_dims_from_the_network(dense3d, tmp_path):
    _point, workload, paths = dense3d
    groups = json.loads((paths[0].parent / "trace.comm_groups.json").read_text())
    assert all(int(k) >= 1 for k in groups)
    seen = Counter()
    for rank, path in enumerate(paths):
        _, nodes = decode_all(path)
        for n in nodes:
            if n.type != pb.COMM_COLL_NODE:
                continue
            a = chakra.attrs(n)
            members = groups[a["pg_name"]]
            assert rank in members
            assert members == workload.layout.group(rank, a["axis"])
            # tp and dp groups stay inside the ring of 4; nothing collective crosses the switch
            assert a["involved_dim"] == [True, False]
            seen[a["axis"]] += 1
    assert set(seen) == {"tp", "dp"}


def test_sends_and_receives_pair_up_by_source_destination_tag_and_size(dense3d):
    point, _workload, paths = dense3d
    sends, recvs = p2p_ends(paths)
    assert sends == recvs
    assert len(sends) == 8 * 2 * point.micro_batches // 2  # 4 stage pairs x 2 directions x micro-batches
    assert all(src ^ dst == 4 for src, dst, _, _ in sends)  # pp peers are 4 ranks apart (tp*dp = 4)


def test_compute_runs_in_schedule_order_through_control_dependencies(dense3d):
    _, _, paths = dense3d
    nodes = decode_all(paths[0])[1]
    compute = [n for n in nodes if n.type == pb.COMP_NODE]
    for before, after in itertools.pairwise(compute):
        assert before.id in after.ctrl_deps


def test_identical_input_gives_byte_identical_files(tmp_path):
    point = make_point("tiny-moe", global_batch=8, dp=4, ep=2, pp=2, zero=1)
    _, first = export(point, tmp_path, "a")
    _, second = export(point, tmp_path, "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    assert (tmp_path / "a/trace.comm_groups.json").read_bytes() == (tmp_path / "b/trace.comm_groups.json").read_bytes()
    alltoall = [n for n in decode_all(first[0])[1] if n.type == pb.COMM_COLL_NODE and n.name == "dispatch.all_to_all"]
    assert alltoall and chakra.attrs(alltoall[0])["comm_type"] == pb.ALL_TO_ALL


def test_reader_turns_the_files_back_into_the_ir(dense3d):
    _point, workload, paths = dense3d
    back = chakra.read(paths[0].parent)
    assert back.layout == workload.layout
    assert back.tokens == workload.tokens and back.model_flops == pytest.approx(workload.model_flops)
    for rank in (0, 5):
        original = list(expand(workload, workload.programs[int(workload.class_of[rank])]))
        read = list(expand(back, back.programs[rank]))
        assert [(f.op.kind, f.op.category, f.op.axis, f.op.peer) for f in read] == [
            (f.op.kind, f.op.category, f.op.axis, f.op.peer) for f in original
        ]
        assert sum(f.op.flops for f in read) == pytest.approx(sum(f.op.flops for f in original), rel=1e-9)
        assert [f.op.comm_bytes for f in read] == pytest.approx([f.op.comm_bytes for f in original], abs=0.5)
        assert [sorted(set(f.deps)) for f in read] == [sorted(set(f.deps)) for f in original]


def test_reader_accepts_foreign_traces_without_our_attributes(tmp_path):
    with open(tmp_path / "x.0.et", "wb") as f:
        # a foreign trace: only the attributes ASTRA-sim reads, none of ours
        f.write(chakra._encoded(pb.GlobalMetadata(version="0.0.4")))
        node = pb.Node(id=7, name="gemm", type=pb.COMP_NODE)
        node.attr.extend([pb.AttributeProto(name="num_ops", int64_val=1000)])
        f.write(chakra._encoded(node))
        coll = pb.Node(id=9, name="ar", type=pb.COMM_COLL_NODE, data_deps=[7])
        coll.attr.extend(
            [
                pb.AttributeProto(name="comm_type", int64_val=pb.ALL_REDUCE),
                pb.AttributeProto(name="comm_size", int64_val=4096),
                pb.AttributeProto(name="pg_name", string_val="3"),
            ]
        )
        f.write(chakra._encoded(coll))
    back = chakra.read(tmp_path, prefix="x")
    ops = back.blocks[0].ops
    assert (ops[0].flops, ops[1].category, ops[1].comm_bytes, ops[1].axis, ops[1].deps) == (
        1000,
        "all_reduce",
        4096,
        "pg3",
        (0,),
    )


def test_cli_generate_writes_traces_and_prints_a_summary(tmp_path, capsys):
    point_file = tmp_path / "p.yaml"
    point_file.write_text(
        "model: tiny-moe\nworkload: {seq_len: 256, global_batch: 8}\n"
        "parallel: {dp: 4, ep: 2, pp: 2}\nsystem: tiny-ring\n"
    )
    assert main(["generate", str(point_file), "--chakra", str(tmp_path / "et"), "--summary"]) == 0
    assert len(list((tmp_path / "et").glob("trace.*.et"))) == 8
    out = capsys.readouterr().out
    assert "comm: all_to_all on ep" in out and "peak activations" in out and "rank class 1" in out


def test_cli_generate_reports_an_infeasible_point_in_one_line(tmp_path, capsys):
    point_file = tmp_path / "p.yaml"
    point_file.write_text(
        "model: tiny-llama\nworkload: {seq_len: 256, global_batch: 8}\nparallel: {dp: 8, ep: 2}\nsystem: tiny-ring\n"
    )
    assert main(["generate", str(point_file), "--summary"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {point_file}: parallel.ep=2 needs a mixture-of-experts model") and "\n" not in err


def test_compute_nodes_carry_the_compute_models_durations_rounded_along_the_stream(tmp_path):
    point = make_point("tiny-llama", global_batch=8, tp=2, pp=2, dp=2)
    workload = GEN.generate(point)
    model = ComputeModel(point.system.accelerator, workload.dtype, attention_kernel=workload.attention_kernel)
    paths = chakra.export(workload, tmp_path, NETWORK, accelerator=point.system.accelerator)
    nodes = [n for n in decode_all(paths[0])[1] if n.type == pb.COMP_NODE]
    flat = [f.op for f in expand(workload, workload.programs[0]) if f.op.kind is OpKind.COMPUTE]
    seconds = [model.price(op)[0] for op in flat]
    micros = [n.duration_micros for n in nodes]
    # Each kernel within a microsecond of the model, and the stream's running sum within half of one: rounded one
    # by one, this stage's 331 kernels of 2-20 us would come to 19 us (1%) short of the model's 1,972.
    assert all(abs(m - s * 1e6) < 1 for m, s in zip(micros, seconds, strict=True))
    running = itertools.accumulate(s * 1e6 for s in seconds)
    assert all(abs(m - s) <= 0.5 + 1e-6 for m, s in zip(itertools.accumulate(micros), running, strict=True))
    assert sum(round(s * 1e6) - s * 1e6 for s in seconds) < -10
    without = decode_all(chakra.export(workload, tmp_path / "plain", NETWORK)[0])[1]
    assert all(n.duration_micros == 0 for n in without)


def test_stream_rounding_keeps_the_running_sum():
    assert chakra.stream_micros([2.4e-6] * 5) == [2, 3, 2, 3, 2]
    assert chakra.stream_micros([0.0, 1e-7, 1e-7, 1e-3]) == [0, 0, 0, 1000]
