"""Every model family of the symbolic generator against published sizes and closed forms: parameter counts (total
and active), training FLOPs, and the communication of expert and context parallelism."""

from collections import Counter

import pytest
from helpers import make_point

from dse.errors import DseError, SpecError
from dse.modelstats import active_param_count, matmul_params, model_flops, param_count
from dse.point.feasibility import infeasibility
from dse.workload import OpKind, expand
from generators.symbolic import SymbolicGenerator, count_parameters

GEN = SymbolicGenerator()
DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}


@pytest.mark.parametrize(
    ("model", "official", "parallel"),
    [
        ("llama3-405b", 405.8e9, {"tp": 8, "dp": 2}),
        ("mixtral-8x7b", 46.7e9, {"tp": 2, "dp": 8, "ep": 8}),
        ("mixtral-8x22b", 141e9, {"tp": 2, "dp": 8, "ep": 4}),
        ("deepseek-v2-lite", 15.7e9, {"tp": 2, "dp": 8, "ep": 8}),
        ("deepseek-v3", 671e9, {"tp": 8, "dp": 2, "ep": 2}),
        ("mamba-2.8b", 2.77e9, {"tp": 2, "dp": 8}),
    ],
)
def test_total_parameters_match_the_published_figure_by_two_paths(model, official, parallel):
    point = make_point(model, DGX, seq_len=1024, global_batch=16, **parallel)
    assert count_parameters(point) == param_count(point.model)
    assert param_count(point.model) == pytest.approx(official, rel=0.005)


@pytest.mark.parametrize(("model", "official"), [("mixtral-8x7b", 12.9e9), ("mixtral-8x22b", 39e9)])
def test_active_parameters_of_mixtral_match_mistral(model, official):
    """Mistral counts every parameter a token touches: attention, top-2 experts, router, both tables."""
    assert active_param_count(make_point(model).model) == pytest.approx(official, rel=0.005)


@pytest.mark.parametrize(("model", "official"), [("deepseek-v3", 37e9), ("deepseek-v2-lite", 2.4e9)])
def test_active_parameters_of_deepseek_match_at_the_published_precision(model, official):
    """DeepSeek publishes two significant digits (37B, 2.4B); the matmul count a token uses (attention, dense
    layers, shared + top-k routed experts, router, LM head; the input lookup excluded) is 36.6e9 and 2.45e9."""
    m = make_point(model).model
    assert matmul_params(m) == pytest.approx(official, rel=0.022)
    assert matmul_params(m) < active_param_count(m) < param_count(m) / 5


def step_flops(point, categories=("gemm", "attention")) -> float:
    workload = GEN.generate(point)
    total = 0.0
    for program in workload.programs:
        ranks = len(workload.ranks_of(program.rank_class))
        total += ranks * sum(f.op.flops for f in expand(workload, program) if f.op.category in categories)
    return total


@pytest.mark.parametrize(
    ("model", "parallel", "categories"),
    [
        ("mixtral-8x7b", {"tp": 2, "dp": 8, "ep": 4, "sp": True}, ("gemm", "attention")),
        ("mixtral-8x22b", {"dp": 8, "pp": 2, "ep": 8, "zero": 1}, ("gemm", "attention")),
        ("deepseek-v2-lite", {"dp": 16, "ep": 8}, ("gemm", "attention")),
        ("deepseek-v3", {"dp": 16, "ep": 16, "zero": 3}, ("gemm", "attention")),
        ("mamba-2.8b", {"tp": 2, "dp": 8}, ("gemm", "attention", "other")),
        ("llama3-405b", {"tp": 8, "dp": 2, "cp": 1}, ("gemm", "attention")),
    ],
)
def test_training_flops_are_6_N_active_T_plus_attention_within_1_percent(model, parallel, categories):
    """No TP for MLA/MoE-router points: their latent projections and router are replicated on TP ranks (real
    redundant work that the analytic count leaves out)."""
    point = make_point(model, DGX, seq_len=2048, global_batch=32, **parallel)
    m, tokens = point.model, 32 * 2048
    n_active = matmul_params(m)
    assert model_flops(m, point.workload) >= 6 * n_active * tokens
    assert step_flops(point, categories) == pytest.approx(model_flops(m, point.workload), rel=0.01)


def test_mixtral_training_flops_follow_active_not_total_parameters():
    point = make_point("mixtral-8x7b", DGX, seq_len=4096, global_batch=16, tp=2, dp=8, ep=8)
    m, tokens = point.model, 16 * 4096
    attention = 12 * m.layers * m.heads * m.d_head * 4096 * tokens
    expected = 6 * (active_param_count(m) - m.vocab * m.hidden) * tokens + attention
    assert step_flops(point) == pytest.approx(expected, rel=0.01)
    assert step_flops(point) < 0.4 * (6 * param_count(m) * tokens)


def comm(point, block: str) -> Counter:
    workload = GEN.generate(point)
    ops = next(b for b in workload.blocks if b.name == block).ops
    return Counter((op.category, op.axis, op.comm_bytes) for op in ops if op.kind is OpKind.COLLECTIVE)


def test_expert_parallel_all_to_all_moves_tokens_times_hidden_times_top_k_each_way():
    point = make_point("tiny-moe", micro_batch=2, global_batch=16, dp=8, ep=4)
    tokens = 2 * 256  # micro-batch x sequence on one rank
    size = tokens * 256 * 2 * 2  # tokens * hidden * top_k * 2 bytes
    fwd = comm(point, "layer.attn.moe.forward")
    bwd = comm(point, "layer.attn.moe.backward")
    assert fwd == Counter({("all_to_all", "ep", size): 2})  # dispatch and combine
    assert bwd == Counter({("all_to_all", "ep", size): 2})  # their adjoints


def test_expert_weights_sync_over_expert_data_parallel_ranks_and_dense_over_all():
    point = make_point("tiny-moe", global_batch=16, dp=8, ep=4)
    m = point.model
    sync = comm(point, "layer.attn.moe.grad_sync")
    experts = m.moe.experts // 4 * 3 * m.hidden * m.moe.expert_ffn * 2
    dense = (m.hidden * m.d_head * (m.heads + 2 * m.n_kv_heads) + m.heads * m.d_head * m.hidden) * 2
    dense += (2 * m.hidden + m.hidden * m.moe.experts) * 2  # two norms and the router
    assert sync == Counter({("all_reduce", "dp", experts): 1, ("all_reduce", "ep+dp", dense): 1})
    workload = GEN.generate(point)
    assert workload.layout.size("ep+dp") == 8 and workload.layout.size("dp") == 2


def test_shared_experts_and_dense_first_layers_of_deepseek():
    point = make_point("tiny-deepseek", global_batch=16, dp=8, ep=2)
    workload = GEN.generate(point)
    names = [b.name for b in workload.blocks]
    assert "layer.mla.dense.forward" in names and "layer.mla.moe.forward" in names
    calls = Counter(workload.blocks[c.block].name for c in workload.programs[0].calls)
    assert calls["layer.mla.dense.forward"] == 1 * point.micro_batches
    assert calls["layer.mla.moe.forward"] == 3 * point.micro_batches
    moe = next(b for b in workload.blocks if b.name == "layer.mla.moe.forward")
    assert {op.name for op in moe.ops} >= {"shared.w1", "experts.w1", "router", "dispatch", "combine", "wq_a"}


def test_context_parallel_attention_gathers_keys_and_values_and_reduce_scatters_their_gradients():
    point = make_point("tiny-llama", micro_batch=2, global_batch=8, cp=4, dp=2)
    kv = 2 * 256 * 4 * 32 * 2  # b * s * kv_heads * head_dim * 2 bytes: the gathered (output) size
    fwd = comm(point, "layer.forward")
    assert fwd == Counter({("all_gather", "cp", kv): 2})
    # Backward gathers the saved K/V shards again and reduce-scatters their gradients (the adjoint).
    bwd = comm(point, "layer.backward")
    assert bwd == Counter({("all_gather", "cp", kv): 2, ("reduce_scatter", "cp", kv): 2})
    # Gradients reduce over every rank whose tokens differ: one all-reduce over dp x cp.
    sync = comm(point, "layer.grad_sync")
    assert [(cat, axis) for cat, axis, _ in sync] == [("all_reduce", "cp+dp")]


def test_context_parallel_attention_flops_are_split_not_duplicated():
    base = step_flops(make_point("tiny-llama", seq_len=512, global_batch=8, dp=8))
    assert step_flops(make_point("tiny-llama", seq_len=512, global_batch=8, cp=4, dp=2)) == pytest.approx(base)


def test_mamba_tensor_parallel_all_reduces_the_small_x_proj_output():
    point = make_point("tiny-mamba", micro_batch=2, global_batch=8, tp=2, dp=4)
    fwd = comm(point, "layer.ssm.none.forward")
    m = point.model
    x_proj = 2 * 256 * (16 + 2 * 16) * 2  # b * s * (dt_rank + 2 N) * 2 bytes
    residual = 2 * 256 * m.hidden * 2
    assert fwd == Counter({("all_reduce", "tp", x_proj): 1, ("all_reduce", "tp", residual): 1})


def test_hybrid_stack_interleaves_attention_and_ssm_layers():
    point = make_point("tiny-hybrid", global_batch=8, tp=2, dp=4)
    workload = GEN.generate(point)
    order = [workload.blocks[c.block].name for c in workload.programs[0].calls if c.microbatch == 0]
    forward = [n for n in order if n.startswith("layer") and n.endswith("forward")]
    assert forward == ["layer.ssm.dense.forward"] * 3 + ["layer.forward"] + ["layer.ssm.dense.forward"] * 3 + [
        "layer.forward"
    ]


def test_family_sections_are_required_and_unsupported_combinations_are_named():
    with pytest.raises(SpecError, match="moe"):
        make_point({"base": "tiny-llama", "family": "mixtral"})
    assert "ep" in infeasibility(make_point("tiny-llama", dp=8, ep=2))
    assert "moe.experts" in infeasibility(make_point("tiny-moe", dp=8, ep=8, overrides={"model.moe.experts": 6}))
    assert "virtual_stages" in infeasibility(make_point("tiny-llama", dp=4, pp=2, virtual_stages=2))
    assert issubclass(SpecError, DseError)


def test_attention_models_must_name_their_heads():
    with pytest.raises(SpecError, match="needs 'heads'"):
        make_point(
            {
                "name": "x",
                "family": "llama",
                "layers": 2,
                "hidden": 64,
                "ffn": 128,
                "vocab": 10,
                "norm": "rmsnorm",
                "activation": "swiglu",
            }
        )


def test_expert_parallel_with_sequence_parallel_moves_each_ranks_own_shard():
    """Megatron's all-to-all dispatcher with TP+SP: all-to-all of the rank's sequence shard over ep, then the
    k copies all-gathered over tp for the TP-split experts; on the way back reduce-scatter over tp, then
    all-to-all."""
    point = make_point("tiny-moe", global_batch=8, tp=2, sp=True, dp=4, ep=2)
    shard = 256 // 2 * 256 * 2 * 2  # (s / tp) tokens * hidden * top_k * 2 bytes
    fwd = comm(point, "layer.attn.moe.forward")
    assert fwd[("all_to_all", "ep", shard)] == 2
    assert fwd[("all_gather", "tp", 2 * shard)] == 1 and fwd[("reduce_scatter", "tp", 2 * shard)] == 1


def test_shared_experts_under_sequence_parallelism_reduce_scatter_onto_the_ranks_own_shard():
    """DeepSeek's MoE with TP+SP: the routed tokens come back sequence-split (reduce-scatter over tp, then the
    all-to-all); the shared experts are a dense MLP that gathers the sequence and reduce-scatters its tp
    partial sums onto the rank's shard, as the dense first layer's MLP does, and the two add up there."""
    point = make_point("tiny-deepseek", global_batch=8, tp=2, sp=True, dp=4, ep=2)
    dense, moe = comm(point, "layer.mla.dense.forward"), comm(point, "layer.mla.moe.forward")
    full = 256 * 256 * 2  # the micro-batch's s x h activations in bf16, gathered and reduce-scattered under SP
    shard = 256 // 2 * 256 * 4 * 2  # (s / tp) tokens * hidden * top_k * 2 bytes
    routed = Counter({("all_to_all", "ep", shard): 2, ("all_gather", "tp", 2 * shard): 1})
    routed[("reduce_scatter", "tp", 2 * shard)] = 1
    assert moe - dense == routed
    assert moe[("all_gather", "tp", full)] == dense[("all_gather", "tp", full)] == 1
    assert moe[("reduce_scatter", "tp", full)] == dense[("reduce_scatter", "tp", full)] == 2
