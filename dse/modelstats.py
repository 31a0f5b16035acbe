"""Closed-form counts of a model, independent of any generator: the reference the generated graphs are
checked against, and the model FLOPs that MFU is defined by.

A layer is a mixer (attention `attn`, latent attention `mla`, selective scan `ssm`) followed by an MLP (`dense`,
`moe`, or `none` for pure Mamba blocks); `layer_kinds` lists them for the whole stack.
"""

from functools import lru_cache
from math import ceil

from dse.spec import ModelSpec, WorkloadSpec

LayerKind = tuple[str, str]


def layer_kinds(m: ModelSpec) -> list[LayerKind]:
    """Each layer's (mixer, MLP), built a list at a time (feasibility asks it of every point a sweep decodes)."""
    if m.family == "mamba":
        return [("ssm", "none")] * m.layers
    mixer = "mla" if m.mla else "attn"
    if m.family == "hybrid":
        assert m.ssm is not None and m.ssm.attention_every is not None
        every = m.ssm.attention_every
        mixers = [mixer if (i + 1) % every == 0 else "ssm" for i in range(m.layers)]
    else:
        mixers = [mixer] * m.layers
    dense = min(m.moe.first_dense_layers, m.layers) if m.moe else m.layers
    return list(zip(mixers, ["dense"] * dense + ["moe"] * (m.layers - dense), strict=True))


def ssm_inner(m: ModelSpec) -> int:
    assert m.ssm is not None
    return m.ssm.expand * m.hidden


def dt_rank(m: ModelSpec) -> int:
    assert m.ssm is not None
    return m.ssm.dt_rank or ceil(m.hidden / 16)


def _norm(m: ModelSpec, width: int | None = None) -> int:
    """Weights of one norm over `width` (default: hidden): a scale, and LayerNorm's bias unless norm_bias is off."""
    return (2 if m.norm == "layernorm" and m.norm_bias else 1) * (width or m.hidden)


def gated(m: ModelSpec) -> bool:
    """Whether the MLP is gated (SwiGLU, GeGLU: a gate and an up projection, then down), else two matrices."""
    return m.activation != "gelu"


def mixer_params(m: ModelSpec, mixer: str) -> int:
    h = m.hidden
    if mixer == "attn":
        params = h * m.d_head * (m.heads + 2 * m.n_kv_heads) + m.heads * m.d_head * h
        if m.bias or m.qkv_bias:
            params += m.d_head * (m.heads + 2 * m.n_kv_heads)
        if m.bias:
            params += h
        if m.qk_norm:
            params += 2 * _norm(m, m.d_head)
        return params
    if mixer == "mla":
        a = m.mla
        assert a is not None
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = h * m.heads * qk  # full-rank query projection, or through the q_lora_rank bottleneck and its norm
        if a.q_lora_rank:
            q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * m.heads * qk
        kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        kv += a.kv_lora_rank * m.heads * (a.qk_nope_head_dim + a.v_head_dim)
        return q + kv + m.heads * a.v_head_dim * h
    assert m.ssm is not None
    di, n, r = ssm_inner(m), m.ssm.state, dt_rank(m)
    # in_proj (x and z), depthwise conv with bias, x_proj (dt, B, C), dt_proj with bias, A_log, D, out_proj
    return h * 2 * di + di * m.ssm.conv + di + di * (r + 2 * n) + r * di + di + di * n + di + di * h


def _mlp_mats(m: ModelSpec) -> int:
    return 3 if gated(m) else 2


def expert_params(m: ModelSpec) -> int:
    assert m.moe is not None
    return _mlp_mats(m) * m.hidden * m.moe.expert_ffn


def mlp_params(m: ModelSpec, mlp: str, active: bool = False) -> int:
    if mlp == "none":
        return 0
    if mlp == "dense":
        params = _mlp_mats(m) * m.hidden * m.ffn
        if m.bias:
            params += m.ffn * (2 if gated(m) else 1) + m.hidden
        return params
    assert m.moe is not None
    routed = m.moe.top_k if active else m.moe.experts
    return m.hidden * m.moe.experts + (routed + m.moe.shared_experts) * expert_params(m)


def kind_params(m: ModelSpec, kind: LayerKind, active: bool = False) -> int:
    mixer, mlp = kind
    norms = _norm(m) * (1 if mlp == "none" or m.parallel_block == "shared_norm" else 2)
    return mixer_params(m, mixer) + mlp_params(m, mlp, active) + norms


def layer_params(m: ModelSpec) -> int:
    """Parameters of the first layer (for dense models, every layer)."""
    return kind_params(m, layer_kinds(m)[0])


def embedding_params(m: ModelSpec) -> int:
    """Token table, plus a learned position table."""
    positions = m.max_seq * m.hidden if m.position == "learned" and m.max_seq else 0
    return m.vocab * m.hidden + positions


def _outside(m: ModelSpec) -> int:
    head = 0 if m.tied_embeddings else m.vocab * m.hidden
    return embedding_params(m) + _norm(m) + head


@lru_cache(maxsize=64)  # the feasibility rules ask for every point (the parameter limit)
def param_count(m: ModelSpec) -> int:
    return sum(kind_params(m, k) for k in layer_kinds(m)) + _outside(m)


def active_param_count(m: ModelSpec) -> int:
    """Parameters one token uses (routed experts: top_k of them), embedding tables included (Mixtral's 12.9e9
    convention)."""
    return sum(kind_params(m, k, active=True) for k in layer_kinds(m)) + _outside(m)


@lru_cache(maxsize=64)  # a generator asks for every point; counting a deep stack costs more than the point's hash
def matmul_params(m: ModelSpec, active: bool = True) -> int:
    """Parameters that multiply activations: all but the lookup-only tables (the LM head counts, tied or not);
    for MoE the active ones."""
    total = active_param_count(m) if active else param_count(m)
    return total - embedding_params(m) + (m.vocab * m.hidden if m.tied_embeddings else 0)


@lru_cache(maxsize=64)  # as matmul_params
def attention_flops_per_token(m: ModelSpec, context: int) -> float:
    """Forward FLOPs per token of the score and value products against `context` keys (full, not causal-halved),
    and of the selective scan of SSM layers."""
    flops = 0.0
    for mixer, _ in layer_kinds(m):
        if mixer == "attn":
            flops += 4 * m.heads * m.d_head * context
        elif mixer == "mla":
            a = m.mla
            assert a is not None
            flops += 2 * m.heads * context * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
        else:
            assert m.ssm is not None
            flops += SCAN_FLOPS * ssm_inner(m) * m.ssm.state
    return flops


SCAN_FLOPS = 9
"""Forward FLOPs per channel and state element of the selective scan (Gu and Dao 2023, section 3.3)."""


def model_flops(m: ModelSpec, w: WorkloadSpec) -> float:
    """FLOPs of a step by the Megatron/torchtitan convention: training 6 N T + 12 L (heads*head_dim) s T (N the
    active matmul parameters; no recomputation, full not causal-halved attention); prefill 2 N T + 4 L n d s T;
    decode 2 N per new token + 4 L n d (context) per new token."""
    n = matmul_params(m)
    if w.mode == "train":
        return (6 * n + 3 * attention_flops_per_token(m, w.seq_len)) * w.tokens
    if w.mode == "prefill":
        return (2 * n + attention_flops_per_token(m, w.seq_len)) * w.tokens
    return (2 * n + attention_flops_per_token(m, w.seq_len)) * w.global_batch
