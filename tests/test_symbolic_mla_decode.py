"""MLA inference: the cache holds the compressed latent and the RoPE key; decode attends over it absorbed."""

import pytest
from helpers import make_point

from dse import plugins
from dse.point.evaluate import evaluate
from dse.workload import TensorKind, expand
from generators.symbolic import SymbolicGenerator

GEN = SymbolicGenerator()
COST = plugins.cost_model("analytical")
CONTEXT = 4096


def decode_point(model: str = "deepseek-v3", mode: str = "decode", tp: int = 1):
    return make_point(model, seq_len=CONTEXT, global_batch=16, tp=tp, dp=8 // tp, overrides={"workload.mode": mode})


def cache_bytes(workload) -> float:
    return sum(t.bytes for t in workload.programs[0].tensors if t.kind is TensorKind.KV_CACHE)


def attention_op(workload):
    block = next(b for b in workload.blocks if b.name == "layer.mla.dense.forward")
    return next(op for op in block.ops if op.category == "attention")


def test_deepseek_v3_caches_1152_bytes_per_token_per_layer():
    """DeepSeek-V2 sec. 2.1.3: (d_c + d_h^R) = 512 + 64 elements per token per layer, 2 bytes each in bf16."""
    point = decode_point()
    m, w = point.model, point.workload
    sequences = w.micro_batch * point.micro_batches  # on one DP rank
    assert cache_bytes(GEN.generate(point)) == pytest.approx(m.layers * sequences * CONTEXT * (512 + 64) * 2)


def test_decode_reads_the_latent_cache_once_with_absorbed_queries():
    """One new token per sequence: the query in latent space ([n, 512 + 64] per token) scores the cache and the
    values are the cached latents themselves, so the kernel reads t x 1152 bytes per sequence, not the per-head
    K and V (t x n x (192 + 128) x 2 bytes). FLOPs: QK^T over 576 channels and PV over 512, per head."""
    for tp in (1, 2):
        point = decode_point(tp=tp)
        n = point.model.heads // tp
        b = point.workload.micro_batch
        op = attention_op(GEN.generate(point))
        cache_read = b * CONTEXT * 1152
        q_and_out = b * n * (576 + 512) * 2
        assert op.bytes == pytest.approx(cache_read + q_and_out)
        assert op.flops == pytest.approx(2 * b * CONTEXT * n * (576 + 512))


def test_decode_absorbs_the_up_projections_into_query_and_output():
    point = decode_point("tiny-deepseek", tp=2)
    a, n, b = point.model.mla, point.model.heads // 2, point.workload.micro_batch
    block = next(x for x in GEN.generate(point).blocks if x.name == "layer.mla.dense.forward")
    flops = {op.name: op.flops for op in block.ops}
    assert flops["q_absorb"] == 2 * b * n * a.qk_nope_head_dim * a.kv_lora_rank
    assert flops["o_absorb"] == 2 * b * n * a.kv_lora_rank * a.v_head_dim
    assert "wk_b" not in flops and "wv_b" not in flops


def test_prefill_writes_the_same_cache_and_runs():
    prefill, decode = decode_point("tiny-deepseek", "prefill"), decode_point("tiny-deepseek")
    written, read = GEN.generate(prefill), GEN.generate(decode)
    assert cache_bytes(written) == cache_bytes(read) > 0
    names = {f.op.name for f in expand(written, written.programs[0])}
    assert {"wk_b", "wv_b", "kv_latent_cache.write"} <= names
    for point in (prefill, decode):
        assert evaluate(point, GEN, COST).metrics["step_time_s"] > 0
