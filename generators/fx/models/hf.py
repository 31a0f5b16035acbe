"""Hugging Face causal-LM models of any decoder-only architecture in the installed `transformers`, built from the
architecture's config class (`AutoConfig.for_model`) with the spec's fields written over its defaults, by
`_from_config`: nothing is downloaded and, under `with torch.device("meta")`, nothing is allocated.

A factory per architecture, named by its model type: `generators.fx.models.hf:<model_type>` for any of them (the
module's `__getattr__`), and the tested ones registered in pyproject's `dse.fx_models` as `hf-<model type>`
(`hf-phi3`, `hf-gpt-neox`, ..., the table ARCHITECTURES). A factory name rather than a spec field, because the
architecture is the model's code, which `model.fx_factory` already names; `hf` builds the one of the spec's family
(llama, mixtral, deepseek). The model keeps Hugging Face's module names, which its config's `base_model_tp_plan`
targets.

`transformers` is optional: without it a factory says how to install it.
"""

import copy
import inspect
import sys
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dse.spec import ModelSpec, WorkloadSpec
from generators.fx.models.layers import dtype_of

ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt_neox",
    "deepseek_v3",
    "qwen3_moe",
)
"""The model types whose capture is tested (tests/test_fx_hf_archs.py, benchmarks/fx_hf_archs.py), each registered as
a factory `hf-<model type, '-' for '_'>`; any other decoder-only model type builds through
`generators.fx.models.hf:<type>` (Falcon's blocks capture; its ends wait for the capture's stand-in block to return
a tuple, as Falcon's blocks do)."""

FAMILIES = {"llama": "llama", "mixtral": "mixtral", "deepseek": "deepseek_v3"}
"""The model type the factory `hf` builds for a spec's family."""

CAUSAL_ATTENTION, EAGER_ATTENTION = "dse_causal", "dse_causal_eager"
"""The attention implementations the models are built with (registered with transformers on first use): fused, or
with `model.flash_attention: false` eager. Not named "...sdpa": transformers refuses any such name for a model
whose own SDPA path is wrong (Gemma 2's soft-cap)."""

_SPEC_TO_CONFIG: dict[str, tuple[str, ...]] = {
    "vocab": ("vocab_size",),
    "hidden": ("hidden_size",),
    "layers": ("num_hidden_layers",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "ffn": ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim"),
    "tied_embeddings": ("tie_word_embeddings",),
    "max_seq": ("max_position_embeddings",),
    "moe.experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe.top_k": ("num_experts_per_tok",),
    "moe.expert_ffn": ("moe_intermediate_size", "intermediate_size"),
    "moe.shared_experts": ("n_shared_experts",),
    "moe.first_dense_layers": ("first_k_dense_replace",),
    "mla.kv_lora_rank": ("kv_lora_rank",),
    "mla.q_lora_rank": ("q_lora_rank",),
    "mla.qk_nope_head_dim": ("qk_nope_head_dim",),
    "mla.qk_rope_head_dim": ("qk_rope_head_dim",),
    "mla.v_head_dim": ("v_head_dim",),
}
"""A spec field -> the config attributes that may hold it, first the config has wins (names a config's
`attribute_map` renames, GPT-2's n_embd for hidden_size, are found under the common name; GPT-2's and GPT-J's
MLP width is n_inner, OPT's ffn_dim)."""

_BUILT_FOR: "weakref.WeakKeyDictionary[Any, nn.Module]" = weakref.WeakKeyDictionary()
"""A decoding model's StaticCache -> the causal LM it was built for, whose blocks `allocate_cache` runs (a copy of
the cache, as the plan's dataflow run makes, is not in it)."""

_BIAS = ("attention_bias", "mlp_bias", "bias", "use_bias")
"""Config switches the spec's `bias` sets, all that the config has."""


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind the reference-model interface: tokens [batch, seq] -> logits, blocks as
    `.layers` (the Hugging Face model's own ModuleList, not a copy)."""

    def __init__(self, causal_lm: nn.Module, cache: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.hf, self.cache = causal_lm, cache
        """Decoding: the StaticCache, by the keyword the causal LM takes it by."""
        _block_stack(causal_lm)  # refused here, when it has none

    @property
    def layers(self) -> nn.ModuleList:
        return _block_stack(self.hf)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] from position 0; decoding, tokens [batch, 1] at positions `input_pos` [1], the
        StaticCache's last slot (`generators.fx.factories`), without autograd (inference: the cache's layers, run
        on meta before the captured one, hold plain tensors, which the plan's dataflow run can copy)."""
        if self.cache is None or input_pos is None:
            return self.hf(input_ids=tokens, use_cache=False).logits
        with torch.no_grad():
            return self.hf(input_ids=tokens, position_ids=input_pos.unsqueeze(0), use_cache=True, **self.cache).logits


def _block_stack(causal_lm: nn.Module) -> nn.ModuleList:
    """The base model's ModuleList of num_hidden_layers blocks of one class (`model.layers`, `gpt_neox.layers`,
    `transformer.h`, OPT's `model.decoder.layers`), the one holding the most parameters."""
    layers = causal_lm.config.num_hidden_layers
    stacks = [
        m
        for m in causal_lm.base_model.modules()
        if isinstance(m, nn.ModuleList) and len(m) == layers and len({type(b) for b in m}) == 1
    ]
    if not stacks:
        raise ValueError(f"{type(causal_lm).__name__} has no ModuleList of its {layers} blocks")
    return max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()))


def _given(model: ModelSpec) -> dict[str, Any]:
    """The spec fields the user gave (pydantic's fields set; None, a field's default, is not a value), MoE and MLA
    ones as 'moe.experts', ..."""
    given = {name: getattr(model, name) for name in model.model_fields_set if getattr(model, name) is not None}
    for section in ("moe", "mla"):
        inner = given.pop(section, None)
        if inner is not None:
            given |= {f"{section}.{name}": getattr(inner, name) for name in inner.model_fields_set}
    return given


def _settable(config: Any, name: str) -> bool:
    """Whether the config holds `name` (directly or through its attribute_map), not as a derived property."""
    derived = getattr(type(config), name, None)
    return hasattr(config, name) and not (isinstance(derived, property) and derived.fset is None)


def _implied(model: ModelSpec, field: str) -> tuple[Any, ...]:
    """The values of a field that a config without its attribute has anyway (None: no value)."""
    implied: dict[str, tuple[Any, ...]] = {"moe.shared_experts": (0,), "moe.first_dense_layers": (0,)}
    if model.hidden and model.heads:
        implied |= {"kv_heads": (model.heads,), "head_dim": (model.hidden // model.heads,)}
    return (None, *implied.get(field, ()))


def config_overrides(model: ModelSpec, workload: WorkloadSpec, defaults: Any) -> dict[str, Any]:
    """The config attributes the spec's given fields set (`_SPEC_TO_CONFIG`), in `defaults`' names; the position
    table (max_position_embeddings) of model.max_seq, else of the workload's seq_len. Fields the config's class
    fixes (norm, activation, position) are not its to set. A ValueError naming the field the config has no
    attribute for."""
    overrides: dict[str, Any] = {}
    if workload.seq_len is not None and hasattr(defaults, "max_position_embeddings"):
        overrides["max_position_embeddings"] = workload.seq_len
    given = _given(model)
    if "bias" in given:
        overrides |= {switch: given["bias"] for switch in _BIAS if hasattr(defaults, switch)}
    for field, names in _SPEC_TO_CONFIG.items():  # in its order: an expert's width over a dense one (Mixtral)
        if field not in given:
            continue
        held = next((name for name in names if _settable(defaults, name)), None)
        if held is None and given[field] in _implied(model, field):
            continue  # what the config's class implies (multi-head attention, head_dim hidden / heads)
        if held is None:
            raise ValueError(
                f"field 'model.{field}': {type(defaults).__name__} has no {' or '.join(names)}; leave it out"
            )
        overrides[held] = given[field]
    if "kv_heads" in given and _settable(defaults, "multi_query"):  # Falcon: MQA or MHA by a switch, GQA its new layout
        kv_heads = given["kv_heads"] or model.heads
        overrides["multi_query"] = kv_heads == 1
        if kv_heads not in (1, model.heads):
            overrides["new_decoder_architecture"] = True
    experts = given.get("moe.experts")
    if experts is not None and _settable(defaults, "n_group") and experts % (defaults.n_group or 1):
        overrides |= {"n_group": 1, "topk_group": 1}  # DeepSeek's expert groups (8) do not divide fewer experts
    vocab = overrides.get("vocab_size")  # special tokens beyond a smaller vocabulary (Phi-3's pad 32000) left unset
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if vocab is not None and isinstance(getattr(defaults, token, None), int) and getattr(defaults, token) >= vocab:
            overrides[token] = None
    return overrides


def hf_config(model_type: str, model: ModelSpec, workload: WorkloadSpec) -> Any:
    """The config of `model_type` with the spec's given fields over its class's defaults; a ValueError naming the
    model type when it is not a decoder-only architecture of the installed transformers."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise ValueError(
            f"model type '{model_type}' is not in the installed transformers (a model needing remote code cannot be "
            "built here); upgrade transformers or name one of its model types"
        )
    defaults = AutoConfig.for_model(model_type)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(defaults, "is_encoder_decoder", False):
        raise ValueError(f"model type '{model_type}' has no decoder-only causal LM in transformers (encoder-decoder?)")
    return AutoConfig.for_model(model_type, **config_overrides(model, workload, defaults))


def causal_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Causal attention without a mask tensor, as FlashAttention-2 runs a training step's unpadded batch.

    Hugging Face's own "sdpa" builds a materialised causal mask whenever it is traced (it cannot prove the batch
    unpadded), and checks the position ids for packed sequences with a data-dependent branch; an implementation
    without a registered mask function skips both, so the capture sees one `F.scaled_dot_product_attention` with
    `is_causal` (the fused op) and the block's inputs carry no mask. Looked up at call time, so that
    `generators.fx.attention.fused_attention` routes it. The architecture's scaling (Gemma's query_pre_attn_scalar,
    MLA's) comes in `scaling`; a logit soft-cap (Gemma 2) is fused as FlashAttention-2 fuses it. A sliding window
    shorter than the keys is refused: the fused op has no window."""
    _refuse_window(module, key, kwargs.get("sliding_window"))
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        dropout_p=kwargs.get("dropout", 0.0),
        is_causal=query.shape[2] > 1,
        scale=kwargs.get("scaling"),
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def eager_causal_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's eager attention (the s x s scores and probabilities materialised, softmax in fp32), causal
    by a mask made inside from the shapes rather than taken as an input: what `model.flash_attention: false`
    captures."""
    _refuse_window(module, key, kwargs.get("sliding_window"))
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * kwargs.get("scaling", query.shape[-1] ** -0.5)
    if query.shape[2] > 1:
        above = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probabilities = F.dropout(probabilities, p=kwargs.get("dropout", 0.0), training=module.training)
    return torch.matmul(probabilities, value).transpose(1, 2).contiguous(), probabilities


def _refuse_window(module: nn.Module, key: torch.Tensor, window: int | None) -> None:
    if window is not None and key.shape[2] > window:
        raise ValueError(
            f"{type(module).__name__}: a sliding window of {window} tokens over {key.shape[2]}, which the causal "
            "attention here does not take; use seq_len <= the window"
        )


class _Initialised(Exception):
    """Stops a block at its cache update, once the cache layer is allocated."""


def _initialising(layer: Any, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    layer.lazy_initialization(keys, values)
    raise _Initialised


def allocate_cache(block_kwargs: dict[str, Any], index: int, like: torch.Tensor) -> None:
    """Hugging Face's StaticCache allocates a layer's keys and values at their first update, after the tensors the
    attention writes: inside a captured block, a fresh tensor that the graph fills, not the cache the step holds.
    Allocated here first, the block's cache is an input its graph updates in place, as a decoding step's is.

    What an attention caches is its code's to say: [batch, kv heads, ., head_dim] keys and values for most, but
    all the query heads' keys for Falcon (it broadcasts them before caching), and one latent "head" of
    kv_lora_rank beside one RoPE key of qk_rope_head_dim for DeepSeek's MLA. So the block (`index` of the model
    the cache was built for, tensor-parallelised by now: its rank's heads) runs once on meta on a token's hidden
    state (`like`'s batch and dtype), stopped at its cache update, which allocates the layer from what the
    attention writes. Nothing for a block called without a StaticCache."""
    # its keyword: cache from transformers 5.2x on, past_key_values before, layer_past in GPT-NeoX's and Falcon's
    cache = next((block_kwargs[k] for k in ("cache", "past_key_values", "layer_past") if k in block_kwargs), None)
    causal_lm = _BUILT_FOR.get(cache) if cache is not None else None
    if causal_lm is None or getattr(cache.layers[index], "is_initialized", True):
        return
    layer = cache.layers[index]
    layer.update = _initialising.__get__(layer)
    try:
        with torch.no_grad():
            x = like.new_empty((like.shape[0], 1, causal_lm.config.hidden_size))
            _block_stack(causal_lm)[index](x, **block_kwargs)
    except _Initialised:
        pass
    finally:
        del layer.update


def wrap(causal_lm: nn.Module, cache: dict[str, Any] | None = None, fused: bool = True) -> HFCausalLM:
    """A Hugging Face causal LM, built with whatever attention ("sdpa", its default, or "eager"), made capturable
    and put behind the reference interface (`HFCausalLM`): its attention switched to `causal_attention` (not
    `fused`: `eager_causal_attention`); a model that calls SDPA itself when its config says "sdpa" (Falcon: its
    attention classes picked by that name, not through the attention interface) keeps it for its blocks, and the
    model's own config says `CAUSAL_ATTENTION`, whose mask `create_causal_mask` skips (None), so that each block
    calls SDPA with `is_causal` (the fused op)."""
    import transformers

    transformers.AttentionInterface.register(CAUSAL_ATTENTION, causal_attention)
    transformers.AttentionInterface.register(EAGER_ATTENTION, eager_causal_attention)
    _conv1d_as_linear(causal_lm)
    config = causal_lm.config
    if hasattr(sys.modules[type(causal_lm).__module__], "ALL_ATTENTION_FUNCTIONS"):
        causal_lm.set_attn_implementation(CAUSAL_ATTENTION if fused else EAGER_ATTENTION)
    elif not fused:
        raise ValueError(f"{type(causal_lm).__name__} runs its own attention: model.flash_attention must be true")
    else:
        blocks = copy.copy(config)
        blocks._attn_implementation = "sdpa"
        for module in _block_stack(causal_lm).modules():
            if getattr(module, "config", None) is config:
                module.config = blocks
        config._attn_implementation = CAUSAL_ATTENTION
    return HFCausalLM(causal_lm, cache)


def _conv1d_as_linear(causal_lm: nn.Module) -> None:
    """GPT-2's projections (transformers' Conv1D: x @ W + b, W [in, out]) made the nn.Linear they compute (the
    weight transposed, names kept), so that the tensor-parallel plan, which pairs nn.Linear modules
    (`generators.fx.plans`), splits them: the same matmuls, parameters and module names."""
    from transformers.pytorch_utils import Conv1D

    for name, module in list(causal_lm.named_modules()):
        if isinstance(module, Conv1D):
            weight = module.weight
            linear = nn.Linear(*weight.shape, bias=module.bias is not None, device=weight.device, dtype=weight.dtype)
            linear.weight = nn.Parameter(weight.detach().t().contiguous(), requires_grad=weight.requires_grad)
            if module.bias is not None:
                linear.bias = module.bias
            causal_lm.set_submodule(name, linear)


def build(model_type: str, model: ModelSpec, workload: WorkloadSpec) -> HFCausalLM:
    """The causal LM of `model_type` for the spec (`hf_config`), weights in the spec's dtype, built as a user would
    (its default attention) and `wrap`ped, its attention fused unless model.flash_attention is false; for a decode
    workload with a StaticCache of seq_len tokens."""
    try:
        import transformers
    except ImportError:
        raise ValueError("the fx model factory 'hf' needs transformers: pip install 'dse-orchestrator[hf]'") from None

    config = hf_config(model_type, model, workload)
    causal_lm = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype_of(model))
    if workload.mode != "decode":
        return wrap(causal_lm, fused=model.flash_attention)
    # transformers 5.2x renamed past_key_values to cache (the old name warns until 5.40)
    keyword = "cache" if "cache" in inspect.signature(type(causal_lm).forward).parameters else "past_key_values"
    static = transformers.StaticCache(config=config, max_cache_len=workload.seq_len)
    _BUILT_FOR[static] = causal_lm
    return wrap(causal_lm, {keyword: static}, fused=model.flash_attention)


def hf(model: ModelSpec, workload: WorkloadSpec) -> HFCausalLM:
    """The causal LM of the spec's family (`FAMILIES`: LlamaForCausalLM, MixtralForCausalLM,
    DeepseekV3ForCausalLM)."""
    if model.family not in FAMILIES:
        raise ValueError(
            f"model '{model.name}': family '{model.family}' has no Hugging Face architecture in the fx model factory "
            "'hf'; name one as fx_factory 'generators.fx.models.hf:<model_type>'"
        )
    return build(FAMILIES[model.family], model, workload)


def factory_for(model_type: str) -> Any:
    """The factory(model, workload) building `model_type`."""

    def factory(model: ModelSpec, workload: WorkloadSpec) -> HFCausalLM:
        return build(model_type, model, workload)

    factory.__name__ = factory.__qualname__ = model_type
    factory.__doc__ = f"The Hugging Face '{model_type}' causal LM of the spec (`build`)."
    return factory


def __getattr__(name: str) -> Any:
    """`generators.fx.models.hf:<model_type>`: the factory of any model type of the installed transformers (any,
    without it, so that calling it says how to install it)."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return factory_for(name)
    if name not in CONFIG_MAPPING_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (not a transformers model type)")
    return factory_for(name)
