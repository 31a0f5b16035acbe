"""The symbolic generator against closed forms: parameter counts, FLOPs, and Megatron's communication."""

from collections import Counter

import pytest
from helpers import make_point

from dse.modelstats import model_flops, param_count
from dse.workload import Collective, OpKind, expand
from generators.symbolic import SymbolicGenerator, count_parameters
from generators.symbolic.dist import DUP, PARTIAL, ImpossibleRedistribution, Partition, collective_for
from generators.symbolic.schedule import one_f_one_b

GEN = SymbolicGenerator()
DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}


@pytest.mark.parametrize(
    ("model", "official"),
    [("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9), ("gpt3-175b", 174.6e9)],
)
def test_parameter_counts_match_the_published_figures_by_two_paths(model, official):
    point = make_point(model, DGX, seq_len=2048, global_batch=16, tp=8, dp=2)
    graph_count = count_parameters(point)
    assert graph_count == param_count(point.model)
    assert graph_count == pytest.approx(official, rel=0.005)


def step_flops(point) -> float:
    workload = GEN.generate(point)
    total = 0.0
    for program in workload.programs:
        ranks = len(workload.ranks_of(program.rank_class))
        total += ranks * sum(f.op.flops for f in expand(workload, program) if f.op.category != "optimizer")
    return total


@pytest.mark.parametrize(
    ("model", "parallel"),
    [
        ("llama3-8b", {"tp": 2, "pp": 2, "dp": 2, "sp": True}),
        ("llama3-8b", {"tp": 8, "pp": 1, "dp": 2}),
        ("gpt3-175b", {"tp": 8, "pp": 2, "dp": 1, "zero": 1}),
        ("llama3-70b", {"dp": 16, "zero": 3}),
    ],
)
def test_training_flops_match_6NT_plus_attention(model, parallel):
    point = make_point(model, DGX, seq_len=2048, global_batch=32, **parallel)
    n, h, s, layers = param_count(point.model), point.model.hidden, 2048, point.model.layers
    embedding_lookup = point.model.vocab * h if not point.model.tied_embeddings else 0
    if point.model.position == "learned":
        embedding_lookup += point.model.max_seq * h
    tokens = 32 * s
    expected = 6 * (n - embedding_lookup) * tokens + 12 * layers * h * s * tokens
    assert step_flops(point) == pytest.approx(expected, rel=0.02)
    assert model_flops(point.model, point.workload) == pytest.approx(expected, rel=1e-9)


def test_full_recompute_adds_one_forward():
    plain = make_point("tiny-llama", tp=2, dp=4)
    full = make_point("tiny-llama", tp=2, dp=4, recompute="full")
    assert step_flops(full) == pytest.approx(step_flops(plain) * 4 / 3, rel=0.03)


def layer_comm(point, block: str) -> Counter:
    workload = GEN.generate(point)
    ops = next(b for b in workload.blocks if b.name == block).ops
    return Counter((op.category, op.axis, op.comm_bytes) for op in ops if op.kind is OpKind.COLLECTIVE)


def test_tensor_parallel_block_has_two_all_reduces_each_way():
    point = make_point("tiny-llama", micro_batch=2, tp=4, dp=2)
    size = 2 * 256 * 256 * 2  # b * s * h * 2 bytes
    assert layer_comm(point, "layer.forward") == Counter({("all_reduce", "tp", size): 2})
    assert layer_comm(point, "layer.backward") == Counter({("all_reduce", "tp", size): 2})


def test_sequence_parallel_block_has_all_gather_reduce_scatter_pairs():
    point = make_point("tiny-llama", micro_batch=2, tp=4, dp=2, sp=True)
    size = 2 * 256 * 256 * 2
    assert layer_comm(point, "layer.forward") == Counter(
        {("all_gather", "tp", size): 2, ("reduce_scatter", "tp", size): 2}
    )
    # Backward: the adjoint pairs, plus the re-gather of each saved sequence shard (Korthikanti et al. 2022).
    assert layer_comm(point, "layer.backward") == Counter(
        {("all_gather", "tp", size): 4, ("reduce_scatter", "tp", size): 2}
    )


@pytest.mark.parametrize(("zero", "collective"), [(0, "all_reduce"), (1, "reduce_scatter"), (2, "reduce_scatter")])
def test_data_parallel_gradients_are_synchronised_once_per_layer(zero, collective):
    point = make_point("tiny-llama", global_batch=16, tp=2, dp=4, zero=zero)
    workload = GEN.generate(point)
    m = point.model
    # A layer's parameters on one TP rank: the matrices split over tp=2, the two norm weights whole.
    tp_local = (
        m.hidden * m.d_head * (m.heads + 2 * m.n_kv_heads) + m.heads * m.d_head * m.hidden + 3 * m.hidden * m.ffn
    ) / 2 + 2 * m.hidden
    assert layer_comm(point, "layer.grad_sync") == Counter({(collective, "dp", tp_local * 2): 1})
    program = workload.programs[0]
    sync_block = next(i for i, b in enumerate(workload.blocks) if b.name == "layer.grad_sync")
    sync_calls = [c for c in program.calls if c.block == sync_block]
    expected_calls = m.layers * (point.micro_batches if zero >= 2 else 1)
    assert len(sync_calls) == expected_calls


def test_zero3_gathers_parameters_in_forward_and_backward():
    point = make_point("tiny-llama", global_batch=16, dp=8, zero=3)
    fwd = layer_comm(point, "layer.forward.gather")
    bwd = layer_comm(point, "layer.backward")
    gathered = sum(size * n for (cat, _, size), n in fwd.items() if cat == "all_gather")
    regathered = sum(size * n for (cat, _, size), n in layer_comm(point, "layer.backward.gather").items())
    scattered = sum(size * n for (cat, _, size), n in bwd.items() if cat == "reduce_scatter")
    m = point.model
    layer_bytes = 2 * (
        m.hidden * m.d_head * (m.heads + 2 * m.n_kv_heads)
        + m.heads * m.d_head * m.hidden
        + 3 * m.hidden * m.ffn
        + 2 * m.hidden
    )
    assert gathered == pytest.approx(layer_bytes)
    assert regathered == pytest.approx(layer_bytes)
    assert scattered == pytest.approx(layer_bytes)


def test_pipeline_sends_one_activation_per_micro_batch_each_way():
    point = make_point("tiny-llama", global_batch=8, tp=2, pp=2, dp=2, sp=True)
    workload = GEN.generate(point)
    sizes = Counter()
    for program in workload.programs:
        for flat in expand(workload, program):
            if flat.op.kind in (OpKind.SEND, OpKind.RECV):
                sizes[(program.rank_class, flat.op.kind.value, flat.op.comm_bytes)] += 1
    per_rank = 2 * 256 * 256 * 2 / 2  # global micro-batch b = micro_batch * dp; SP shard of the sequence: / tp
    per_rank /= 2  # b is split over dp
    m = point.micro_batches
    assert sizes == Counter(
        {
            (0, "send", per_rank): m,
            (0, "recv", per_rank): m,
            (1, "send", per_rank): m,
            (1, "recv", per_rank): m,
        }
    )


def test_one_f_one_b_keeps_at_most_p_minus_s_micro_batches_in_flight():
    for stage in range(4):
        in_flight = peak = 0
        for step, _ in one_f_one_b(4, stage, 8):
            in_flight += 1 if step == "F" else -1
            peak = max(peak, in_flight)
        assert peak == 4 - stage


def test_generation_is_deterministic():
    point = make_point("tiny-gpt", tp=2, pp=2, dp=2, sp=True, zero=1)
    a, b = GEN.generate(point), GEN.generate(point)
    assert a.blocks == b.blocks
    assert [p.calls for p in a.programs] == [p.calls for p in b.programs]


@pytest.mark.parametrize(
    ("src", "dst", "collective"),
    [
        (PARTIAL, DUP, Collective.ALL_REDUCE),
        (PARTIAL, Partition("s"), Collective.REDUCE_SCATTER),
        (Partition("s"), DUP, Collective.ALL_GATHER),
        (Partition("s"), Partition("h"), Collective.ALL_TO_ALL),
        (DUP, Partition("s"), None),
        (DUP, DUP, None),
    ],
)
def test_matcher_derives_the_collective_from_the_two_layouts(src, dst, collective):
    assert collective_for(src, dst) == collective


def test_matcher_rejects_making_a_partial_sum():
    with pytest.raises(ImpossibleRedistribution):
        collective_for(DUP, PARTIAL)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_schedule_reused_from_a_point_of_the_same_shape_equals_a_fresh_one(schedule):
    from generators.symbolic import skeleton as module

    shape = {"tp": 2, "pp": 2, "dp": 2, "sp": True, "zero": 2, "pp_schedule": schedule}
    seen = make_point("tiny-llama", seq_len=256, global_batch=16, recompute="none", **shape)
    point = make_point("tiny-llama", seq_len=512, global_batch=16, recompute="full", **shape)
    module._SKELETONS.clear()
    fresh = GEN.generate(point)
    module._SKELETONS.clear()
    GEN.generate(seen)
    reused = GEN.generate(point)
    assert len(module._SKELETONS) == 2  # one per stage, filled by `seen`, hit by `point`
    assert reused.blocks == fresh.blocks
    assert [p.calls for p in reused.programs] == [p.calls for p in fresh.programs]
    assert [p.tensors for p in reused.programs] == [p.tensors for p in fresh.programs]


def test_flash_attention_backward_executes_two_and_a_half_forwards():
    """A fused kernel keeps no probabilities, so its backward computes Q K^T again: five s x s matmuls to the
    forward's two (FlashAttention-2's count), while the op's conventional FLOPs stay twice the forward's."""
    point = make_point({"base": "tiny-llama", "flash_attention": True}, dp=8)
    blocks = {b.name: b for b in GEN.generate(point).blocks}
    (fwd,) = [op for op in blocks["layer.forward"].ops if op.category == "attention"]
    (bwd,) = [op for op in blocks["layer.backward"].ops if op.category == "attention"]
    assert bwd.flops == pytest.approx(2 * fwd.flops)
    assert bwd.flops * bwd.density == pytest.approx(2.5 * fwd.flops * fwd.density)


@pytest.mark.parametrize(("dropout", "forward_bytes", "backward_bytes"), [(True, 13, 19), (False, 8, 14)])
def test_unfused_attention_runs_its_kernels_through_hbm(dropout, forward_bytes, backward_bytes):
    """Megatron's attention before fused kernels: Q K^T writes the s x s scores, softmax reads and writes them,
    dropout reads them and writes its output and 1-byte mask, and the product with V reads them: 2 + 4 + 5 + 2 =
    13 bytes per score with dropout, 8 without. Backward: dP written (2), the probabilities read by dV = P^T dO
    (2), dropout's backward (2 + 1 + 2), softmax's (3 x 2), dS read by dQ and by dK (2 + 2): 19, 14 without
    dropout. Every score is computed (the causal mask is applied, not skipped), and the four backward matmuls
    are twice the forward's two."""
    model = {"base": "tiny-llama", "kv_heads": 8, "flash_attention": False, "dropout": dropout}
    point = make_point(model, dp=8)
    blocks = {b.name: b for b in GEN.generate(point).blocks}
    scores = 1 * 256 * 256 * 8  # micro-batch x query x key positions x heads
    head_dim = 256 // 8
    qkv = 1 * 256 * 8 * head_dim * 2  # one [b, s, heads, d] bf16 tensor

    def attention_ops(block: str) -> list:
        return [op for op in blocks[block].ops if op.name.startswith("attention") and op.kind is OpKind.COMPUTE]

    forward, backward = attention_ops("layer.forward"), attention_ops("layer.backward")
    assert len(forward) == (4 if dropout else 3)
    assert len(backward) == (6 if dropout else 5)
    assert all(op.density == 1.0 for op in forward + backward)
    assert sum(op.flops for op in forward if op.category == "gemm") == pytest.approx(2 * scores * 2 * head_dim)
    assert sum(op.flops for op in backward if op.category == "gemm") == pytest.approx(2 * 2 * scores * 2 * head_dim)
    # what is not the traffic of q, k, v, the output and their gradients is the score matrix's
    assert sum(op.bytes for op in forward) - 4 * qkv == pytest.approx(forward_bytes * scores)
    assert sum(op.bytes for op in backward) - 8 * qkv == pytest.approx(backward_bytes * scores)
