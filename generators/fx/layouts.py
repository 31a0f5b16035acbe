"""Module names the parallel plans are written in (torchtitan's LLaMA: `attention.wq`, `feed_forward.w1`,
`tok_embeddings`, ...) and the other layouts a user's model may have them in.

A plan names the modules it parallelises; a model written against Hugging Face's transformers names the same
modules otherwise (`self_attn.q_proj`, `mlp.gate_proj`, `model.embed_tokens`, ...), which its config's
`base_model_tp_plan` targets with the same styles (colwise q/k/v and gate/up, rowwise o and down). `in_names_of`
renames a plan into whichever layout a module has, so one plan serves both.
"""

from collections.abc import Iterable
from typing import TypeVar

Style = TypeVar("Style")

HUGGING_FACE = {
    "attention": "self_attn",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward": "mlp",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # the ends, inside generators/fx/models/hf.py's HFCausalLM (the causal LM at `hf`)
    "tok_embeddings": "hf.model.embed_tokens",
    "norm": "hf.model.norm",
    "output": "hf.lm_head",
}
"""torchtitan's name -> Hugging Face's (LlamaForCausalLM, MixtralForCausalLM's attention and norms)."""

LAYOUTS = ({}, HUGGING_FACE)


def in_names_of(plan: dict[str, Style], names: Iterable[str]) -> tuple[dict[str, Style], list[str]]:
    """`plan` renamed into the first layout whose names the module has all of (torchtitan's when none fits), with
    the names it still lacks (empty when it fits)."""
    have = set(names)
    best: tuple[dict[str, Style], list[str]] | None = None
    for layout in LAYOUTS:
        renamed = {layout.get(name, name): style for name, style in plan.items()}
        missing = sorted(name for name in renamed if name not in have)
        if not missing:
            return renamed, []
        best = best or (renamed, missing)
    assert best is not None
    return best
