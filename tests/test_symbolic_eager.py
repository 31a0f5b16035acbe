"""Eager kernels (`workload.kernels: eager`) against closed forms from the reference Llama code and PyTorch's
autograd formulas (derivatives.yaml), one kernel per aten op.

tiny-llama: hidden h 256, 8 heads and 4 kv heads of 64, SwiGLU width f 688, RMSNorm; one sequence of 256 tokens
on one GPU, so T = 256 tokens, N = T h, Mq = T n d and Mk = T g d the query and key elements, F = T f.

RMSNorm, `(x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight`, bf16 x:
forward, bytes read + written: float 2N + 4N, pow 4N + 4N, mean 4N + 4T, add eps 4T + 4T, rsqrt 4T + 4T, mul
4N + 4T + 4N, type_as 4N + 2N, weight mul 2N + 2h + 2N: 36N + 24T + 2h in 8 kernels. Backward: weight mul (input:
grad * weight 2N + 2h + 2N; weight: grad * normed 2N + 2N + 2N, summed over tokens 2N + 2h), type_as 2N + 4N, mul
(x: grad * r 4N + 4T + 4N; r: grad * x 4N + 4N + 4N, summed over h 4N + 4T), rsqrt (-0.5 * grad * result.pow(3):
three kernels of 8T, 8T, 12T), mean (expand and divide, 4T + 4N), pow (grad * (2 * x.pow(1)): 8N, 8N, 12N), the
two gradients of the fp32 x summed (12N), float 4N + 2N: 92N + 40T + 4h in 16 kernels.

RoPE (complex, torchtitan's apply_rotary_emb) per tensor of M elements: float 2M + 4M, complex multiply 4M + 4M,
type_as 4M + 2M = 20M in 3 kernels, and the same backward. SwiGLU, F.silu(w1 x) * w3 x: silu 2F + 2F, product
4F + 2F = 10F in 2 kernels; backward silu_backward 6F, the product's two gradients 6F each = 18F in 3 kernels.
GQA's repeat_kv copies Mk elements to Mq (2Mk + 2Mq), and its backward sums them back (2Mq + 2Mk).
"""

import pytest

from dse.workload import OpKind
from generators.symbolic.generator import _Builder
from tests.helpers import make_point

T, H, HEADS, KV, D, F = 256, 256, 8, 4, 32, 688
N, MQ, MK, FF = T * H, T * HEADS * D, T * KV * D, T * F


def _layer(kernels: str = "eager", **parallel):
    point = make_point(seq_len=T, global_batch=1, overrides={"workload.kernels": kernels}, **parallel)
    builder = _Builder(point)
    builder.build()
    (traced,) = builder.layer_traces.values()
    return builder, traced


def _ops(prefix: str, block) -> list:
    return [op for op in block.ops if op.kind is OpKind.COMPUTE and op.name.startswith(prefix)]


@pytest.mark.parametrize(
    ("prefix", "forward", "backward"),
    [
        ("ln1.", (36 * N + 24 * T + 2 * H, 8), (92 * N + 40 * T + 4 * H, 16)),
        ("ln2.", (36 * N + 24 * T + 2 * H, 8), (92 * N + 40 * T + 4 * H, 16)),
        ("rope_q.", (20 * MQ, 3), (20 * MQ, 3)),
        ("rope_k.", (20 * MK, 3), (20 * MK, 3)),
        ("swiglu.", (10 * FF, 2), (18 * FF, 3)),
        ("repeat_k", (2 * MK + 2 * MQ, 1), (2 * MQ + 2 * MK, 1)),
        ("repeat_v", (2 * MK + 2 * MQ, 1), (2 * MQ + 2 * MK, 1)),
    ],
)
def test_eager_kernels_move_the_bytes_of_the_reference_code_one_kernel_per_op(prefix, forward, backward):
    builder, traced = _layer()
    for block, (nbytes, kernels) in ((traced.forward, forward), (traced.backward, backward)):
        ops = _ops(prefix, builder.blocks[block])
        assert len(ops) == kernels
        assert sum(op.bytes for op in ops) == nbytes


def test_eager_rmsnorm_flops_count_one_per_element_per_arithmetic_op():
    """pow, mean and the two products over N elements, add eps and rsqrt over T; the casts compute nothing."""
    builder, traced = _layer()
    assert sum(op.flops for op in _ops("ln1.", builder.blocks[traced.forward])) == 4 * N + 2 * T


def test_eager_and_fused_run_the_same_matmuls_and_attention():
    eager_builder, eager = _layer("eager")
    fused_builder, fused = _layer("fused")
    for category in ("gemm", "attention"):
        for way in ("forward", "backward"):
            e = eager_builder.blocks[getattr(eager, way)].ops
            f = fused_builder.blocks[getattr(fused, way)].ops
            assert sum(op.flops for op in e if op.category == category) == sum(
                op.flops for op in f if op.category == category
            )


def test_fused_norm_and_activation_stay_one_kernel_each():
    builder, traced = _layer("fused")
    forward = builder.blocks[traced.forward]
    assert [op.name for op in _ops("ln1", forward)] == ["ln1"]
    assert [op.name for op in _ops("swiglu", forward)] == ["swiglu"]
    assert not _ops("repeat_", forward)


def test_eager_autograd_keeps_the_fp32_norm_inputs_and_the_silu_output():
    """Fused, a layer keeps x and x1 (the norms' inputs, 2N each), h1 and h2 (2N each), q and k after RoPE
    (2Mq + 2Mk; the fused RoPE keeps nothing of its input: TransformerEngine's FusedRoPEFunc saves the table
    alone), v and the attention output (2Mk + 2Mq), gate, up and their product (6F): 14N + 6F.
    Eager keeps the fp32 x and x1 (4N each) with the reciprocal roots (4T each) and the bf16 normalised values
    (2N each) instead of x and x1, h1 and h2, nothing for RoPE, q, the repeated k and v and the output (8Mq), and
    silu's output besides gate, up and the product (8F): 24N + 8F + 8T. The difference is 10N + 2F + 8T."""
    _, eager = _layer("eager")
    _, fused = _layer("fused")
    assert fused.saved_bytes == 14 * N + 6 * FF
    assert eager.saved_bytes == 24 * N + 8 * FF + 8 * T


def test_full_recompute_keeps_only_the_layer_input_eager_too():
    _, traced = _layer("eager", recompute="full")
    assert traced.saved_bytes == 2 * N


def test_eager_full_recompute_replays_every_eager_kernel():
    """Full recompute runs the forward again in backward: the backward block holds the forward's kernels too."""
    builder, plain = _layer("eager")
    recompute_builder, recomputed = _layer("eager", recompute="full")
    forward = builder.blocks[plain.forward].ops
    extra = len(recompute_builder.blocks[recomputed.backward].ops) - len(builder.blocks[plain.backward].ops)
    assert extra == len(forward)


def _collectives(kernels: str, **parallel) -> dict[str, float]:
    point = make_point(seq_len=T, global_batch=8, overrides={"workload.kernels": kernels}, **parallel)
    builder = _Builder(point)
    builder.build()
    totals: dict[str, float] = {}
    for block in builder.blocks:
        for op in block.ops:
            if op.is_comm:
                key = f"{op.category}@{op.axis}"
                totals[key] = totals.get(key, 0.0) + op.comm_bytes
    return totals


@pytest.mark.parametrize("parallel", [{"tp": 2, "sp": True, "dp": 4}, {"tp": 2, "dp": 4}, {"dp": 8, "zero": 3}])
def test_eager_kernels_leave_the_communication_as_it_is(parallel):
    """Decomposing elementwise work changes local kernels only: the TP all-reduces and SP reduce-scatters, the
    norm weights' gradient reduction and the ZeRO-3 gathers are the fused ones."""
    assert _collectives("eager", **parallel) == _collectives("fused", **parallel)


def test_eager_context_parallelism_moves_the_repeated_keys_and_values():
    """Eager SDPA receives K and V already repeated to every query head, so the cp gathers (and their gradients'
    reduce-scatters) carry heads / kv_heads = 2 times the fused bytes; everything else is unchanged."""
    parallel = {"cp": 2, "tp": 2, "dp": 2}
    eager, fused = _collectives("eager", **parallel), _collectives("fused", **parallel)
    assert eager.keys() == fused.keys() >= {"all_gather@cp", "reduce_scatter@cp"}
    for key, nbytes in fused.items():
        assert eager[key] == (HEADS // KV * nbytes if key.endswith("@cp") else nbytes)


def _real_rope_layer():
    point = make_point(seq_len=T, global_batch=1, overrides={"workload.kernels": "eager", "model.rope_impl": "real"})
    builder = _Builder(point)
    builder.build()
    (traced,) = builder.layer_traces.values()
    return builder, traced


TABLE = T * (D // 2) * 2 * 2 * 4
"""fms's rotation table indexed by position: [T, d/2, 2, 2] fp32."""


@pytest.mark.parametrize(("prefix", "m"), [("rope_q.", MQ), ("rope_k.", MK)])
def test_fms_real_rope_moves_the_bytes_of_its_broadcast_rotation(prefix, m):
    """fms's adjusted_qk per tensor of M elements: q.float() 2M + 4M; freqs.mul(q_.unsqueeze(-2)) reads 4M and
    the table, writes the [.., d/2, 2, 2] product 8M; .sum(5) 8M + 4M; type_as 4M + 2M: 36M and the table in 4
    kernels. Backward: type_as 2M + 4M, sum's expand a view, the product's gradient (expanded gradient 4M, the
    table, 8M out) and its sum_to_size (8M + 4M), float 4M + 2M: again 36M and the table, in 4 kernels."""
    builder, traced = _real_rope_layer()
    for block in (traced.forward, traced.backward):
        ops = _ops(prefix, builder.blocks[block])
        assert len(ops) == 4
        assert sum(op.bytes for op in ops) == 36 * m + TABLE


def test_fms_real_rope_gathers_one_table_per_layer_and_keeps_it_for_backward():
    """position_ids index the cached table once per attention call (8-byte ids in, the fp32 rows read and written
    out); the product's backward reads the table, so autograd keeps it: the only saved bytes the complex RoPE
    lacks."""
    builder, traced = _real_rope_layer()
    gathers = _ops("rope.freqs", builder.blocks[traced.forward])
    assert [op.bytes for op in gathers] == [8 * T + 2 * TABLE]
    assert not _ops("rope.freqs", builder.blocks[traced.backward])
    _, complex_rope = _layer()
    assert traced.saved_bytes - complex_rope.saved_bytes == TABLE


def test_compiled_checkpointing_drops_the_mlp_output_its_backward_never_reads():
    """torchtitan's per-op policy saves w2's output. Eager checkpointing replays the whole layer in backward, the
    final residual add included, and so keeps it; a compiled backward recomputes only what it reads, and the
    residual add's gradient reads no values: w2's output (T h bf16) is neither kept nor the add recomputed. Every
    other eager intermediate is recomputed under this policy, so that output is the whole difference."""
    eager_builder, eager = _layer("eager", recompute="selective_op")
    fused_builder, fused = _layer("fused", recompute="selective_op")
    assert eager.saved_bytes - fused.saved_bytes == 2 * T * H

    def recomputed(builder, traced) -> set[str]:
        return {op.name for op in builder.blocks[traced.backward].ops if op.name.endswith(".recompute")}

    assert "residual2.recompute" in recomputed(eager_builder, eager)
    assert "residual2.recompute" not in recomputed(fused_builder, fused)
