"""The system a point runs on: its accelerator (peaks, HBM, kernel efficiencies and tables) and its hierarchical
network, in the same shape as ASTRA-sim's network dimensions, so one spec drives every cost model.

Files speak human units (GiB, GB/s, TFLOP/s, ns) with the unit in the field name; the properties give SI units.
"""

from math import prod
from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le
from pydantic import BeforeValidator, Field, model_validator

from dse.fields import (
    Capacity,
    Count,
    GiB,
    Name,
    OpCategory,
    PeakDtype,
    Rate,
    Share,
    Spec,
    Width,
    as_tuple,
    left_out_at_default,
)
from dse.limits import MAX_LAUNCH_US, MAX_NETWORK_DIMS, MAX_RATE, MAX_WORLD
from dse.network import NetworkDim
from dse.tables.source import KernelTables

ATTENTION_TABLE_DTYPES = ("bf16", "fp16")
"""The dtypes the attention kernels' benchmarks ran in, which their tables price (dse.kernels)."""
GEMM_TILE = (256, 128)
"""cuBLAS's output tile for a large GEMM, the default of AcceleratorSpec.gemm_tile."""

KernelRow = Annotated[tuple[Width, Width, Rate], BeforeValidator(as_tuple)]
"""[head_dim, seq_len, TFLOP/s]: one bar of a kernel benchmark's figure."""


class KernelCurves(Spec):
    """A fused attention kernel's measured TFLOP/s under one mask, as its benchmark counts FLOPs (forward 4 s^2 d per
    head and sequence, halved by the causal mask; backward 2.5 times the forward), by head dim and sequence length
    (queries = keys = seq_len, batch x seq_len fixed)."""

    fwd: list[KernelRow] = Field(min_length=1, description="forward pass")
    bwd: list[KernelRow] = Field(
        default_factory=list, description="backward pass; empty: not published (see AttentionKernelSpec)"
    )

    @model_validator(mode="after")
    def _check_rows(self) -> "KernelCurves":
        for name, rows in (("fwd", self.fwd), ("bwd", self.bwd)):
            sizes = [(head_dim, seq) for head_dim, seq, _ in rows]
            if len(set(sizes)) != len(sizes):
                raise ValueError(f"{name} gives a [head_dim, seq_len] more than once; keep one row per size")
        return self


class AttentionKernelSpec(Spec):
    """One attention kernel's microbenchmark on one accelerator, with and without the causal mask. A backward left
    out under one mask is the other mask's, scaled by the ratio of the two forwards at the same size (the masked
    tiles and the shorter average loop cost both passes alike: they share the tiling)."""

    causal: KernelCurves
    noncausal: KernelCurves

    @model_validator(mode="after")
    def _check_backward(self) -> "AttentionKernelSpec":
        if not (self.causal.bwd or self.noncausal.bwd):
            raise ValueError("needs a backward (bwd) under at least one mask, causal or noncausal")
        return self


ATTENTION_KERNELS = ("fa2", "fa3", "cudnn")
"""The fused attention kernels a table can be given for (AttentionKernels' fields of that name)."""


class AttentionKernels(Spec):
    """Measured tables of the fused attention kernels a point can name (workload.attention_kernel), each optional."""

    fa2: AttentionKernelSpec | None = Field(None, description="FlashAttention-2")
    fa3: AttentionKernelSpec | None = Field(None, description="FlashAttention-3 (Hopper GPUs)")
    cudnn: AttentionKernelSpec | None = Field(None, description="cuDNN fused attention (TransformerEngine's)")
    measured_peak_tflops: Rate | None = left_out_at_default(
        None,
        description="the peak TFLOP/s (of the dtype they price) of the accelerator the tables were measured on: an "
        "accelerator of another peak (a planner's 'the same chip at 600 TFLOP/s') runs every row scaled by its peak "
        "over this one, as the compute-bound kernels follow the tensor cores; unset: this accelerator's own peak",
    )

    def table(self, kernel: str) -> AttentionKernelSpec | None:
        return getattr(self, kernel)

    def rate_scale(self, peak_tflops: float) -> float:
        """What the tables' TFLOP/s are multiplied by on an accelerator of `peak_tflops` (see measured_peak_tflops)."""
        return 1.0 if self.measured_peak_tflops is None else peak_tflops / self.measured_peak_tflops

    @property
    def measured(self) -> list[str]:
        """The kernels with a table."""
        return [name for name in ATTENTION_KERNELS if getattr(self, name) is not None]


class MemoryTier(Spec):
    """One memory tier beside HBM (a dataflow chip's on-chip SRAM, its DDR): its capacity and bandwidth."""

    name: Name
    GiB: Annotated[Capacity, Gt(0)]
    bandwidth_GBps: Rate


class AcceleratorSpec(Spec):
    """One accelerator. Efficiencies are the share of peak a well-sized kernel of that category reaches.

    Memory: HBM (hbm_GiB at hbm_bandwidth_GBps), and on a chip with more tiers (`memory_tiers`: SRAM, DDR) every
    tier, fastest first. Placement rule: the step's working set (its peak memory: weights, gradients, optimizer
    states and activations alike) fills the tiers in order of bandwidth, fastest first, and a memory-bound kernel
    reads its bytes from the tiers in the shares the working set occupies them (a kernel's operands are a fair
    sample of the working set: nothing tells which tensors a compiler pins in SRAM), so each byte costs the
    tier-weighted time `seconds_per_byte`. Capacity (the memory constraint) is every tier's total, `memory_bytes`.
    """

    name: Name
    peak_tflops: dict[PeakDtype, Rate] = Field(min_length=1, description="dense peak TFLOP/s per dtype")
    hbm_GiB: Annotated[Capacity, Gt(0)]
    hbm_bandwidth_GBps: Rate
    compute_efficiency: dict[OpCategory, Share] = Field(description="share of peak FLOP/s per op category")
    memory_efficiency: Share = Field(0.85, description="share of HBM bandwidth reached")
    kernel_launch_us: float = Field(4.0, ge=0, le=MAX_LAUNCH_US, description="fixed cost per kernel")
    gemm_half_efficiency_gflop: float = Field(
        0.0,
        ge=0,
        le=MAX_RATE,
        description="GEMM size (GFLOP) at which a GEMM reaches half its efficiency (waves); 0: none",
    )
    sm_count: Annotated[Count, Le(4096)] | None = left_out_at_default(
        None,
        description="streaming multiprocessors: with it, a GEMM whose shape the workload gives is priced by how its "
        "output tiles fill the SMs over its waves (tile and wave quantization) instead of gemm_half_efficiency_gflop",
    )
    gemm_tile: Annotated[tuple[Width, Width], BeforeValidator(as_tuple)] = left_out_at_default(
        GEMM_TILE,
        description="output tile (rows, columns) cuBLAS computes per SM for a large GEMM; either way round",
    )
    overlap_slowdown: float = Field(
        0.0,
        ge=0,
        le=100,
        description="extra share of time compute takes while communication runs beside it (Charon)",
    )
    runtime_reserve_GiB: Capacity = Field(0.0, description="HBM taken before the step: CUDA context, NCCL")
    fragmentation: float = Field(
        0.0, ge=0, lt=1, description="share of the step's allocations lost to allocator fragmentation"
    )
    measured_table: str | None = Field(
        None, description="CSV (category,dtype,flops,bytes,time_us) of measured kernel times; used before roofline"
    )
    tdp_W: Annotated[float, Gt(0), Le(MAX_RATE)] | None = None
    # Both left out of the dump when unset, so the keys of points on accelerators without them stay what they were.
    attention_kernels: AttentionKernels | None = left_out_at_default(
        None,
        description="measured TFLOP/s of fused attention kernels by head dim, sequence length and mask, which price "
        "attention (workload.attention_kernel) instead of compute_efficiency.attention",
    )
    clock_share: Share = left_out_at_default(
        1.0,
        description="the SM clock as a share of the one the peaks, efficiencies and kernel tables were measured at "
        "(a power cap below the TDP they were measured at): scales every FLOP rate, not HBM bandwidth",
    )
    kernel_source: Literal["auto", "roofline", "tables"] = left_out_at_default(
        "auto",
        description="what prices GEMMs (and collectives within a node): the roofline with compute_efficiency.gemm and "
        "the tile model, or the measured per-shape tables of kernel_tables (the roofline still prices shapes outside "
        "them, and says so); auto: the tables where the accelerator has them",
    )
    kernel_tables: KernelTables | None = left_out_at_default(
        None, description="the measured kernel tables (aiconfigurator-core) that kernel_source: tables reads"
    )
    price_usd: Annotated[float, Ge(0), Le(1e9)] | None = left_out_at_default(
        None, description="list price of one accelerator with its share of the server around it (cost objectives)"
    )
    memory_tiers: list[MemoryTier] = left_out_at_default(
        [],
        description="memory tiers beside HBM (on-chip SRAM, DDR), fastest first: with HBM they hold the step's "
        "working set fastest tier first and price each memory-bound byte by the tier holding it (see the class "
        "docstring); empty: HBM only",
    )
    sources: list[str] = Field(default_factory=list, description="where the figures come from")

    @property
    def reads_tables(self) -> bool:
        """Whether the measured kernel tables price this accelerator's kernels (kernel_source tables, or auto with
        kernel_tables)."""
        return self.kernel_tables is not None and self.kernel_source != "roofline"

    @model_validator(mode="after")
    def _check_physics(self) -> "AcceleratorSpec":
        if self.kernel_source == "tables" and self.kernel_tables is None:
            raise ValueError(
                "kernel_source: tables needs kernel_tables (system, framework, version and the measured device's "
                "peak_tflops and hbm_bandwidth_GBps); add them or use kernel_source: roofline"
            )
        if self.gemm_tile != GEMM_TILE and self.sm_count is None:
            raise ValueError(
                "gemm_tile would be ignored: output tiles are counted against the SMs, and sm_count is unset; set "
                "sm_count or remove gemm_tile"
            )
        if (too_fast := self._kernel_above_peak()) is not None:
            raise ValueError(too_fast)
        names = [tier.name for tier in self.memory_tiers]
        if "hbm" in names or len(set(names)) != len(names):
            raise ValueError(
                "memory_tiers: each tier needs its own name, and not 'hbm' (HBM is hbm_GiB at hbm_bandwidth_GBps); "
                "rename the tier"
            )
        rates = [tier.bandwidth_GBps for tier in self.memory_tiers]
        if rates != sorted(rates, reverse=True):
            raise ValueError(
                f"memory_tiers: list the tiers fastest first (their bandwidth_GBps are {rates}); reorder them"
            )
        return self

    def _kernel_above_peak(self) -> str | None:
        """A measured attention kernel row faster than the peak of a dtype its table prices (a kernel cannot beat
        its accelerator's peak: a slip such as 3350 for 335 TFLOP/s would give an MFU above 1), or None."""
        if self.attention_kernels is None:
            return None
        peaks = {dtype: self.peak_tflops[dtype] for dtype in ATTENTION_TABLE_DTYPES if dtype in self.peak_tflops}
        if not peaks:
            return (
                "attention_kernels would be ignored: the kernels' tables price bf16 and fp16 attention, and "
                "peak_tflops has neither; add peak_tflops.bf16 or remove attention_kernels"
            )
        dtype, peak = min(peaks.items(), key=lambda item: item[1])
        what = f"peak_tflops.{dtype}"
        if (measured := self.attention_kernels.measured_peak_tflops) is not None:  # rows scale from that peak
            what, peak = "peak they were measured at (attention_kernels.measured_peak_tflops)", measured
        for kernel in self.attention_kernels.measured:
            table = self.attention_kernels.table(kernel)
            assert table is not None
            for mask in ("causal", "noncausal"):
                for direction in ("fwd", "bwd"):
                    for row in getattr(getattr(table, mask), direction):
                        if row[2] > peak:
                            return (
                                f"attention_kernels.{kernel}.{mask}.{direction}: row {list(row)} gives "
                                f"{row[2]:g} TFLOP/s, above the {what} of {peak:g}: no kernel runs faster than "
                                "its peak; fix the row or the peak"
                            )
        return None

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_GiB * GiB

    @property
    def hbm_bandwidth(self) -> float:
        return self.hbm_bandwidth_GBps * 1e9

    @property
    def tiers(self) -> list[tuple[float, float]]:
        """(bytes, bytes/s) of every memory tier, HBM among them, fastest first (HBM after tiers as fast)."""
        hbm = (self.hbm_bytes, self.hbm_bandwidth)
        others = [(tier.GiB * GiB, tier.bandwidth_GBps * 1e9) for tier in self.memory_tiers]
        faster = [tier for tier in others if tier[1] >= hbm[1]]
        return [*faster, hbm, *others[len(faster) :]]

    @property
    def memory_bytes(self) -> float:
        """What the step's tensors may occupy: HBM plus every other memory tier."""
        return self.hbm_bytes + sum(tier.GiB for tier in self.memory_tiers) * GiB

    def seconds_per_byte(self, working_set: float | None) -> float:
        """Seconds a memory-bound kernel takes per byte, at memory_efficiency of each tier's bandwidth, with the
        working set (bytes) placed fastest tier first (the class docstring); bytes beyond every tier's capacity
        are the slowest tier's. HBM only, or no working set given: the HBM bandwidth."""
        if not self.memory_tiers or working_set is None or working_set <= 0:
            return 1.0 / (self.hbm_bandwidth * self.memory_efficiency)
        tiers = self.tiers
        seconds, left = 0.0, working_set
        for index, (capacity, bandwidth) in enumerate(tiers):
            held = left if index == len(tiers) - 1 else min(left, capacity)
            seconds += held / bandwidth
            left -= held
        return seconds / (working_set * self.memory_efficiency)

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise ValueError(f"accelerator {self.name} has no peak_tflops for dtype {dtype}")
        return self.peak_tflops[dtype] * 1e12


class SystemSpec(Spec):
    name: Name
    accelerator: AcceleratorSpec
    network: list[NetworkDim] = Field(
        min_length=1, max_length=MAX_NETWORK_DIMS, description="dimensions, innermost first"
    )

    @model_validator(mode="after")
    def _check_size(self) -> "SystemSpec":
        if self.network[0].rails:
            raise ValueError(
                "network.0.rails: rails route traffic between local ranks through a scale-up dimension inside them, "
                "and the first dimension has none; remove rails or add the scale-up dimension first"
            )
        if self.network[0].collectives != "flat":
            raise ValueError(
                f"network.0.collectives: {self.network[0].collectives} says how a group crosses a dimension from the "
                "ones inside it, and the first dimension has none; remove it or set it on an outer dimension"
            )
        if self.npus > MAX_WORLD:
            sizes = " x ".join(str(dim.npus) for dim in self.network)
            raise ValueError(
                f"network.*.npus = {sizes} = {self.npus} NPUs exceeds the limit of {MAX_WORLD:,} (README: Limits); "
                "lower the npus of a dimension"
            )
        return self

    @property
    def npus(self) -> int:
        return prod(dim.npus for dim in self.network)
