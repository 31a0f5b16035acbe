"""Hugging Face architectures built from their config classes (generators/fx/models/hf.py): the spec's fields reach
the config (parameter counts by hand), and a block of each of two unlike layouts captures at tp 1 with one
mask-free causal attention op each way and the GEMM FLOPs of the hand formula. Blocks of Gemma 2 and 3 (norms after
each branch) and Falcon (tuples out, list indexing, a parallel block) split at tp 2 with sp; DeepSeek-V3's latent
attention splits as the symbolic generator prices it and is described as the catalog has it; a decoding block's
cache is as wide as its attention writes; whole steps of Falcon and DeepSeek-V3 at tp 2 with sp have the symbolic
generator's GEMMs and parameters. Every tested architecture through the whole fx generator (the ends, decode,
tp 2): benchmarks/fx_hf_archs.py."""

import tomllib
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers import make_point

from generators.fx.capture import capture_layer
from generators.fx.lower import lower_backward, lower_forward
from generators.fx.models import hf
from generators.fx.plans import PlanError

ROOT = Path(__file__).resolve().parent.parent
V, H, L, HEADS, KV, D, FFN, E, EFFN = 512, 64, 2, 4, 2, 16, 128, 4, 32
SEQ, BATCH = 64, 2
TINY = {"layers": L, "hidden": H, "heads": HEADS, "kv_heads": KV, "head_dim": D, "ffn": FFN, "vocab": V}
MOE = {"base": "tiny-moe", "moe": {"experts": E, "top_k": 2, "expert_ffn": EFFN}}
MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}


def tiny(model_type: str) -> dict:
    """The tiny spec of an architecture: GQA 4/2 heads of 16 (MHA where the config has no key/value heads, MLA and
    a dense first layer for DeepSeek-V3), SwiGLU 128 or 4 experts of 32."""
    fields = {"base": "tiny-llama", **TINY, "fx_factory": f"generators.fx.models.hf:{model_type}"}
    if model_type in ("mixtral", "qwen3_moe", "deepseek_v3"):
        fields |= MOE
    if model_type == "gpt_neox":
        fields["kv_heads"] = HEADS
    if model_type == "deepseek_v3":
        fields |= {"family": "deepseek", "mla": MLA, "kv_heads": None, "head_dim": None}
        fields["moe"] = MOE["moe"] | {"shared_experts": 1, "first_dense_layers": 1}
    return fields


def point(model_type: str):
    return make_point(tiny(model_type), seq_len=SEQ, global_batch=2 * BATCH, micro_batch=BATCH)


EMBEDDINGS = 2 * V * H
GQA = H * HEADS * D + 2 * H * KV * D + HEADS * D * H
"""q, k, v, o weights: 12288."""
NORMS = 2 * H
LLAMA = EMBEDDINGS + L * (GQA + 3 * H * FFN + NORMS) + H
MIXTRAL = EMBEDDINGS + L * (GQA + E * H + E * 3 * H * EFFN + NORMS) + H
GEMMA2 = LLAMA - V * H + L * 2 * H
"""tied embeddings; norms before and after each branch."""
NEOX_LAYER = (3 * H * H + 3 * H) + (H * H + H) + (H * FFN + FFN + FFN * H + H) + 2 * NORMS
"""MHA fused qkv and dense with biases; GeLU MLP with biases; two LayerNorms with biases."""
FALCON_LAYER = H * (HEADS + 2 * KV) * D + H * H + 2 * H * FFN + 2 * NORMS
"""Falcon-40B's layout (GQA): fused qkv, two LayerNorms in parallel, no biases."""
MLA_WEIGHTS = H * 48 + 48 + 48 * HEADS * 24 + H * (32 + 8) + 32 + 32 * HEADS * (16 + 16) + HEADS * 16 * H
"""q down, its norm, q up (nope + rope dims), kv down with the shared rope key, its norm, kv up (nope + v), o."""
DEEPSEEK_MOE = E * H + (E + 1) * 3 * H * EFFN
"""the router (its score-correction bias is a buffer), 4 routed experts and 1 shared."""
PARAMETERS = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "phi3": LLAMA,  # q, k, v and gate, up fused: the same weights
    "qwen2": LLAMA + L * (HEADS + 2 * KV) * D,  # q, k, v biases
    "qwen3": LLAMA + L * 2 * D,  # q and k norms over a head
    "gemma": LLAMA - V * H,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA2 + L * 2 * D,
    "gpt_neox": EMBEDDINGS + L * NEOX_LAYER + 2 * H,
    "falcon": V * H + L * FALCON_LAYER + 2 * H,
    "mixtral": MIXTRAL,
    "qwen3_moe": MIXTRAL + L * 2 * D,
    "deepseek_v3": EMBEDDINGS + 2 * (MLA_WEIGHTS + NORMS) + 3 * H * FFN + DEEPSEEK_MOE + H,
}


def built(model_type: str):
    import torch

    p = point(model_type)
    with torch.device("meta"):
        return getattr(hf, model_type)(p.model, p.workload)


@pytest.mark.parametrize("model_type", [*hf.ARCHITECTURES, "falcon"])
def test_the_spec_reaches_the_config(model_type) -> None:
    """Built on meta from the config class, the spec's widths written over its defaults: the parameter count by
    hand; the attention the registered mask-free causal one (Falcon's own SDPA call made mask-free)."""
    module = built(model_type)
    assert all(p.is_meta for p in module.parameters())
    assert sum(p.numel() for p in module.parameters()) == PARAMETERS[model_type]
    assert len(module.layers) == L
    assert module.hf.config._attn_implementation == hf.CAUSAL_ATTENTION


def test_unset_fields_are_the_config_classes() -> None:
    """A field the spec leaves out is the architecture's default: Qwen3's head_dim 128, whatever hidden / heads is."""
    fields = {k: v for k, v in tiny("qwen3").items() if k != "head_dim"}
    p = make_point(fields, seq_len=SEQ)
    assert "head_dim" not in p.model.model_fields_set
    config = hf.hf_config("qwen3", p.model, p.workload)
    assert (config.head_dim, config.hidden_size, config.max_position_embeddings) == (128, H, SEQ)


def test_what_cannot_be_built_is_refused_in_one_line() -> None:
    p = point("gpt_neox")
    gqa = p.model.model_copy(update={"kv_heads": KV})
    gqa.model_fields_set.add("kv_heads")
    with pytest.raises(ValueError, match=r"field 'model.kv_heads': GPTNeoXConfig has no num_key_value_heads"):
        hf.hf_config("gpt_neox", gqa, p.workload)
    with pytest.raises(ValueError, match="model type 't5' has no decoder-only causal LM"):
        hf.hf_config("t5", p.model, p.workload)
    with pytest.raises(ValueError, match="model type 'my_remote_model' is not in the installed transformers"):
        hf.hf_config("my_remote_model", p.model, p.workload)
    with pytest.raises(AttributeError, match="not a transformers model type"):
        hf.not_a_model_type  # noqa: B018


def test_the_registered_factories_are_the_tested_architectures() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["dse.fx_models"]
    registered = {name: target for name, target in declared.items() if name.startswith("hf-")}
    assert registered == {f"hf-{t.replace('_', '-')}": f"generators.fx.models.hf:{t}" for t in hf.ARCHITECTURES}


LAYER_MATMULS = {"phi3": GQA + 3 * H * FFN, "gpt_neox": 4 * H * H + 2 * H * FFN}
"""A block's matrix weights: Phi-3's fused qkv and gate-up; GPT-NeoX's MHA and GeLU MLP (partial rotary, parallel
residual, biases). The other architectures: benchmarks/fx_hf_archs.py."""


@pytest.mark.parametrize("model_type", sorted(LAYER_MATMULS))
def test_a_block_captures_with_fused_attention_and_the_hand_formulas_flops(model_type) -> None:
    """Trained at tp 1: forward GEMMs 2 x tokens x the block's matrix weights, backward twice that; attention one
    causal op each way; no mask among the block's inputs (a [batch, 1, seq, seq] tensor)."""
    p = point(model_type)
    factory = getattr(hf, model_type)
    captured = capture_layer(factory, model_type, p.model, p.workload, tp=1, dp=1, sp=False)
    forward = lower_forward(captured.forward, "f", captured.axes, captured.input_shape, True).block
    backward = lower_backward(captured.backward, captured.forward, "b", captured.axes, captured.input_shape, True)
    tokens = BATCH * SEQ
    for block, factor in ((forward, 2), (backward.block, 4)):
        assert sum(op.flops for op in block.ops if op.category == "gemm") == factor * tokens * LAYER_MATMULS[model_type]
        (attention,) = [op for op in block.ops if op.category == "attention"]
        assert attention.attention is not None and attention.attention.causal
    inputs = [n.meta["val"] for n in captured.forward.graph.nodes if n.op == "placeholder"]
    assert not any(t.dim() == 4 and t.shape[-2:] == (SEQ, SEQ) for t in inputs if hasattr(t, "dim"))
    assert captured.parameters == PARAMETERS[model_type]


def test_the_eager_attention_is_causal_sdpa_materialised() -> None:
    """`model.flash_attention: false`: the eager scores and probabilities, masked causally from the shapes (no mask
    input), give what causal SDPA gives over grouped-query heads with the architecture's scaling; both return
    [batch, seq, heads, head_dim]."""
    import torch

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    eager, probabilities = hf.eager_causal_attention(torch.nn.Module(), q, k, v, None, scaling=0.3)
    fused, _ = hf.causal_attention(torch.nn.Module(), q, k, v, None, scaling=0.3)
    torch.testing.assert_close(eager, expected.transpose(1, 2))
    torch.testing.assert_close(fused, expected.transpose(1, 2))
    assert probabilities[0, 0, 0, 1:].abs().sum() == 0


FALCON_MATMULS = H * (HEADS + 2 * KV) * D + H * H + 2 * H * FFN
MLA_MATMULS = H * 48 + 48 * HEADS * 24 + H * (32 + 8) + 32 * HEADS * (16 + 16) + HEADS * 16 * H
SPLIT_MATMULS = {
    "gemma2": GQA + 3 * H * FFN,  # norms after each branch too, on the rank's sequence shard
    "gemma3_text": GQA + 3 * H * FFN,
    "falcon": FALCON_MATMULS,  # a fused GQA qkv; attention and GeLU MLP side by side; blocks return tuples
}
"""A block's matrix weights, all split over the tensor-parallel ranks."""


def falcon_point():
    fields = tiny("falcon") | {"norm": "layernorm", "activation": "gelu", "parallel_block": "two_norms"}
    return make_point(fields, seq_len=SEQ, global_batch=2 * BATCH, micro_batch=BATCH)


def gemm_flops(captured) -> tuple[float, float]:
    forward = lower_forward(captured.forward, "f", captured.axes, captured.input_shape, True).block
    backward = lower_backward(captured.backward, captured.forward, "b", captured.axes, captured.input_shape, True)
    return tuple(sum(op.flops for op in b.ops if op.category == "gemm") for b in (forward, backward.block))


def reduce_scatters(graph) -> int:
    return sum("reduce_scatter" in str(n.target) for n in graph.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model_type", sorted(SPLIT_MATMULS))
def test_a_block_splits_over_tensor_parallel_ranks_with_sp(model_type, tp) -> None:
    """Trained at tp 1, and tp 2 with sp: the rank's GEMM FLOPs 2 x tokens x the block's matrix weights / tp forward,
    twice that backward; the model's parameters exact. Under sp a sequential block reduce-scatters each branch's
    output (Gemma 2's post-norms then normalise the rank's shard), a parallel one the branches' sum once."""
    p = falcon_point() if model_type == "falcon" else point(model_type)
    captured = capture_layer(getattr(hf, model_type), model_type, p.model, p.workload, tp=tp, dp=1, sp=tp > 1)
    tokens = BATCH * SEQ
    assert gemm_flops(captured) == (
        2 * tokens * SPLIT_MATMULS[model_type] / tp,
        4 * tokens * SPLIT_MATMULS[model_type] / tp,
    )
    assert captured.parameters == PARAMETERS[model_type]
    if tp > 1:
        assert reduce_scatters(captured.forward) == (1 if model_type == "falcon" else 2)


def lowered_sums(forward, backward) -> list[tuple[float, dict[str, float]]]:
    """Per block: its GEMM FLOPs and its collectives' bytes by kind."""
    sums = []
    for block in (forward, backward):
        comm: dict[str, float] = {}
        for op in block.ops:
            if op.is_comm:
                comm[op.category] = comm.get(op.category, 0.0) + op.comm_bytes
        sums.append((sum(op.flops for op in block.ops if op.category == "gemm"), comm))
    return sums


@pytest.mark.parametrize("sp", [False, True])
def test_latent_attention_splits_as_the_symbolic_generator_prices_it(sp) -> None:
    """DeepSeek-V3's first (dense) block, MLA and SwiGLU: at tp 1 the GEMM FLOPs by hand; at tp 2 (Megatron's MLA:
    down projections replicated and their latents gathered, up projections split by heads) the rank's GEMM FLOPs
    and collective bytes of the symbolic generator's block, forward and backward. Under sp the symbolic backward
    all-gathers the normalised kv latent again where the capture keeps it (kv_lora_rank elements a token)."""
    from dse import plugins

    p = point("deepseek_v3")
    captured = capture_layer(hf.deepseek_v3, "deepseek_v3", p.model, p.workload, tp=1, dp=1, sp=False)
    matmuls = MLA_MATMULS + 3 * H * FFN
    assert gemm_flops(captured) == (2 * BATCH * SEQ * matmuls, 4 * BATCH * SEQ * matmuls)
    p = make_point(tiny("deepseek_v3"), seq_len=SEQ, global_batch=2 * BATCH, micro_batch=BATCH, tp=2, sp=sp)
    captured = capture_layer(hf.deepseek_v3, "deepseek_v3", p.model, p.workload, tp=2, dp=1, sp=sp)
    forward = lower_forward(captured.forward, "f", captured.axes, captured.input_shape, True).block
    backward = lower_backward(captured.backward, captured.forward, "b", captured.axes, captured.input_shape, True)
    blocks = {b.name: b for b in plugins.generator("symbolic").generate(p).blocks}
    symbolic = lowered_sums(blocks["layer.mla.dense.forward"], blocks["layer.mla.dense.backward"])
    if sp:
        symbolic[1][1]["all_gather"] -= BATCH * SEQ * 32 * 2  # the kv latent's regather, bf16
    assert lowered_sums(forward, backward.block) == symbolic


def test_a_latent_attention_without_query_compression_is_refused_at_tp_2_in_one_line() -> None:
    """Without q_lora_rank (DeepSeek-V2-Lite) the query projection goes from the hidden state straight to the
    attention's heads beside the latents: refused, naming the attention's class and file."""
    fields = tiny("deepseek_v3")
    fields["mla"] = {**MLA, "q_lora_rank": None}
    p = make_point(fields, seq_len=SEQ, global_batch=2 * BATCH, micro_batch=BATCH)
    with pytest.raises(PlanError, match=r"^DeepseekV3Attention \(\S+modeling_deepseek_v3\.py:\d+\): its attention's"):
        capture_layer(hf.deepseek_v3, "deepseek_v3", p.model, p.workload, tp=2, dp=1, sp=True)


@pytest.mark.parametrize(
    ("model_type", "tp", "row"),
    [
        ("llama", 2, 2 * KV // 2 * D),  # keys and values of the rank's kv heads
        ("falcon", 2, 2 * HEADS // 2 * D),  # Falcon caches its keys broadcast to every query head
        ("deepseek_v3", 1, 32 + 8),  # MLA caches its latent and its shared RoPE key
    ],
)
def test_a_decoding_block_updates_the_cache_its_attention_writes(model_type, tp, row) -> None:
    """Decoding: the block's graph updates its StaticCache layer in place, allocated as wide as what the model's
    attention writes into it (not as the spec's kv heads x head_dim): seq_len rows of `row` bf16 elements per
    sequence of the micro-batch."""
    p = falcon_point() if model_type == "falcon" else point(model_type)
    workload = p.workload.model_copy(update={"mode": "decode"})
    factory = getattr(hf, model_type)
    captured = capture_layer(factory, model_type, p.model, workload, tp=tp, dp=1, sp=False, train=False)
    lowered = lower_forward(captured.forward, "f", captured.axes, captured.input_shape, False)
    assert lowered.state_bytes == BATCH * SEQ * row * 2


def test_deepseek_v3s_official_config_is_described_as_the_catalog_has_it() -> None:
    """Hugging Face's DeepSeek-V3 at its config class's defaults (the official config.json's sizes), read from the
    module built on meta: its latent attention's widths from its projections, 671,026,404,352 parameters
    (37,552,282,624 active, 36.63e9 without the output head) as its sum of numel, and both equal to the catalog's
    deepseek-v3 through dse.modelstats's closed form."""
    from dse.modelstats import active_param_count, param_count
    from generators.fx.describe import describe

    description, _ = describe(hf.deepseek_v3, "deepseek_v3", {"fx_factory": "x"}, point("deepseek_v3").workload)
    catalog = make_point("deepseek-v3").model
    assert description.fields["mla"] == catalog.mla.model_dump()
    assert "qk_norm" not in description.fields and "kv_heads" not in description.fields
    assert (description.parameters, description.active) == (671_026_404_352, 37_552_282_624)
    assert (param_count(catalog), active_param_count(catalog)) == (description.parameters, description.active)
    assert description.unexpressed is None


@pytest.mark.parametrize("model_type", ["falcon", "deepseek_v3"])
def test_a_whole_step_prices_the_symbolic_generators_gemms_at_tp_2_with_sp(model_type) -> None:
    """Falcon (blocks returning tuples, which the ends' seam returns too) and DeepSeek-V3 (latent attention, a dense
    first layer, shared experts) through the whole fx generator, prologue and epilogue included: the step's GEMM
    FLOPs on every rank equal the symbolic generator's for the same spec, each rank's parameters too."""
    from dse import plugins
    from generators.fx.compare import figures

    fields = tiny(model_type)
    if model_type == "falcon":  # Falcon-40B's layout: two LayerNorms side by side, GeLU MLP, tied embeddings
        fields |= {"norm": "layernorm", "activation": "gelu", "parallel_block": "two_norms", "tied_embeddings": True}
    p = make_point(fields, seq_len=SEQ, global_batch=2 * BATCH, micro_batch=BATCH, tp=2, sp=True)
    ours = figures(plugins.generator("fx").generate(p), p)
    theirs = figures(plugins.generator("symbolic").generate(p), p)
    assert [c.gemm_flops for c in ours.classes] == pytest.approx([c.gemm_flops for c in theirs.classes], rel=1e-12)
    assert [c.parameters for c in ours.classes] == [c.parameters for c in theirs.classes]
