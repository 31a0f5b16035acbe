"""The schedule: stream order, overlap of communication with compute, p2p rendezvous, deadlocks, traces.

Kernels run on a 1 TFLOP/s accelerator at full efficiency with no launch cost, so an op of f FLOPs takes
f/1e12 seconds; collectives run on a 1 GB/s ring with no latency, so an all-reduce of S bytes between two
ranks takes S/1e9 seconds.
"""

from collections import defaultdict

import numpy as np
import pytest
from helpers import UNIT_ACCELERATOR

from dse.compute import compute_time
from dse.errors import InfeasibleError
from dse.interfaces import CostModel
from dse.system import NetworkDim, SystemSpec
from dse.workload import BLOCK_INPUT, Block, Call, Op, OpKind, Program, RankLayout, Workload, expand
from simulators.analytical import AnalyticalCostModel, to_chrome_trace
from simulators.analytical.network import collective_time, group_span

MS = 1e-3


def system(*npus: int) -> SystemSpec:
    dims = [NetworkDim(topology="ring", npus=n, bandwidth_GBps=1, latency_ns=0) for n in npus]
    return SystemSpec(name="unit", accelerator=UNIT_ACCELERATOR, network=dims)


def gemm(name: str, ms: float, deps: tuple[int, ...] = ()) -> Op:
    return Op(name, OpKind.COMPUTE, "gemm", flops=ms * 1e9, deps=deps)


def all_reduce(name: str, ms: float, axis: str, deps: tuple[int, ...] = ()) -> Op:
    """An all-reduce that takes `ms` milliseconds on a group of two."""
    return Op(name, OpKind.COLLECTIVE, "all_reduce", comm_bytes=ms * 1e6, axis=axis, deps=deps)


def workload(layout: RankLayout, blocks: list[Block], programs: list[Program], class_of=None) -> Workload:
    if class_of is None:
        class_of = np.zeros(layout.world, dtype=int)
    return Workload("unit", layout, blocks, programs, np.asarray(class_of), tokens=1, model_flops=1.0)


def overlapped() -> Workload:
    """A 14 ms all-reduce that only the last op waits for, beside 10 ms of compute that does not need it."""
    return single_block(all_reduce("grad_sync", 14, "dp"), gemm("other_layer", 10), gemm("update", 1, deps=(0, 1)))


def single_block(*ops: Op) -> Workload:
    program = Program(0, "all")
    program.add(Call(0))
    return workload(RankLayout((("dp", 2),)), [Block("step", ops)], [program])


def test_a_collective_under_independent_compute_overlaps():
    w = overlapped()
    result = AnalyticalCostModel().simulate(w, system(2))
    (cls,) = result.classes
    assert result.step_time_s == pytest.approx(15 * MS, rel=1e-12)
    assert cls.compute_s == pytest.approx(11 * MS, rel=1e-12)
    assert cls.comm_s == pytest.approx(14 * MS, rel=1e-12)
    overlap = 10 * MS
    assert cls.exposed_comm_s == pytest.approx(cls.comm_s - overlap, rel=1e-12)
    assert result.overlap_ratio == pytest.approx(10 / 14, rel=1e-12)
    assert cls.time_by_category == pytest.approx({"all_reduce": 14 * MS, "gemm": 11 * MS}, rel=1e-12)
    assert cls.ranks == 2


def test_a_serial_chain_exposes_all_communication():
    w = single_block(gemm("fwd", 10), all_reduce("sync", 14, "dp", deps=(0,)), gemm("next", 1, deps=(1,)))
    result = AnalyticalCostModel().simulate(w, system(2))
    assert result.step_time_s == pytest.approx(25 * MS, rel=1e-12)
    assert result.overlap_ratio == 0.0
    assert result.exposed_comm_time_s == pytest.approx(14 * MS, rel=1e-12)


def test_ops_on_one_stream_run_in_issue_order():
    w = single_block(all_reduce("a", 5, "dp"), all_reduce("b", 3, "dp"), gemm("c", 1))
    result = AnalyticalCostModel(timeline=True).simulate(w, system(2))
    spans = {e.name: (e.start_s, e.end_s) for e in result.timeline}
    assert spans["b"] == pytest.approx((5 * MS, 8 * MS), rel=1e-12)
    assert spans["c"] == pytest.approx((0.0, 1 * MS), abs=1e-15)
    assert result.step_time_s == pytest.approx(8 * MS, rel=1e-12)


def _reference_timeline(w: Workload, sys: SystemSpec) -> list[tuple[str, str, float, float]]:
    """The schedule recomputed op by op from the expanded graph, the slow way."""
    program = w.programs[0]
    end: dict[int, float] = {}
    stream_end: dict[str, float] = defaultdict(float)
    out = []
    for flat in expand(w, program):
        op = flat.op
        if op.kind is OpKind.COMPUTE:
            stream, seconds = "compute", compute_time(op, sys.accelerator, "bf16")
        else:
            stream = f"comm:{op.axis}"
            span = group_span(w.layout.group(0, op.axis), sys.network)
            seconds = collective_time(op.category, op.comm_bytes, span)
        start = max([stream_end[stream], *(end[d] for d in flat.deps)])
        end[flat.index] = stream_end[stream] = start + seconds
        out.append((op.name, stream, start, start + seconds))
    return out


def test_block_templates_schedule_like_the_expanded_graph():
    fwd = Block(
        "fwd",
        (
            gemm("qkv", 3, deps=(BLOCK_INPUT,)),
            all_reduce("tp_ar", 6, "tp", deps=(0,)),
            gemm("mlp", 4, deps=(0,)),
            gemm("proj", 2, deps=(1,)),  # waits on the all-reduce: it cannot just follow mlp
            gemm("norm", 1, deps=(3,)),
        ),
    )
    # The backward hands its input gradient on (op 0) before its gradient sync (op 3) has finished; the sync
    # waits on a kernel in the middle of a run of kernels.
    bwd = Block(
        "bwd",
        (
            gemm("dgrad", 6, deps=(BLOCK_INPUT,)),
            gemm("wgrad", 5, deps=(0,)),
            gemm("wgrad2", 2, deps=(1, BLOCK_INPUT)),
            all_reduce("dp_ar", 9, "dp", deps=(1,)),
        ),
        output=0,
    )
    opt = Block("opt", (Op("adam", OpKind.COMPUTE, "optimizer", flops=2e9, deps=(BLOCK_INPUT,)),))
    program = Program(0, "all")
    f0 = program.add(Call(0, layer=0))
    f1 = program.add(Call(0, inputs=(f0,), layer=1))
    b1 = program.add(Call(1, inputs=(f1,), layer=1))
    b0 = program.add(Call(1, inputs=(b1, f0), layer=0))
    program.add(Call(2, inputs=(b0,)))
    w = workload(RankLayout((("tp", 2), ("dp", 2))), [fwd, bwd, opt], [program])
    sys = system(2, 2)
    traced = AnalyticalCostModel(timeline=True).simulate(w, sys)
    got = sorted((e.name, e.stream, e.start_s, e.end_s) for e in traced.timeline)
    want = sorted(_reference_timeline(w, sys))
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [t for g in got for t in g[2:]] == pytest.approx([t for w in want for t in w[2:]], rel=1e-12)
    (cls,) = traced.classes
    assert (cls.end_s, cls.compute_s, cls.comm_s) == pytest.approx((57 * MS, 48 * MS, 30 * MS), rel=1e-12)
    # Without a timeline, runs of kernels are fused; the figures must not move.
    (fast,) = AnalyticalCostModel().simulate(w, sys).classes
    assert (fast.end_s, fast.compute_s, fast.comm_s, fast.exposed_comm_s) == pytest.approx(
        (cls.end_s, cls.compute_s, cls.comm_s, cls.exposed_comm_s), rel=1e-12
    )
    assert fast.time_by_category == pytest.approx(cls.time_by_category, rel=1e-12)


def _p2p_pair(first: list[Call], second: list[Call]) -> Workload:
    """Two ranks on a pp axis, each its own class. Blocks: 0 send to +1, 1 recv from -1, 2 send to -1,
    3 recv from +1 (2 MB: 2 ms each), 4 a 1 ms compute that waits on its inputs."""

    def p2p(kind: OpKind, peer: int) -> Block:
        deps = (BLOCK_INPUT,) if kind is OpKind.SEND else ()
        return Block(kind.value, (Op(kind.value, kind, kind.value, comm_bytes=2e6, axis="pp", peer=peer, deps=deps),))

    blocks = [
        p2p(OpKind.SEND, 1),
        p2p(OpKind.RECV, -1),
        p2p(OpKind.SEND, -1),
        p2p(OpKind.RECV, 1),
        Block("work", (gemm("work", 1, deps=(BLOCK_INPUT,)),)),
    ]
    programs = [Program(0, "stage0", first), Program(1, "stage1", second)]
    return workload(RankLayout((("pp", 2),)), blocks, programs, class_of=[0, 1])


def test_a_send_and_its_recv_rendezvous():
    # stage0 computes 1 ms, then sends 2 MB (2 ms); stage1 posts its recv at once and computes on arrival.
    w = _p2p_pair(
        [Call(4), Call(0, inputs=(0,), tag=7)],
        [Call(1, tag=7), Call(4, inputs=(0,))],
    )
    result = AnalyticalCostModel(timeline=True).simulate(w, system(2))
    stage0, stage1 = result.classes
    assert stage0.end_s == pytest.approx(3 * MS, rel=1e-12)
    assert stage1.end_s == pytest.approx(4 * MS, rel=1e-12)
    recv = next(e for e in result.timeline if e.rank_class == 1 and e.name == "recv")
    assert (recv.start_s, recv.end_s) == pytest.approx((1 * MS, 3 * MS), rel=1e-12)
    # Waiting for the sender is idle time, not communication.
    assert stage1.comm_s == pytest.approx(2 * MS, rel=1e-12)


def test_crossed_exchanges_do_not_deadlock():
    # Each stage sends first, then receives: the sends park on their stream while the recvs post.
    w = _p2p_pair(
        [Call(0, tag=1), Call(3, tag=2), Call(4, inputs=(1,))],
        [Call(2, tag=2), Call(1, tag=1), Call(4, inputs=(1,))],
    )
    result = AnalyticalCostModel().simulate(w, system(2))
    assert result.step_time_s == pytest.approx(3 * MS, rel=1e-12)


def test_a_recv_without_a_send_is_a_deadlock():
    w = _p2p_pair([Call(4)], [Call(1, tag=3), Call(4)])
    with pytest.raises(RuntimeError, match=r"pipeline deadlock.*unmatched recv"):
        AnalyticalCostModel().simulate(w, system(2))


def test_a_dependency_cycle_is_a_deadlock():
    # Each stage waits for the other's message before it sends its own.
    w = _p2p_pair(
        [Call(3, tag=1), Call(4, inputs=(0,)), Call(0, inputs=(1,), tag=2)],
        [Call(1, tag=2), Call(4, inputs=(0,)), Call(2, inputs=(1,), tag=1)],
    )
    with pytest.raises(RuntimeError, match=r"pipeline deadlock.*'stage0' waits at call 1"):
        AnalyticalCostModel().simulate(w, system(2))


def test_chrome_trace_has_one_complete_event_per_op():
    w = overlapped()
    trace = to_chrome_trace(AnalyticalCostModel(timeline=True).simulate(w, system(2)))
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == 3
    sync = next(e for e in ops if e["name"] == "grad_sync")
    assert (sync["ts"], sync["dur"]) == pytest.approx((0.0, 14000.0), rel=1e-12)
    assert (sync["pid"], sync["cat"]) == (0, "all_reduce")
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[sync["tid"]] == "comm:dp"
    assert sorted(names.values()) == ["comm:dp", "compute"]


def test_without_timeline_no_events_are_kept():
    w = single_block(gemm("a", 1))
    assert AnalyticalCostModel().simulate(w, system(2)).timeline == []


def test_cost_model_contract():
    model: CostModel = AnalyticalCostModel()
    assert model.name == "analytical"
    w = workload(RankLayout((("dp", 4),)), [Block("b", (gemm("a", 1),))], [Program(0, "all", [Call(0)])])
    with pytest.raises(InfeasibleError, match="4 ranks"):
        model.simulate(w, system(2))
