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


class ModelSpec(Spec):
    """A dense decoder-only transformer (GPT or LLaMA style)."""

    name: str
    family: Literal["gpt", "llama"]
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt | None = Field(None, description="key/value heads (GQA); default: heads (MHA)")
    head_dim: PositiveInt | None = Field(None, description="default: hidden // heads")
    ffn: PositiveInt = Field(description="MLP inner width (per gate branch for SwiGLU)")
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

    mode: Literal["train"] = "train"
    seq_len: PositiveInt
    global_batch: PositiveInt = Field(description="sequences per optimizer step, over all DP ranks")
    micro_batch: PositiveInt = Field(1, description="sequences per DP rank per micro-step")

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
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    recompute: Literal["none", "selective", "full"] = "none"

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

    topology: Literal["ring", "switch", "fully_connected"]
    npus: PositiveInt
    bandwidth_GBps: PositiveFloat
    latency_ns: float = Field(ge=0)
    efficiency: float = Field(1.0, gt=0, le=1)

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


class DesignPoint(Spec):
    """Everything needed to generate and price one configuration."""

    model: ModelSpec
    workload: WorkloadSpec
    parallel: ParallelSpec
    system: SystemSpec

    @cached_property
    def key(self) -> str:
        """Stable across processes and runs: a hash of the canonical JSON of every field."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def micro_batches(self) -> int:
        """Micro-steps per optimizer step on each DP rank (gradient accumulation)."""
        return self.workload.global_batch // (self.parallel.dp * self.workload.micro_batch)
