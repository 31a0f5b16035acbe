"""The domain model: what a design point is (a model, a workload, its parallelism, and the system of
`dse.system`), its stable key, and the fields that only mean something beside others (`REFINEMENTS`).

Files speak human units (GiB, GB/s, TFLOP/s, ns) with the unit in the field name; properties give SI units
(bytes, bytes/s, FLOP/s, seconds), which is all the code inside ever uses. Files are read strictly (`dse.fields`).
"""

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from dse.fields import (
    DTYPE_BYTES,
    Count,
    Degree,
    Dtype,
    Layers,
    Name,
    Spec,
    Whole,
    Width,
    as_tuple,
    as_whole,
    left_out_at_default,
)
from dse.limits import MAX_CAPACITY_GIB, MAX_GLOBAL_BATCH, MAX_LAYERS, MAX_SEQ_LEN, MAX_WIDTH, MAX_WORLD
from dse.system import SystemSpec


def _reshard_value(value: Any) -> Any:
    """parallel.reshard_after_forward: auto, a flag, or a number of ranks, with one message for anything else
    (the union's own errors would list each member's)."""
    if value == "auto" or isinstance(value, bool):
        return value
    number = as_whole(value) if isinstance(value, int | float) else None
    if isinstance(number, int) and 1 <= number <= MAX_WORLD:
        return number
    raise PydanticCustomError(
        "reshard_after_forward", "expected auto, true, false or a whole number of ranks to reshard to after forward"
    )


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
    activation: Literal["gelu", "swiglu"]
    position: Literal["rope", "learned"] = "rope"
    max_seq: Annotated[Count, Le(MAX_SEQ_LEN)] | None = Field(None, description="rows of a learned position table")
    tied_embeddings: bool = False
    bias: bool = False
    dtype: Dtype = "bf16"
    fx_factory: Name | None = left_out_at_default(
        None,
        description="the PyTorch code of this model for the fx generator, which captures it: a factory registered "
        "in the dse.fx_models entry points (llama, ...) or package.module:callable, called as factory(model, "
        "workload) -> nn.Module; unset: the factory registered under the model's family. Other generators model "
        "the architecture from the fields above and do not read it",
    )

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}; set head_dim")
        if self.heads % self.n_kv_heads:
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
    """One training step: global_batch sequences of seq_len tokens, micro_batch sequences per DP rank at a time."""

    mode: Literal["train", "prefill", "decode"] = Field(
        "train",
        description="train: forward, backward, optimizer; prefill: forward of the prompt writing the KV "
        "cache; decode: one new token per sequence reading a KV cache of seq_len tokens",
    )
    seq_len: Annotated[Count, Le(MAX_SEQ_LEN)]
    global_batch: Annotated[Count, Le(MAX_GLOBAL_BATCH)] = Field(
        description="sequences per optimizer step, over all DP ranks"
    )
    micro_batch: Annotated[Count, Le(MAX_GLOBAL_BATCH)] = Field(1, description="sequences per DP rank per micro-step")
    kernels: Literal["fused", "eager"] = Field(
        "fused",
        description="fused: each norm, RoPE and activation is one kernel (Megatron/TransformerEngine, "
        "torch.compile); eager: PyTorch eager as the reference Llama code runs it, one kernel per op with fp32 "
        "intermediates (RMSNorm, RoPE), SiLU and gate product apart, GQA keys/values copied to every head",
    )

    attention_kernel: Literal["auto", "fa2", "fa3", "cudnn"] = left_out_at_default(
        "auto",
        description="the fused attention kernel, priced from the accelerator's measured table for it "
        "(system.accelerator.attention_kernels): fa2 (FlashAttention-2, what PyTorch SDPA runs), fa3 "
        "(FlashAttention-3, Hopper GPUs only), cudnn (cuDNN fused attention, TransformerEngine's); auto: fa2 where "
        "the accelerator has its table, else the flat compute_efficiency.attention. Needs model.flash_attention",
    )
    grad_clip: bool = left_out_at_default(
        True,
        description="clip the gradients by their global norm before the optimizer step, as torchtitan (max_norm 1.0), "
        "Megatron-LM (--clip-grad 1.0) and FSDP recipes do by default: each rank reads its gradient shard for the "
        "norm and scales it (torch.nn.utils.clip_grad_norm_ always multiplies); false: no clipping (DeepSpeed's "
        "default)",
    )

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


class ParallelSpec(Spec):
    """Degrees and strategies; ranks are laid out tp innermost, then cp, dp, pp (Megatron order)."""

    dp: Degree = 1
    tp: Degree = 1
    pp: Degree = 1
    cp: Degree = 1
    sp: bool = Field(False, description="Megatron sequence parallelism on the TP group")
    zero: Annotated[Literal[0, 1, 2, 3], BeforeValidator(as_whole)] = Field(0, description="ZeRO stage; 3 = FSDP")
    fsdp: Literal["fsdp1", "fsdp2"] = Field(
        "fsdp2",
        description="with zero 3, the PyTorch FSDP whose buffer copies are priced: fsdp2 (fully_shard, PyTorch's "
        "current one, torchtitan's): shards copied into the all-gather input, the gathered buffer copied out into "
        "the parameters at every gather, gradients copied into the reduce-scatter input; fsdp1 "
        "(FullyShardedDataParallel with flat parameters, fms-fsdp's): views instead of the copy-out, the flat "
        "gradient concatenated and divided before the reduce-scatter",
    )
    fsdp_reduce_dtype: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="with zero 3, the dtype gradients are reduce-scattered in (FSDP's MixedPrecision.reduce_dtype)",
    )
    reshard_after_forward: Annotated[Literal["auto"] | bool | Degree, BeforeValidator(_reshard_value)] = (
        left_out_at_default(
            "auto",
            description="with zero 3, FSDP2's fully_shard(reshard_after_forward): true frees each module's gathered "
            "weights after its forward and gathers them again for its backward; false keeps them from the forward to "
            "the backward (under pp > 1 for the whole step, as torch.distributed.pipelining keeps them unsharded "
            "after backward too); an int n keeps a 1/n shard after forward and gathers the backward over n ranks; "
            "auto: false when pp > 1, else true (torchtitan)",
        )
    )
    grad_reduce: Literal["auto", "per_microbatch", "per_step"] = left_out_at_default(
        "auto",
        description="with zero >= 2, when gradients are reduce-scattered: after every micro-batch's backward, or "
        "once after the last one with the accumulation kept unsharded in between (FSDP2's "
        "set_requires_gradient_sync(False)); auto: per_step when pp > 1 (torch.distributed.pipelining), else "
        "per_microbatch (torchtitan, DeepSpeed ZeRO-2)",
    )
    dp_shard: Degree | None = left_out_at_default(
        None,
        description="HSDP: ZeRO shards over groups of dp_shard consecutive data-parallel ranks and replicates "
        "across the dp / dp_shard groups (gradients reduce-scattered in the group, then all-reduced across); "
        "unset: over all dp ranks",
    )
    grad_bucket_mb: Annotated[float, Gt(0), Le(MAX_CAPACITY_GIB * 1024)] | None = left_out_at_default(
        None,
        description="with zero 0, 1 or 2 in training, the data-parallel gradient reduction in buckets of this many "
        "MiB (PyTorch DDP's bucket_cap_mb; Megatron's bucket_size counts elements): parameters' gradients, in the "
        "order backward makes them, are packed into one collective until it holds at least this much, per collective "
        "and group (expert gradients on their own), and a bucket's collective starts once the backward of every module "
        "in it has ended; a module larger than a bucket fills several, split at its parameters as Megatron splits "
        "them; unset: one bucket per module. ZeRO 3 reduce-scatters each module's gradients in FSDP's post-backward "
        "instead (fsdp_prefetch is its scheduling knob)",
    )
    fsdp_prefetch: Annotated[Whole, Ge(0), Le(MAX_LAYERS)] = left_out_at_default(
        1,
        description="with zero 3 in training, how many modules ahead each module's weight all-gather is issued, in "
        "forward and backward (FSDP2's set_modules_to_forward_prefetch / set_modules_to_backward_prefetch with that "
        "many modules; 1 is FSDP's implicit prefetch): up to this many + 1 modules' gathered weights are alive at "
        "once; 0: each module's gather issued as it is about to run, exposed. Weights kept gathered over the step "
        "(reshard_after_forward false under pp > 1) are all gathered at its start whatever the depth",
    )
    pp_schedule: Literal["1f1b", "gpipe", "interleaved", "zb_h1", "dualpipev"] = Field(
        "1f1b",
        description="pipeline schedule: 1f1b, gpipe, interleaved (Megatron's interleaved 1F1B, with "
        "virtual_stages), zb_h1 (Qi et al. 2023's zero-bubble H1: 1F1B with each backward split into its input- and "
        "weight-gradient halves, weight gradients deferred into the bubbles, 1F1B's peak memory), dualpipev "
        "(DeepSeek-V3's DualPipe in its V form: two chunks per rank, virtual stages s and 2pp-1-s, backward split as "
        "zb_h1's; its forward-and-backward pairs run one after the other, without DualPipe's comm overlap)",
    )
    recompute: Literal["none", "selective", "full", "selective_op"] = Field(
        "none",
        description="activation recomputation: selective = Megatron's (core attention), selective_op = "
        "torchtitan's per-op policy (keeps matmul outputs but every second one, and attention's; recomputes the "
        "rest), full = whole layers",
    )
    ep: Degree = Field(1, description="expert parallelism: experts split over ep ranks carved from dp")
    virtual_stages: Layers = Field(1, description="model chunks per pipeline rank (interleaved 1F1B)")
    microbatch_group: Annotated[Count, Le(MAX_GLOBAL_BATCH)] | None = left_out_at_default(
        None,
        description="interleaved 1F1B: micro-batches a stage runs through one model chunk before the next "
        "(Megatron's microbatch_group_size_per_vp_stage); between pp and the micro-batches per step, leaving a last "
        "group of 0 or at least pp micro-batches; unset: pp, Megatron's default",
    )
    cp_algorithm: Literal["allgather", "ring"] = Field(
        "allgather",
        description="context parallelism: all-gather K/V over cp, or pass K/V chunks around the cp ring beside "
        "the attention of the chunk held (zigzag causal balance: rank r holds chunks r and 2cp-1-r)",
    )
    layer_strategies: Annotated[tuple[Literal["tp", "dp"], ...], BeforeValidator(as_tuple)] = Field(
        (),
        max_length=MAX_LAYERS,
        description="per layer, cycled: tp uses the tp ranks for tensor parallelism, dp as more data-parallel "
        "ranks (batch split, weights replicated, gradients reduced over tp and dp); empty: every layer tp",
    )
    recompute_every: Layers = Field(
        1,
        description="apply `recompute` to every n-th layer only (torchtitan's layer-level selective checkpointing, "
        "the FSDP blog's checkpointing of every n-th block); the other layers keep all their activations",
    )
    # Megatron-LM's communication overlaps (megatron/core/distributed, TransformerEngine userbuffers): their defaults
    # are the step as priced before they existed.
    overlap_grad_reduce: bool = left_out_at_default(
        True,
        description="data-parallel gradients reduced module by module as the last micro-batch's backward fills "
        "them, beside the rest of that backward (Megatron's --overlap-grad-reduce, whose own default is false; "
        "PyTorch DDP and FSDP always do, hence true here); false: every reduction (the all-reduce, or the "
        "distributed optimizer's reduce-scatter under zero 1 and 2) starts once the whole backward has ended, a "
        "blocking phase before the optimizer",
    )
    overlap_param_gather: bool = left_out_at_default(
        False,
        description="with zero 1 or 2 (Megatron's distributed optimizer), the updated parameters are all-gathered "
        "during the next step's forward, each module's just ahead of its first forward (Megatron's "
        "--overlap-param-gather, default false); false: one all-gather after the optimizer step, ending the step",
    )
    tp_comm_overlap: bool = left_out_at_default(
        False,
        description="with sp, TransformerEngine userbuffers (Megatron's --tp-comm-overlap, default false): the TP "
        "all-gathers feeding a GEMM run as a ring exchange of tp chunks beside the GEMM's chunks, and the "
        "reduce-scatters after a GEMM as tp chunks each following its GEMM chunk; the GEMMs run slower beside them "
        "by the accelerator's overlap_slowdown",
    )
    overlap_p2p_comm: bool = left_out_at_default(
        True,
        description="pipeline sends and receives run on their own streams beside the compute; false: each stage "
        "waits for its batched sends and receives before its next compute (Megatron's --no-overlap-p2p-"
        "communication; its flag defaults to overlapping, but Megatron turns it off for non-interleaved "
        "schedules, whose 1F1B runs batched, blocking p2p)",
    )
    first_stage_layers: Layers | None = left_out_at_default(
        None,
        description="layers on the first pipeline stage, which also holds the embedding (Megatron's "
        "decoder_first_pipeline_num_layers); unset: an even share",
    )
    last_stage_layers: Layers | None = left_out_at_default(
        None,
        description="layers on the last pipeline stage, which also holds the output layer and the loss (Megatron's "
        "decoder_last_pipeline_num_layers; Llama 3 405B ran 126 layers on 16 stages as 7, 8 x 14, 7); unset: an "
        "even share",
    )

    def layer_strategy(self, layer: int) -> str:
        return self.layer_strategies[layer % len(self.layer_strategies)] if self.layer_strategies else "tp"

    def stage_layers(self, layers: int) -> list[int]:
        """Layers per pipeline stage: first_stage_layers and last_stage_layers where set, the others an even share
        of the rest (`feasibility` checks that it divides)."""
        counts: list[int | None] = [None] * self.pp
        if self.first_stage_layers is not None:
            counts[0] = self.first_stage_layers
        if self.last_stage_layers is not None:
            counts[-1] = self.last_stage_layers
        unset = counts.count(None)
        share = (layers - sum(c for c in counts if c is not None)) // unset if unset else 0
        return [share if c is None else c for c in counts]

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


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
    system and workload, and sorting their keys was a twentieth of the driver's time per trial."""
    text = section.model_dump_json()
    ordered = _CANONICAL.get(text)
    if ordered is None:
        if len(_CANONICAL) >= CANONICAL_CACHE_SIZE:
            _CANONICAL.clear()
        ordered = _CANONICAL[text] = json.dumps(section.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return ordered


CANONICAL_CACHE_SIZE = 4096
_CANONICAL: dict[str, str] = {}


class DesignPoint(Spec):
    """Everything needed to generate and price one configuration."""

    model: ModelSpec
    workload: WorkloadSpec
    parallel: ParallelSpec
    system: SystemSpec

    @cached_property
    def key(self) -> str:
        """A hash of the canonical JSON of every field."""
        return _digest(self, ("model", "parallel", "system", "workload"))

    @cached_property
    def workload_key(self) -> str:
        """A hash of every field but the system's: what a generated workload depends on (generators cache by it)."""
        return _digest(self, ("model", "parallel", "workload"))

    @property
    def micro_batches(self) -> int:
        """Micro-steps per optimizer step on each DP rank (gradient accumulation)."""
        return self.workload.global_batch // (self.parallel.dp * self.workload.micro_batch)


@dataclass(frozen=True)
class Refinement:
    """A field that only means something while another field has certain values (`fsdp` under ZeRO 3 alone).
    Set to anything but its default while the other has none of them, it would be silently ignored: a point file
    that does so is an error, and so is a study in which no point could give it effect."""

    field: str
    """Dotted path of the refining field."""
    partner: str
    """Dotted path of the field it refines."""
    applies: Callable[[Any], bool]
    """Whether a value of the partner gives the field effect."""
    condition: str
    """The partner values that do, as a person would set them."""

    @property
    def default(self) -> Any:
        return default_of(self.field)


def default_of(path: str) -> Any:
    """The default of a field of a point's section, e.g. 'parallel.zero' -> 0."""
    section, name = path.split(".")
    return DesignPoint.model_fields[section].annotation.model_fields[name].default  # type: ignore[union-attr]


REFINEMENTS = (
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
    Refinement("parallel.grad_bucket_mb", "workload.mode", lambda mode: mode == "train", "workload.mode: train"),
    Refinement("parallel.fsdp_prefetch", "parallel.zero", lambda zero: zero == 3, "parallel.zero: 3"),
    Refinement("parallel.fsdp_prefetch", "workload.mode", lambda mode: mode == "train", "workload.mode: train"),
    Refinement("parallel.overlap_param_gather", "parallel.zero", lambda zero: zero in (1, 2), "parallel.zero 1 or 2"),
    Refinement("parallel.tp_comm_overlap", "parallel.sp", lambda sp: sp, "parallel.sp: true"),
    Refinement("parallel.overlap_p2p_comm", "parallel.pp", lambda pp: pp > 1, "parallel.pp above 1"),
    Refinement("model.rope_impl", "model.position", lambda position: position == "rope", "model.position: rope"),
    Refinement("workload.grad_clip", "workload.mode", lambda mode: mode == "train", "workload.mode: train"),
    Refinement(
        "workload.attention_kernel", "model.flash_attention", lambda fused: fused, "model.flash_attention: true"
    ),
)


def ignored_setting(point: DesignPoint) -> str | None:
    """Why a field the point sets would be ignored (see Refinement), or None."""
    for rule in REFINEMENTS:
        value, partner = (_at(point, path) for path in (rule.field, rule.partner))
        if value != rule.default and not rule.applies(partner):
            return (
                f"field '{rule.field}': {value!r} only takes effect with {rule.condition}, and {rule.partner} is "
                f"{partner!r}; remove {rule.field} or set {rule.condition}"
            )
    return None


def without_ignored_settings(point: DesignPoint) -> DesignPoint:
    """The point with every field that would be ignored (see Refinement) back at its default: the same step, as a
    point file that `ignored_setting` accepts. A study may set such a field for the points that use it (`fsdp:
    fsdp1` while searching zero over 1 and 3); its other points are written out without it."""
    sections: dict[str, dict[str, Any]] = {}
    for rule in REFINEMENTS:
        if _at(point, rule.field) != rule.default and not rule.applies(_at(point, rule.partner)):
            section, name = rule.field.split(".")
            sections.setdefault(section, {})[name] = rule.default
    updates = {section: getattr(point, section).model_copy(update=fields) for section, fields in sections.items()}
    return point.model_copy(update=updates) if updates else point


def _at(point: DesignPoint, path: str) -> Any:
    section, name = path.split(".")
    return getattr(getattr(point, section), name)
