"""Ring-attention context parallelism: K/V chunks passed around the cp ring beside the attention of the chunk held."""

import pytest
from helpers import make_point
from test_chakra import p2p_ends

from dse.point import chakra
from dse.point.feasibility import infeasibility
from dse.workload import OpKind
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel

GEN = SymbolicGenerator()
DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}
S = 512


def point(cp: int, algorithm: str = "ring", recompute: str = "none", **kw):
    parallel = dict(tp=2, cp=cp, dp=8 // (2 * cp), recompute=recompute, cp_algorithm=algorithm) | kw
    return make_point("tiny-llama", seq_len=S, global_batch=8, micro_batch=2, **parallel)


def block(workload, name: str):
    return next(b for b in workload.blocks if b.name == name)


def sent(workload, name: str) -> float:
    return sum(op.comm_bytes for op in block(workload, name).ops if op.kind is OpKind.SEND)


def kv_chunk_bytes(p) -> float:
    """K plus V held by one rank: micro-batch x s/cp tokens x kv heads/tp x head dim, bf16."""
    m = p.model
    return 2 * p.workload.micro_batch * S / p.parallel.cp * m.n_kv_heads / p.parallel.tp * m.d_head * 2


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_sends_cp_minus_1_kv_chunks_forward_and_twice_that_backward(cp):
    """Forward: cp - 1 steps each pass the K/V chunk held on. Backward: the chunks go round again the other way
    (cp - 1 hops, re-sent rather than kept) and each chunk's dK/dV goes back towards its owner (cp - 1 hops)."""
    p = point(cp)
    workload = GEN.generate(p)
    chunk = kv_chunk_bytes(p)
    assert sent(workload, "layer.forward") == pytest.approx((cp - 1) * chunk)
    assert sent(workload, "layer.backward") == pytest.approx(2 * (cp - 1) * chunk)
    recv = sum(op.comm_bytes for op in block(workload, "layer.forward").ops if op.kind is OpKind.RECV)
    assert recv == sent(workload, "layer.forward")
    for name in ("layer.forward", "layer.backward"):
        assert not [op for op in block(workload, name).ops if op.kind is OpKind.COLLECTIVE and op.axis == "cp"]


def test_full_recompute_replays_the_forward_ring_instead_of_sending_the_chunks_back():
    """Recomputing the layer passes the chunks round again (cp - 1 hops), and backward reads those; the dK/dV
    still go back (cp - 1 hops)."""
    p = point(4, recompute="full")
    assert sent(GEN.generate(p), "layer.backward") == pytest.approx((3 + 3) * kv_chunk_bytes(p))


def test_attention_flops_and_saved_activations_equal_the_allgather_variant():
    """Every step attends s/cp queries to s/cp keys, half of them masked under the zigzag split: cp steps make the
    all-gather variant's s/cp x s causal block. Only the own K/V chunk is kept for backward, as the all-gather
    variant keeps its pre-gather shard."""

    def attention(workload, name):
        ops = [op for op in block(workload, name).ops if op.category == "attention"]
        return sum(op.flops for op in ops), sum(op.flops * op.density for op in ops)

    ring, gather = GEN.generate(point(4)), GEN.generate(point(4, "allgather"))
    steps = [op for op in block(ring, "layer.forward").ops if op.category == "attention"]
    assert len(steps) == 4 and {op.density for op in steps} == {0.5}
    for name in ("layer.forward", "layer.backward"):
        assert attention(ring, name) == pytest.approx(attention(gather, name))
    saved = [next(t.bytes for t in w.programs[0].tensors if t.name == "layer0") for w in (ring, gather)]
    assert saved[0] == saved[1]


def test_the_transfer_of_the_next_chunk_runs_beside_the_current_step():
    ops = block(GEN.generate(point(4)), "layer.forward").ops
    index = {op.name: i for i, op in enumerate(ops)}
    step1 = ops[index["attention.step1"]]
    received = {i for i in step1.deps if ops[i].kind is OpKind.RECV}
    assert received and index["attention.step0"] not in step1.deps
    # the sends for step 2 forward what step 1 reads, without waiting for step 1's compute
    forwards = [op for op in ops if op.kind is OpKind.SEND and set(op.deps) & received]
    assert len(forwards) == 2 and all(len(op.deps) == 1 for op in forwards)


@pytest.mark.parametrize("pp", [1, 2])
def test_the_engine_pairs_the_ring_and_the_fast_path_agrees(pp):
    p = point(2, pp=pp, dp=1, system=DGX) if pp > 1 else point(2, system=DGX)
    workload = GEN.generate(p)
    fast = AnalyticalCostModel().simulate(workload, p.system)
    exact = AnalyticalCostModel(exact=True).simulate(workload, p.system)
    assert fast.step_time_s == pytest.approx(exact.step_time_s, rel=1e-2)
    assert exact.step_time_s > 0


def test_chakra_sends_and_receives_pair_up_each_under_a_tag_of_its_own(tmp_path):
    """Ring steps of every layer and micro-batch, and pipeline transfers beside them: each send has its receive,
    and no (source, destination, tag) is used twice in the step, so ASTRA-sim cannot pair a step with another."""
    p = point(4, pp=2, dp=1, system=DGX)
    workload = GEN.generate(p)
    paths = chakra.export(workload, tmp_path / "ring", [d.npus for d in p.system.network])
    sends, recvs = p2p_ends(paths)
    assert sends and sends == recvs
    assert set(sends.values()) == {1}
    stride = p.parallel.tp  # cp neighbours are tp ranks apart, the last wrapping to the first
    ring = {(dst - src) % (stride * 4) for src, dst, _, _ in sends if abs(dst - src) < stride * 4}
    assert ring == {stride, 3 * stride}
    pipeline = sum(abs(dst - src) == stride * 4 for src, dst, _, _ in sends)  # stages are tp x cp = 8 ranks apart
    assert pipeline == 8 * 2 * p.micro_batches  # each of a stage's 8 ranks, both ways, every micro-batch


def test_ring_needs_two_chunks_per_rank():
    assert "2*parallel.cp" in infeasibility(make_point("tiny-llama", seq_len=24, cp=8, cp_algorithm="ring"))


@pytest.mark.parametrize(("tp", "crosses_nodes"), [(2, False), (4, True)])
def test_a_ring_step_lasts_as_long_as_its_slowest_hop(tp, crosses_nodes):
    """Four cp ranks tp apart on 8-GPU nodes: with tp 2 the ring stays on NVLink; with tp 4 it holds two ranks per
    node, and two of its four hops cross InfiniBand, the representative's own hop (cp rank 0 to 1) not among them.
    Every rank shifts its chunk at once, so each step is priced at the InfiniBand hop."""
    from simulators.analytical.pricing import BlockPricer

    p = point(4, tp=tp, dp=1, system=DGX)
    workload = GEN.generate(p)
    pricer = BlockPricer(workload, p.system)
    forward = workload.blocks.index(block(workload, "layer.forward"))
    priced = zip(workload.blocks[forward].ops, pricer.durations(forward, 0), strict=True)
    sends = [(op, seconds) for op, seconds in priced if op.kind is OpKind.SEND]
    nvlink, infiniband = p.system.network
    link = infiniband if crosses_nodes else nvlink
    assert sends and all(s == pytest.approx(op.comm_bytes / link.bandwidth + link.latency) for op, s in sends)
    assert pricer.representative(0) == 0
    assert pricer.p2p_dim("cp", 1, 0) == 0, "the representative's own hop stays on NVLink either way"
