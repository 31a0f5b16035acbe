"""The domain model: what a design point is (a model, a workload, its parallelism of `dse.parallel`, and the
system of `dse.system`), its stable key, and the fields that only mean something beside others (`IGNORED_RULES`).

Files speak human units (GiB, GB/s, TFLOP/s, ns) with the unit in the field name; properties give SI units
(bytes, bytes/s, FLOP/s, seconds), which is all the code inside ever uses. Files are read strictly (`dse.fields`).
"""

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Annotated, Any, Literal, get_args

from annotated_types import Le
from pydantic import Field, model_validator

from dse.economics import EconomicsSpec
from dse.fields import (
    DTYPE_BYTES,
    Count,
    Dtype,
    Layers,
    Name,
    Spec,
    Whole,
    Width,
    left_out_at_default,
)
from dse.limits import MAX_GLOBAL_BATCH, MAX_LAYERS, MAX_SEQ_LEN, MAX_WIDTH
from dse.parallel import ParallelSpec
from dse.routing import RoutingSpec
from dse.serving.spec import ServingSpec
from dse.system import SystemSpec


class MoESpec(Spec):
    """Mixture-of-experts MLP (Mixtral: 8 experts top-2; DeepSeek: fine-grained routed plus shared experts)."""

    experts: Width = Field(description="routed experts per MoE layer")
    top_k: Width = Field(description="routed experts each token goes to")
    expert_ffn: Width = Field(description="inner width of one expert (per gate branch for SwiGLU)")
    shared_experts: Whole = Field(0, ge=0, le=MAX_WIDTH, description="experts every token goes to (DeepSeek)")
    first_dense_layers: Whole = Field(
        0, ge=0, le=MAX_LAYERS, description="leading layers with a dense MLP of width model.ffn"
    )


class MLASpec(Spec):
    """DeepSeek multi-head latent attention: low-rank compressed K/V (and optionally Q), decoupled RoPE."""

    kv_lora_rank: Width
    q_lora_rank: Width | None = Field(None, description="None: a full-rank query projection")
    qk_nope_head_dim: Width
    qk_rope_head_dim: Width
    v_head_dim: Width


class SSMSpec(Spec):
    """Mamba selective state-space layers; with attention_every, a hybrid stack (Jamba style)."""

    state: Width = Field(16, description="SSM state size N per channel")
    conv: Width = Field(4, description="depthwise causal convolution width")
    expand: Width = Field(2, description="inner width = expand * hidden")
    dt_rank: Width | None = Field(None, description="default: ceil(hidden / 16)")
    attention_every: Layers | None = Field(
        None, description="hybrid: every k-th layer (k-1, 2k-1, ...) is attention + MLP, the rest SSM"
    )


class ModelSpec(Spec):
    """A decoder-only model: dense transformer (gpt, llama), MoE (mixtral, deepseek), SSM (mamba) or hybrid."""

    name: Name
    family: Literal["gpt", "llama", "mixtral", "deepseek", "mamba", "hybrid"]
    layers: Layers
    hidden: Width
    heads: Width = Field(1, description="attention heads (unused by pure SSM models)")
    kv_heads: Width | None = Field(None, description="key/value heads (GQA); default: heads (MHA)")
    head_dim: Width | None = Field(None, description="default: hidden // heads")
    ffn: Width = Field(1, description="MLP inner width (per gate branch for SwiGLU); dense layers of MoE")
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    ssm: SSMSpec | None = None
    dropout: bool = Field(False, description="dropout after attention probabilities and both residual branches")
    flash_attention: bool = Field(
        True, description="fused attention keeps no s x s tensor; false: softmax (and dropout) outputs are saved"
    )
    rope_impl: Literal["complex", "real"] = Field(
        "complex",
        description="how the model code applies RoPE, which eager kernels show (fused kernels do not): complex "
        "(Meta's llama, torchtitan: x viewed as complex times a complex table) or real (IBM fms: a 2x2 rotation "
        "table gathered per position, broadcast against x, product summed, all in fp32)",
    )
    vocab: Width
    norm: Literal["layernorm", "rmsnorm"]
    activation: Literal["gelu", "swiglu", "geglu"] = Field(
        description="the MLP: gelu (two matrices, GPT-2), swiglu (three: silu(gate) * up, Llama) or geglu (three: "
        "gelu(gate) * up, Gemma)"
    )
    position: Literal["rope", "learned"] = "rope"
    max_seq: Annotated[Count, Le(MAX_SEQ_LEN)] | None = Field(None, description="rows of a learned position table")
    tied_embeddings: bool = False
    bias: bool = False
    qkv_bias: bool = left_out_at_default(
        False,
        description="biases on the query, key and value projections alone (Qwen2), not on the attention output nor "
        "the MLP; bias: true has every linear's",
    )
    norm_bias: bool = left_out_at_default(
        True, description="LayerNorm's additive bias; false: a weight alone (nn.LayerNorm(bias=False), nanoGPT)"
    )
    qk_norm: bool = left_out_at_default(
        False,
        description="a norm (model.norm) over head_dim on each query and key head before RoPE (Qwen3, Gemma 3): "
        "2 x head_dim weights a layer",
    )
    parallel_block: Literal["none", "shared_norm", "two_norms"] = left_out_at_default(
        "none",
        description="attention and MLP side by side, read from the same residual stream and added to it together "
        "(x + attn(ln1(x)) + mlp(ln2(x))): none (one after the other), shared_norm (one norm feeds both: GPT-J, "
        "Falcon-7B, Phi-2, PaLM) or two_norms (GPT-NeoX, Falcon-40B). Under tp the two branches' row-parallel "
        "outputs are summed and reduced once (one all-reduce, or reduce-scatter under sp, a layer), as GPT-NeoX "
        "and PaLM run it",
    )
    dtype: Dtype = "bf16"
    fx_factory: Name | None = left_out_at_default(
        None,
        description="the PyTorch code of this model for the fx generator, which captures it: a factory registered "
        "in the dse.fx_models entry points (llama, ...) or package.module:callable, called as factory(model, "
        "workload) -> nn.Module; unset: the factory registered under the model's family. Other generators model "
        "the architecture from the fields above and do not read it",
    )
    fx_plan: dict[str, Literal["colwise", "rowwise", "sequence_parallel", "replicate", "vocab"]] | None = (
        left_out_at_default(
            None,
            description="the fx generator's tensor-parallel plan for the modules it names, over the derived one: "
            "module-name patterns (fnmatch, the model's own names: 'layers.*.attn.c_attn', '*.mlp.c_proj') -> "
            "colwise, rowwise, sequence_parallel, replicate (left unsharded) or vocab (a vocabulary-parallel "
            "embedding); it wins over a TP_PLAN dict beside the factory. Other generators do not read it",
        )
    )

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        attention = self.family != "mamba"  # a Mamba stack's head fields are refused as ignored (REFINEMENTS)
        if attention and self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}; set head_dim")
        if attention and self.heads % self.n_kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.n_kv_heads}")
        if self.position == "learned" and self.max_seq is None:
            raise ValueError("position 'learned' needs max_seq (rows of the position table)")
        required = {"heads": self.family != "mamba", "ffn": self.family in ("gpt", "llama", "deepseek", "hybrid")}
        for name, needed in required.items():
            if needed and name not in self.model_fields_set:
                raise ValueError(f"family '{self.family}' needs '{name}'")
        needs = {"mixtral": "moe", "deepseek": "moe", "mamba": "ssm", "hybrid": "ssm"}.get(self.family)
        if needs and getattr(self, needs) is None:
            raise ValueError(f"family '{self.family}' needs the '{needs}' section")
        if self.family == "hybrid" and (self.ssm is None or self.ssm.attention_every is None):
            raise ValueError("family 'hybrid' needs ssm.attention_every (every k-th layer is attention)")
        if self.ssm is not None and self.family not in ("mamba", "hybrid"):
            raise ValueError(
                f"family '{self.family}' has no SSM layers, so the 'ssm' section would be ignored; remove it"
            )
        if self.family == "mamba" and self.ssm and self.ssm.attention_every is not None:
            raise ValueError("family 'mamba' has no attention layers; remove ssm.attention_every or use family hybrid")
        if self.parallel_block != "none" and (self.ssm is not None or self.moe is not None):
            section = "ssm" if self.ssm is not None else "moe"
            raise ValueError(
                f"parallel_block '{self.parallel_block}' is modelled for dense attention layers, and the model has "
                f"'{section}' layers; remove parallel_block or the '{section}' section"
            )
        if self.moe and self.moe.top_k > self.moe.experts:
            raise ValueError(f"moe.top_k={self.moe.top_k} exceeds moe.experts={self.moe.experts}")
        if self.moe and self.moe.first_dense_layers >= self.layers:
            raise ValueError(
                f"moe.first_dense_layers={self.moe.first_dense_layers} leaves none of the {self.layers} layers "
                "with experts; lower it below model.layers"
            )
        return self

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


class WorkloadSpec(Spec):
    """One step: global_batch sequences of seq_len tokens, micro_batch sequences per DP rank at a time (training,
    prefill, decode); or a deployment serving requests (serve), which `serving` describes."""

    mode: Literal["train", "prefill", "decode", "serve"] = Field(
        "train",
        description="train: forward, backward, optimizer; prefill: forward of the prompt writing the KV "
        "cache; decode: one new token per sequence reading a KV cache of seq_len tokens; serve: requests served "
        "by continuous batching (the serving section), priced from prefill and decode steps",
    )
    seq_len: Annotated[Count, Le(MAX_SEQ_LEN)] | None = Field(
        None, description="tokens per sequence (the KV cache's under decode); not under serve, whose requests say"
    )
    global_batch: Annotated[Count, Le(MAX_GLOBAL_BATCH)] | None = Field(
        None, description="sequences per optimizer step, over all DP ranks; not under serve"
    )
    micro_batch: Annotated[Count, Le(MAX_GLOBAL_BATCH)] = Field(1, description="sequences per DP rank per micro-step")
    serving: ServingSpec | None = left_out_at_default(
        None, description="mode serve: the requests, the load, the scheduler and the KV cache"
    )
    kernels: Literal["fused", "eager"] = Field(
        "fused",
        description="fused: each norm, RoPE and activation is one kernel (Megatron/TransformerEngine, "
        "torch.compile); eager: PyTorch eager as the reference Llama code runs it, one kernel per op with fp32 "
        "intermediates (RMSNorm, RoPE), SiLU and gate product apart, GQA keys/values copied to every head",
    )

    attention_kernel: Literal["auto", "fa2", "fa3", "cudnn", "framework"] = left_out_at_default(
        "auto",
        description="the fused attention kernel, priced from the accelerator's measured table for it "
        "(system.accelerator.attention_kernels): fa2 (FlashAttention-2, what PyTorch SDPA runs), fa3 "
        "(FlashAttention-3, Hopper GPUs only), cudnn (cuDNN fused attention, TransformerEngine's); auto: fa2 where "
        "the accelerator has its table, else the flat compute_efficiency.attention; framework: the serving "
        "framework's own kernel, read from the measured kernel_tables (prefill and decode only). Needs "
        "model.flash_attention",
    )
    routing: RoutingSpec = left_out_at_default(
        RoutingSpec(),
        description="a mixture-of-experts model's routing of tokens to its experts: uniform (the default), or the "
        "busiest expert-parallel rank's skew with its source (dse/routing.py)",
    )
    grad_clip: bool = left_out_at_default(
        True,
        description="clip the gradients by their global norm before the optimizer step, as torchtitan (max_norm 1.0), "
        "Megatron-LM (--clip-grad 1.0) and FSDP recipes do by default: each rank reads its gradient shard for the "
        "norm and scales it (torch.nn.utils.clip_grad_norm_ always multiplies); false: no clipping (DeepSpeed's "
        "default)",
    )

    @model_validator(mode="after")
    def _serving_kernel_serves(self) -> "WorkloadSpec":
        serve = self.mode == "serve"
        if serve != (self.serving is not None):
            raise ValueError(
                "workload.mode serve needs the workload.serving section"
                if serve
                else f"workload.serving only takes effect with mode serve, and mode is {self.mode}; remove it"
            )
        for name in ("seq_len", "global_batch"):
            if serve and getattr(self, name) is not None:
                raise ValueError(
                    f"workload.{name} would be ignored under mode serve, whose requests give their own lengths "
                    "and whose scheduler batches them; remove it"
                )
            if not serve and getattr(self, name) is None:
                raise ValueError(f"workload.{name} is missing")
        if serve and self.micro_batch != 1:
            raise ValueError(
                "workload.micro_batch would be ignored under mode serve (the scheduler forms batches: "
                "serving.scheduler.max_num_seqs); remove it"
            )
        if self.attention_kernel == "framework" and self.mode == "train":
            raise ValueError(
                "attention_kernel: framework is a serving framework's kernel, which has no backward pass; train with "
                "fa2, fa3, cudnn or auto, or use mode prefill or decode"
            )
        return self

    @property
    def tokens(self) -> int:
        assert self.global_batch is not None and self.seq_len is not None, "a serve point has no single step"
        return self.global_batch * self.seq_len


def _digest(spec: "DesignPoint", fields: tuple[str, ...]) -> str:
    """A short hash of the canonical JSON of the point's `fields` (sorted): json.dumps(the fields' model_dump,
    sort_keys=True, separators=(",", ":")). Stable across processes, runs and versions: a resumed study finds its
    evaluated points by it, and `dse compare` matches fronts by it. Built field by field from `canonical`, the
    same text, since json.dumps nests a sorted object's text as it is."""
    return digest({name: canonical(getattr(spec, name)) for name in fields})


def digest(texts: Mapping[str, str]) -> str:
    """The key of sections given by their canonical texts (`canonical`), in sorted order: what a point's key is
    made of, for a caller that holds the texts of sections shared by many points (a sweep's systems)."""
    joined = "{" + ",".join(f'"{name}":{text}' for name, text in texts.items()) + "}"
    return hashlib.sha256(joined.encode()).hexdigest()[:16]


def canonical(section: Spec) -> str:
    """json.dumps(section.model_dump(mode="json"), sort_keys=True, separators=(",", ":")), kept by pydantic's own
    JSON of the section (equal for equal sections, and a tenth of the cost): a study's points share their model,
    system and workload, and sorting their keys was a twentieth of the driver's time per trial. A section object
    seen before (specs are frozen; a study's points share their system's) is found by identity: dumping a DGX's
    system again cost 20 us a point."""
    seen = _BY_OBJECT.get(id(section))
    if seen is not None and seen[0] is section:
        return seen[1]
    text = section.model_dump_json()
    ordered = _CANONICAL.get(text)
    if ordered is None:
        if len(_CANONICAL) >= CANONICAL_CACHE_SIZE:
            _CANONICAL.clear()
        ordered = _CANONICAL[text] = json.dumps(section.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    if len(_BY_OBJECT) >= CANONICAL_CACHE_SIZE:
        _BY_OBJECT.clear()
    _BY_OBJECT[id(section)] = (section, ordered)
    return ordered


CANONICAL_CACHE_SIZE = 4096
_CANONICAL: dict[str, str] = {}
_BY_OBJECT: dict[int, tuple[Spec, str]] = {}
"""Per section object's identity, the object (so that the identity stays its own) and its canonical text."""


class DesignPoint(Spec):
    """Everything needed to generate and price one configuration."""

    model: ModelSpec
    workload: WorkloadSpec
    parallel: ParallelSpec
    system: SystemSpec
    economics: EconomicsSpec = left_out_at_default(
        EconomicsSpec(),
        description="the owner's terms the cost and energy objectives judge the point under (lifetime, "
        "utilisation, electricity, PUE) and its budget and power limits (dse/economics.py)",
    )

    @cached_property
    def key(self) -> str:
        """A hash of the canonical JSON of every field (`key_sections`)."""
        return _digest(self, key_sections(self))

    @cached_property
    def workload_key(self) -> str:
        """A hash of every field but the system's: what a generated workload depends on (generators cache by it)."""
        return _digest(self, ("model", "parallel", "workload"))

    @property
    def micro_batches(self) -> int:
        """Micro-steps per optimizer step on each DP rank (gradient accumulation)."""
        return self.workload.global_batch // (self.parallel.dp * self.workload.micro_batch)


KEY_SECTIONS = ("model", "parallel", "system", "workload")
"""The sections of every point's key, in the sorted order `digest` joins them."""
DEFAULT_ECONOMICS = EconomicsSpec()


def key_sections(point: DesignPoint) -> tuple[str, ...]:
    """The sections a point's key is made of: KEY_SECTIONS, and economics when it is not its default (it changes
    the cost and energy metrics, so it is part of the point; left out at its default, the keys of points stored
    before it existed stay what they were)."""
    return KEY_SECTIONS if point.economics == DEFAULT_ECONOMICS else ("economics", *KEY_SECTIONS)


@dataclass(frozen=True)
class IgnoredRule:
    """A field that changes nothing while another field (its partner) has certain values: set away from its default
    there, it would be silently ignored. A point file that does so is an error (`ignored_setting`), and so is a
    study in which no point could give it effect (`first_ignored`, dse/search/space.py)."""

    field: str
    """Dotted path of the field that would be ignored."""
    partner: str
    """Dotted path of the field that decides whether it is."""

    @property
    def default(self) -> Any:
        return default_of(self.field)

    def ignored(self, value: Any, partner: Any) -> bool:
        """Whether `value` of the field changes nothing beside `partner`'s value."""
        raise NotImplementedError

    def reason(self, value: Any, partner: Any) -> str:
        """Why, naming both fields and the fix (a point file's error after its name)."""
        raise NotImplementedError

    def same_step(self) -> dict[str, Any]:
        """Fields and values that give the same step without the ignored setting (`without_ignored_settings`)."""
        return {self.field: self.default}

    def first_ignored(self, values: list[Any], partners: list[Any]) -> Any | None:
        """The first of a study's `values` of the field that no value of its partner gives effect, or None."""
        return next((v for v in values if all(self.ignored(v, p) for p in partners)), None)


@dataclass(frozen=True)
class Refinement(IgnoredRule):
    """A field that only means something while another field has certain values (`fsdp` under ZeRO 3 alone)."""

    applies: Callable[[Any], bool]
    """Whether a value of the partner gives the field effect."""
    condition: str
    """The partner values that do, as a person would set them."""
    fix: str = ""
    """The other way out besides removing the field; default: set the condition."""

    def ignored(self, value: Any, partner: Any) -> bool:
        return value != self.default and not self.applies(partner)

    def reason(self, value: Any, partner: Any) -> str:
        return (
            f"field '{self.field}': {_shown(value, 'the section')} only takes effect with {self.condition}, and "
            f"{self.partner} is {_shown(partner)}; remove {self.field} or {self.fix or f'set {self.condition}'}"
        )


def _shown(value: Any, section: str = "set") -> str:
    """A value as a message quotes it: a section (model.moe) by the words given, not its every field."""
    return section if isinstance(value, Spec) else repr(value)


@dataclass(frozen=True)
class Reach(IgnoredRule):
    """A count that means something only up to another field's value: `recompute_every` n recomputes layers n-1,
    2n-1, ..., so beyond model.layers it recomputes none of them, and the step is that of recompute none."""

    within: Callable[[Any, Any], bool]
    """Whether the field's value (first argument) is within the partner's value's reach (second)."""
    limit: str
    """The values that are, as a person would set them."""
    effect: Callable[[Any, Any], str]
    """What the step would be beyond it, given the field's value and the partner's."""
    same: tuple[tuple[str, Any], ...]
    """The fields and values that give that step."""

    def ignored(self, value: Any, partner: Any) -> bool:
        return value != self.default and not self.within(value, partner)

    def reason(self, value: Any, partner: Any) -> str:
        return (
            f"field '{self.field}': {value!r} is beyond {self.partner}={partner!r}: "
            f"{self.effect(value, partner)}; set it to {self.limit}"
        )

    def same_step(self) -> dict[str, Any]:
        return dict(self.same)


@cache
def default_of(path: str) -> Any:
    """The default of a field of a point, by its dotted path (e.g. 'parallel.zero' -> 0; a section's field within
    an optional section, 'workload.serving.kind', too)."""
    *sections, name = path.split(".")
    model: Any = DesignPoint
    for part in sections:
        annotation = model.model_fields[part].annotation
        model = next(a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, Spec))
    return model.model_fields[name].default


def _training(mode: str) -> bool:
    return mode == "train"


TRAINING = "workload.mode: train"
NOT_MAMBA = (
    "a model.family with attention and MLP layers (mamba's are selective scans alone)",
    "use family hybrid for attention and MLP layers among the scans",
)
LAYOUT = ("qkv_bias", "qk_norm")
"""Fields of the query, key and value projections: a Mamba stack has none, and latent attention (mla) its own."""
TRANSFORMER_FIELDS = ("heads", "kv_heads", "head_dim", "ffn", "moe", "mla", "bias", "flash_attention", "rope_impl")
"""Fields of attention and MLP layers, which a Mamba stack of selective scans has none of."""
LATENT = "remove model.mla (latent attention sets its own heads' widths: mla.qk_nope_head_dim, ...)"

REFINEMENTS = (
    # What the model's own architecture leaves out, first: a Mamba stack's heads, latent attention's head widths.
    *(
        Refinement(f"model.{name}", "model.family", lambda family: family != "mamba", *NOT_MAMBA)
        for name in (*TRANSFORMER_FIELDS, *LAYOUT)
    ),
    *(
        Refinement(f"model.{name}", "model.mla", lambda mla: mla is None, "model.mla unset", LATENT)
        for name in ("kv_heads", "head_dim")
    ),
    *(
        Refinement(f"model.{name}", "model.mla", lambda mla: mla is None, "model.mla unset", "remove model.mla")
        for name in LAYOUT
    ),
    Refinement("model.qkv_bias", "model.bias", lambda bias: not bias, "model.bias: false"),
    Refinement("model.norm_bias", "model.norm", lambda norm: norm == "layernorm", "model.norm: layernorm"),
    Refinement("model.max_seq", "model.position", lambda position: position == "learned", "model.position: learned"),
    Refinement("parallel.fsdp", "parallel.zero", lambda zero: zero == 3, "parallel.zero: 3"),
    Refinement("parallel.fsdp_reduce_dtype", "parallel.zero", lambda zero: zero == 3, "parallel.zero: 3"),
    Refinement("parallel.reshard_after_forward", "parallel.zero", lambda zero: zero == 3, "parallel.zero: 3"),
    Refinement("parallel.grad_reduce", "parallel.zero", lambda zero: zero >= 2, "parallel.zero 2 or 3"),
    Refinement("parallel.dp_shard", "parallel.zero", lambda zero: zero >= 1, "parallel.zero 1, 2 or 3"),
    Refinement("parallel.cp_algorithm", "parallel.cp", lambda cp: cp > 1, "parallel.cp above 1"),
    Refinement(
        "parallel.recompute_every",
        "parallel.recompute",
        lambda how: how != "none",
        "parallel.recompute other than none",
    ),
    Refinement("parallel.overlap_grad_reduce", "parallel.zero", lambda zero: zero < 3, "parallel.zero 0, 1 or 2"),
    Refinement("parallel.grad_bucket_mb", "parallel.zero", lambda zero: zero < 3, "parallel.zero 0, 1 or 2"),
    Refinement("parallel.grad_bucket_mb", "workload.mode", _training, TRAINING),
    Refinement("parallel.fsdp_prefetch", "parallel.zero", lambda zero: zero == 3, "parallel.zero: 3"),
    Refinement("parallel.fsdp_prefetch", "workload.mode", _training, TRAINING),
    Refinement("parallel.overlap_param_gather", "parallel.zero", lambda zero: zero in (1, 2), "parallel.zero 1 or 2"),
    Refinement("parallel.tp_comm_overlap", "parallel.sp", lambda sp: sp, "parallel.sp: true"),
    Refinement("parallel.overlap_p2p_comm", "parallel.pp", lambda pp: pp > 1, "parallel.pp above 1"),
    Refinement("model.rope_impl", "model.position", lambda position: position == "rope", "model.position: rope"),
    Refinement("workload.grad_clip", "workload.mode", _training, TRAINING),
    Refinement(
        "workload.attention_kernel", "model.flash_attention", lambda fused: fused, "model.flash_attention: true"
    ),
    # Found by tests/test_ignored_settings.py, which sets every field where it should take effect and where not.
    Refinement(
        "workload.attention_kernel",
        "model.family",
        lambda family: family != "mamba",
        "a model.family with attention layers (not mamba)",
    ),
    Refinement(
        "model.rope_impl",
        "workload.kernels",
        lambda kernels: kernels == "eager",
        "workload.kernels: eager",
    ),
    Refinement("model.dropout", "workload.mode", _training, TRAINING),
    Refinement("parallel.recompute", "workload.mode", _training, TRAINING),
    Refinement("parallel.overlap_grad_reduce", "workload.mode", _training, TRAINING),
    Refinement("parallel.tp_comm_overlap", "workload.mode", _training, TRAINING),
    Refinement("parallel.sp", "parallel.tp", lambda tp: tp > 1, "parallel.tp above 1"),
    # One rank holds every expert at ep 1: no rank waits for a busier one (the grouped GEMM's total is the same)
    Refinement("workload.routing", "model.moe", lambda moe: moe is not None, "a model.moe section"),
    Refinement("workload.routing", "parallel.ep", lambda ep: ep > 1, "parallel.ep above 1"),
    Refinement("parallel.layer_strategies", "parallel.tp", lambda tp: tp > 1, "parallel.tp above 1"),
    *(
        Refinement(
            f"workload.serving.{name}",
            "workload.serving.kind",
            lambda kind: kind == "disaggregated",
            "workload.serving.kind: disaggregated",
        )
        for name in ("decode", "kv_transfer")
    ),
)
REACHES = (
    Reach(
        "parallel.recompute_every",
        "model.layers",
        lambda every, layers: every <= layers,
        "at most model.layers, or parallel.recompute to none",
        lambda every, layers: (
            f"the layers it recomputes are {every - 1}, {2 * every - 1}, ..., and the model has "
            f"{layers}, so parallel.recompute would be ignored"
        ),
        (("parallel.recompute", "none"), ("parallel.recompute_every", 1)),
    ),
)
IGNORED_RULES: tuple[IgnoredRule, ...] = (*REFINEMENTS, *REACHES)
"""Every rule by which a field a point sets would change nothing."""


def ignored_setting(point: DesignPoint) -> str | None:
    """Why a field the point sets would be ignored (see IgnoredRule), or None."""
    for rule in IGNORED_RULES:
        value, partner = _at(point, rule.field), _at(point, rule.partner)
        if rule.ignored(value, partner):
            return rule.reason(value, partner)
    return None


def without_ignored_settings(point: DesignPoint) -> DesignPoint:
    """The point with every field that would be ignored (see IgnoredRule) set as gives the same step without it,
    its default mostly: a point file that `ignored_setting` accepts. A study may set such a field for the points
    that use it (`fsdp: fsdp1` while searching zero over 1 and 3); its other points are written out without it."""
    updates: dict[str, Any] = {}
    for rule in IGNORED_RULES:
        if rule.ignored(_at(point, rule.field), _at(point, rule.partner)):
            updates |= rule.same_step()
    if not updates:
        return point
    sections = {name: getattr(point, name) for name in POINT_SECTIONS}
    for path, value in updates.items():
        section, *rest = path.split(".")
        sections[section] = _replaced(sections[section], rest, value)
    # A new instance, not model_copy, which would carry over the cached key of the point it copies.
    return DesignPoint.model_construct(**sections)


def _replaced(section: Spec, path: list[str], value: Any) -> Spec:
    """A copy of `section` with the field at `path` (its names, outermost first) set to `value`."""
    name, *rest = path
    return section.model_copy(update={name: _replaced(getattr(section, name), rest, value) if rest else value})


POINT_SECTIONS = tuple(DesignPoint.model_fields)


def _at(point: DesignPoint, path: str) -> Any:
    """The value at a dotted path of the point; a field within an unset optional section is its default."""
    node: Any = point
    for name in path.split("."):
        if node is None:
            return default_of(path)
        node = getattr(node, name)
    return node
