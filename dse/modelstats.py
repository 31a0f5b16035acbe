"""Closed-form counts of a model, independent of any generator: the reference the generated graphs are
checked against, and the model FLOPs that MFU is defined by."""

from dse.spec import ModelSpec, WorkloadSpec


def layer_params(m: ModelSpec) -> int:
    attn = m.hidden * m.d_head * (m.heads + 2 * m.n_kv_heads) + m.heads * m.d_head * m.hidden
    mlp = (3 if m.activation == "swiglu" else 2) * m.hidden * m.ffn
    norms = (2 if m.norm == "layernorm" else 1) * 2 * m.hidden
    bias = 0
    if m.bias:
        bias = m.d_head * (m.heads + 2 * m.n_kv_heads) + m.hidden + m.ffn * (2 if m.activation == "swiglu" else 1)
        bias += m.hidden
    return attn + mlp + norms + bias


def embedding_params(m: ModelSpec) -> int:
    """Token table, plus a learned position table."""
    positions = m.max_seq * m.hidden if m.position == "learned" and m.max_seq else 0
    return m.vocab * m.hidden + positions


def param_count(m: ModelSpec) -> int:
    final_norm = (2 if m.norm == "layernorm" else 1) * m.hidden
    head = 0 if m.tied_embeddings else m.vocab * m.hidden
    return m.layers * layer_params(m) + embedding_params(m) + final_norm + head


def matmul_params(m: ModelSpec) -> int:
    """Parameters that multiply activations: all but the lookup-only tables (the LM head counts, tied or not)."""
    return param_count(m) - embedding_params(m) + (m.vocab * m.hidden if m.tied_embeddings else 0)


def model_flops(m: ModelSpec, w: WorkloadSpec) -> float:
    """Training FLOPs of a step by the Megatron/torchtitan convention: 6 N T + 12 L (heads*head_dim) s T,
    no recomputation, full (not causal-halved) attention."""
    per_token = 6 * matmul_params(m) + 12 * m.layers * m.heads * m.d_head * w.seq_len
    return per_token * w.tokens
