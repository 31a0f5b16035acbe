"""Hugging Face causal-LM models built from a `ModelSpec`: the config is written in code from the spec (LlamaConfig
for the llama family, MixtralConfig for mixtral), the model built by `_from_config`, so nothing is downloaded and,
under `with torch.device("meta")`, nothing is allocated.

`transformers` is optional: without it the factory says how to install it. The model keeps Hugging Face's own
module names (model.layers[i].self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj; Mixtral's mlp.gate and fused
mlp.experts.{gate_up_proj,down_proj}), which its config's `base_model_tp_plan` targets, not torchtitan's.
"""

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dse.spec import ModelSpec, WorkloadSpec
from generators.fx.models.layers import NORM_EPS, ROPE_THETA, dtype_of


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind the reference-model interface: tokens [batch, seq] -> logits, blocks as
    `.layers` (the Hugging Face model's own ModuleList, not a copy)."""

    def __init__(self, causal_lm: nn.Module, cache: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.hf, self.cache = causal_lm, cache
        """Decoding: the StaticCache, by the keyword the causal LM takes it by."""

    @property
    def layers(self) -> nn.ModuleList:
        return self.hf.model.layers

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] from position 0; decoding, tokens [batch, 1] at positions `input_pos` [1], the
        StaticCache's last slot (`generators.fx.factories`)."""
        if self.cache is None or input_pos is None:
            return self.hf(input_ids=tokens, use_cache=False).logits
        return self.hf(input_ids=tokens, position_ids=input_pos.unsqueeze(0), use_cache=True, **self.cache).logits


def _refuse(m: ModelSpec, why: str) -> None:
    raise ValueError(f"model '{m.name}': {why} has no Hugging Face config in the fx model factory 'hf'")


def hf_config(m: ModelSpec, w: WorkloadSpec) -> Any:
    """The spec as a LlamaConfig (llama) or MixtralConfig (mixtral); anything those cannot say is refused."""
    import transformers

    if m.family not in ("llama", "mixtral"):
        _refuse(m, f"family '{m.family}'")
    if m.norm != "rmsnorm" or m.activation != "swiglu" or m.position != "rope":
        _refuse(m, "a model without RMSNorm, SwiGLU and RoPE")
    common = {
        "vocab_size": m.vocab,
        "hidden_size": m.hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.d_head,
        "max_position_embeddings": w.seq_len,
        "rms_norm_eps": NORM_EPS,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": m.tied_embeddings,
    }
    if m.moe is None:
        return transformers.LlamaConfig(intermediate_size=m.ffn, attention_bias=m.bias, mlp_bias=m.bias, **common)
    if m.bias or m.moe.shared_experts or m.moe.first_dense_layers:
        _refuse(m, "an MoE with biases, shared experts or leading dense layers")
    return transformers.MixtralConfig(
        intermediate_size=m.moe.expert_ffn,
        num_local_experts=m.moe.experts,
        num_experts_per_tok=m.moe.top_k,
        **common,
    )


CAUSAL_ATTENTION = "dse_causal_sdpa"
"""The attention implementation the models are built with (registered with transformers on first use)."""


def causal_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Causal attention without a mask tensor, as FlashAttention-2 runs a training step's unpadded batch.

    Hugging Face's own "sdpa" builds a materialised causal mask whenever it is traced (it cannot prove the batch
    unpadded), and checks the position ids for packed sequences with a data-dependent branch; an implementation
    without a registered mask function skips both, so the capture sees one `F.scaled_dot_product_attention` with
    `is_causal` (the fused op) and the block's inputs carry no mask. Looked up at call time, so that
    `generators.fx.attention.fused_attention` routes it."""
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        is_causal=query.shape[2] > 1,
        scale=kwargs.get("scaling"),
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def allocate_cache(block_kwargs: dict[str, Any], index: int, like: torch.Tensor) -> None:
    """Hugging Face's StaticCache allocates a layer's keys and values at their first update: inside a captured
    block, a fresh tensor that the graph fills, not the cache the step holds. Allocated here first, after keys
    `like` one token's [batch, heads, 1, head_dim] (the rank's heads under tensor parallelism), the block's cache is
    an input its graph updates in place, as a decoding step's is. Nothing for a block called without a
    StaticCache."""
    cache = block_kwargs.get("cache", block_kwargs.get("past_key_values"))  # its name from transformers 5.2x on
    layers = getattr(cache, "layers", None)
    if layers is not None and not getattr(layers[index], "is_initialized", True):
        layers[index].lazy_initialization(like, like)


def hf(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    """LlamaForCausalLM / MixtralForCausalLM of the spec, with causal SDPA attention (`causal_attention`), weights in
    the spec's dtype."""
    try:
        import transformers
    except ImportError:
        raise ValueError("the fx model factory 'hf' needs transformers: pip install 'dse-orchestrator[hf]'") from None

    transformers.AttentionInterface.register(CAUSAL_ATTENTION, causal_attention)
    config = hf_config(model, workload)
    cls = transformers.MixtralForCausalLM if model.moe else transformers.LlamaForCausalLM
    causal_lm = cls._from_config(config, dtype=dtype_of(model), attn_implementation=CAUSAL_ATTENTION)
    if workload.mode != "decode":
        return HFCausalLM(causal_lm)
    # transformers 5.2x renamed past_key_values to cache (the old name warns until 5.40)
    keyword = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    return HFCausalLM(causal_lm, {keyword: transformers.StaticCache(config=config, max_cache_len=workload.seq_len)})
