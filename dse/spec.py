"""The domain model: what a design point is.

Files speak human units (GiB, GB/s, TFLOP/s, ns) with the unit in the field name; the properties below give SI
units (bytes, bytes/s, FLOP/s, seconds), which is all the code inside ever uses.
"""

import hashlib
import json
from functools import cached_property
from math import prod
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

GiB = 1024**3
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
Dtype = Literal["fp32", "bf16", "fp16", "fp8"]
OpCategory = Literal["gemm", "attention", "elementwise", "norm", "embedding", "optimizer", "other"]


class Spec(BaseModel):
    """Frozen, strict about unknown fields (a misspelt field is an error, not a silent default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class MoESpec(Spec):
    """Mixture-of-experts MLP (Mixtral: 8 experts top-2; DeepSeek: fine-grained routed plus shared experts)."""

    experts: PositiveInt = Field(description="routed experts per MoE layer")
    top_k: PositiveInt = Field(description="routed experts each token goes to")
    expert_ffn: PositiveInt = Field(description="inner width of one expert (per gate branch for SwiGLU)")
    shared_experts: int = Field(0, ge=0, description="experts every token goes to (DeepSeek)")
    first_dense_layers: int = Field(0, ge=0, description="leading layers with a dense MLP of width model.ffn")


class MLASpec(Spec):
    """DeepSeek multi-head latent attention: low-rank compressed K/V (and optionally Q), decoupled RoPE."""

    kv_lora_rank: PositiveInt
    q_lora_rank: PositiveInt | None = Field(None, description="None: a full-rank query projection")
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    v_head_dim: PositiveInt


class SSMSpec(Spec):
    """Mamba selective state-space layers; with attention_every, a hybrid stack (Jamba style)."""

    state: PositiveInt = Field(16, description="SSM state size N per channel")
    conv: PositiveInt = Field(4, description="depthwise causal convolution width")
    expand: PositiveInt = Field(2, description="inner width = expand * hidden")
    dt_rank: PositiveInt | None = Field(None, description="default: ceil(hidden / 16)")
    attention_every: PositiveInt | None = Field(
        None, description="hybrid: every k-th layer (k-1, 2k-1, ...) is attention + MLP, the rest SSM"
    )


class ModelSpec(Spec):
    """A decoder-only model: dense transformer (gpt, llama), MoE (mixtral, deepseek), SSM (mamba) or hybrid."""

    name: str
    family: Literal["gpt", "llama", "mixtral", "deepseek", "mamba", "hybrid"]
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt = Field(1, description="attention heads (unused by pure SSM models)")
    kv_heads: PositiveInt | None = Field(None, description="key/value heads (GQA); default: heads (MHA)")
    head_dim: PositiveInt | None = Field(None, description="default: hidden // heads")
    ffn: PositiveInt = Field(1, description="MLP inner width (per gate branch for SwiGLU); dense layers of MoE")
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
    vocab: PositiveInt
    norm: Literal["layernorm", "rmsnorm"]
    activation: Literal["gelu", "swiglu"]
    position: Literal["rope", "learned"] = "rope"
    max_seq: PositiveInt | None = Field(None, description="rows of a learned position table")
    tied_embeddings: bool = False
    bias: bool = False
    dtype: Dtype = "bf16"

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
        if self.moe and self.moe.top_k > self.moe.experts:
            raise ValueError(f"moe.top_k={self.moe.top_k} exceeds moe.experts={self.moe.experts}")
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
    seq_len: PositiveInt
    global_batch: PositiveInt = Field(description="sequences per optimizer step, over all DP ranks")
    micro_batch: PositiveInt = Field(1, description="sequences per DP rank per micro-step")
    kernels: Literal["fused", "eager"] = Field(
        "fused",
        description="fused: each norm, RoPE and activation is one kernel (Megatron/TransformerEngine, "
        "torch.compile); eager: PyTorch eager as the reference Llama code runs it, one kernel per op with fp32 "
        "intermediates (RMSNorm, RoPE), SiLU and gate product apart, GQA keys/values copied to every head",
    )

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


class ParallelSpec(Spec):
    """Degrees and strategies; ranks are laid out tp innermost, then cp, dp, pp (Megatron order)."""

    dp: PositiveInt = 1
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    cp: PositiveInt = 1
    sp: bool = Field(False, description="Megatron sequence parallelism on the TP group")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage; 3 = FSDP")
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
    pp_schedule: Literal["1f1b", "gpipe", "interleaved"] = "1f1b"
    recompute: Literal["none", "selective", "full", "selective_op"] = Field(
        "none",
        description="activation recomputation: selective = Megatron's (core attention), selective_op = "
        "torchtitan's per-op policy (keeps matmul outputs but every second one, and attention's; recomputes the "
        "rest), full = whole layers",
    )
    ep: PositiveInt = Field(1, description="expert parallelism: experts split over ep ranks carved from dp")
    virtual_stages: PositiveInt = Field(1, description="model chunks per pipeline rank (interleaved 1F1B)")
    cp_algorithm: Literal["allgather", "ring"] = Field(
        "allgather",
        description="context parallelism: all-gather K/V over cp, or pass K/V chunks around the cp ring beside "
        "the attention of the chunk held (zigzag causal balance: rank r holds chunks r and 2cp-1-r)",
    )
    layer_strategies: tuple[Literal["tp", "dp"], ...] = Field(
        (),
        description="per layer, cycled: tp uses the tp ranks for tensor parallelism, dp as more data-parallel "
        "ranks (batch split, weights replicated, gradients reduced over tp and dp); empty: every layer tp",
    )
    recompute_every: PositiveInt = Field(
        1,
        description="apply `recompute` to every n-th layer only (torchtitan's layer-level selective checkpointing, "
        "the FSDP blog's checkpointing of every n-th block); the other layers keep all their activations",
    )
    # Left out of the dump when unset, like NetworkDim.reduction_efficiency: stored studies keep their keys.
    first_stage_layers: PositiveInt | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="layers on the first pipeline stage, which also holds the embedding (Megatron's "
        "decoder_first_pipeline_num_layers); unset: an even share",
    )
    last_stage_layers: PositiveInt | None = Field(
        None,
        exclude_if=lambda value: value is None,
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


class AcceleratorSpec(Spec):
    """One accelerator. Efficiencies are the share of peak a well-sized kernel of that category reaches."""

    name: str
    peak_tflops: dict[Dtype, PositiveFloat] = Field(description="dense peak TFLOP/s per dtype")
    hbm_GiB: PositiveFloat
    hbm_bandwidth_GBps: PositiveFloat
    compute_efficiency: dict[OpCategory, float] = Field(description="share of peak FLOP/s per op category")
    memory_efficiency: float = Field(0.85, gt=0, le=1, description="share of HBM bandwidth reached")
    kernel_launch_us: float = Field(4.0, ge=0, description="fixed cost per kernel")
    gemm_half_efficiency_gflop: float = Field(
        0.0, ge=0, description="GEMM size (GFLOP) at which a GEMM reaches half its efficiency (waves); 0: none"
    )
    overlap_slowdown: float = Field(
        0.0, ge=0, description="extra share of time compute takes while communication runs beside it (Charon)"
    )
    runtime_reserve_GiB: float = Field(0.0, ge=0, description="HBM taken before the step: CUDA context, NCCL")
    fragmentation: float = Field(
        0.0, ge=0, lt=1, description="share of the step's allocations lost to allocator fragmentation"
    )
    measured_table: str | None = Field(
        None, description="CSV (category,dtype,flops,bytes,time_us) of measured kernel times; used before roofline"
    )
    tdp_W: PositiveFloat | None = None
    sources: list[str] = Field(default_factory=list, description="where the figures come from")

    @model_validator(mode="after")
    def _check(self) -> "AcceleratorSpec":
        for cat, eff in self.compute_efficiency.items():
            if not 0 < eff <= 1:
                raise ValueError(f"compute_efficiency.{cat}={eff} must be in (0, 1]")
        return self

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_GiB * GiB

    @property
    def hbm_bandwidth(self) -> float:
        return self.hbm_bandwidth_GBps * 1e9

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise ValueError(f"accelerator {self.name} has no peak_tflops for dtype {dtype}")
        return self.peak_tflops[dtype] * 1e12


class NetworkDim(Spec):
    """One level of the hierarchical network, the same shape as an ASTRA-sim network dimension.

    bandwidth_GBps is what one NPU can send into this dimension in one direction; efficiency scales it to what a
    collective achieves (the nccl-tests bus bandwidth over the line rate).
    """

    topology: Literal["ring", "switch", "fully_connected", "torus2d", "torus3d"]
    npus: PositiveInt
    bandwidth_GBps: PositiveFloat
    latency_ns: float = Field(ge=0)
    efficiency: float = Field(1.0, gt=0, le=1)
    algorithm: Literal["auto", "ring", "direct", "halving_doubling", "tree"] = Field(
        "auto", description="collective algorithm; auto: direct on fully_connected, ring elsewhere"
    )
    shape: list[PositiveInt] | None = Field(
        None, description="torus side lengths (product = npus); default: as square or cubic as npus allows"
    )
    reduction_efficiency: float | None = Field(
        None,
        gt=0,
        le=1,
        # Left out of the dump when unset, so the keys of points on switches without it stay what they were.
        exclude_if=lambda value: value is None,
        description="a switch that reduces in the network (NVLink SHARP, InfiniBand SHARP): an all-reduce crosses "
        "each NPU's link once each way, at this share of the line rate; unset: the NPUs reduce",
    )
    reduction_latency_ns: float | None = Field(
        None,
        ge=0,
        exclude_if=lambda value: value is None,
        description="fixed cost of an all-reduce through the switch (NCCL's NVLS); an all-reduce runs the faster "
        "of that and the NPUs' own algorithm at its size; unset: twice latency_ns",
    )

    @model_validator(mode="after")
    def _check_shape(self) -> "NetworkDim":
        if self.shape is not None:
            if not self.topology.startswith("torus"):
                raise ValueError(f"shape is only for torus topologies, not '{self.topology}'; remove it")
            if len(self.shape) != int(self.topology[-2]) or prod(self.shape) != self.npus:
                raise ValueError(f"shape {self.shape} must have {self.topology[-2]} sides whose product is npus")
        if self.reduction_efficiency is not None and self.topology != "switch":
            raise ValueError(
                f"reduction_efficiency is only for a switch, which can reduce in the network, not '{self.topology}';"
                " remove it"
            )
        if self.reduction_latency_ns is not None and self.reduction_efficiency is None:
            raise ValueError("reduction_latency_ns needs reduction_efficiency (the switch's reduction); set it")
        return self

    @property
    def bandwidth(self) -> float:
        """Achievable bytes/s per NPU."""
        return self.bandwidth_GBps * 1e9 * self.efficiency

    @property
    def latency(self) -> float:
        return self.latency_ns * 1e-9


class SystemSpec(Spec):
    name: str
    accelerator: AcceleratorSpec
    network: list[NetworkDim] = Field(min_length=1, description="dimensions, innermost first")

    @property
    def npus(self) -> int:
        return prod(dim.npus for dim in self.network)


def _digest(spec: "DesignPoint", fields: tuple[str, ...]) -> str:
    """A short hash of the canonical JSON of the point's `fields` (sorted): json.dumps(the fields' model_dump,
    sort_keys=True, separators=(",", ":")). Stable across processes, runs and versions: a resumed study finds its
    evaluated points by it, and `dse compare` matches fronts by it. Built field by field from `_canonical`, the
    same text, since json.dumps nests a sorted object's text as it is."""
    canonical = "{" + ",".join(f'"{name}":{_canonical(getattr(spec, name))}' for name in fields) + "}"
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _canonical(section: Spec) -> str:
    """json.dumps(section.model_dump(mode="json"), sort_keys=True, separators=(",", ":")), kept by pydantic's own
    JSON of the section (equal for equal sections, and a tenth of the cost): a study's points share their model,
    system and workload, and sorting their keys was a twentieth of the driver's time per trial."""
    text = section.model_dump_json()
    canonical = _CANONICAL.get(text)
    if canonical is None:
        if len(_CANONICAL) >= CANONICAL_CACHE_SIZE:
            _CANONICAL.clear()
        canonical = _CANONICAL[text] = json.dumps(
            section.model_dump(mode="json"), sort_keys=True, separators=(",", ":")
        )
    return canonical


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
