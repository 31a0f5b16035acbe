"""Time of one compute kernel: a measured table when it covers the op, the roofline otherwise.

Roofline: a kernel is bound either by its arithmetic or by its HBM traffic, whichever takes longer at the share of
peak that kernels of its category reach in practice, plus a fixed launch cost, at the peak of the workload's
dtype. A GEMM too small to fill every SM for several waves reaches less than its category's efficiency:
efficiency(f) = efficiency * f / (f + f_half), f the GEMM's FLOPs and f_half the accelerator's
`gemm_half_efficiency_gflop` (the size at which half the large-GEMM efficiency is lost to the last, partly filled
wave and the prologue/epilogue). In time that is a fixed fill-and-drain cost per GEMM,
t = (f + f_half) / (peak * efficiency): negligible for large GEMMs, dominant for small ones.

A fused attention kernel's share of peak is not one figure: it grows with the sequence length and the head dim,
and differs by pass, mask and kernel. Where the accelerator has the measured table of the workload's kernel
(`dse.kernels`), an attention op that says its shape runs at that table's TFLOP/s for it instead of
compute_efficiency.attention. Every FLOP rate runs at the accelerator's `clock_share` (a power cap's lower SM clock);
HBM bandwidth does not. On an accelerator with memory tiers (SRAM, HBM, DDR) a byte costs the tier-weighted time of
the tiers the step's working set fills, fastest first (`AcceleratorSpec.seconds_per_byte`).

Where the op says its shape (`Op.gemm`: batch, m, n, k) and the accelerator its SM count, the size model is the
GEMM's own tiling instead (NVIDIA's 'Matrix Multiplication Background' guide, tile and wave quantization): cuBLAS
splits the m x n output into tiles (`gemm_tile`, either way round, whichever wastes less), one SM computes a tile
at a time, so the kernel runs ceil(tiles / SMs) waves and reaches the category's efficiency times the share of
those waves' tile slots the output fills. A GEMM with fewer tiles than SMs has its k split over the idle SMs
(split-K) while each split keeps at least SPLIT_K_MIN_DEPTH of k.

A measured table (CSV: category, dtype, flops, bytes, time_us) is interpolated log-log along FLOPs (along bytes
for ops without FLOPs) between the two nearest rows of the op's category and dtype; outside the measured range
the kernel table or the roofline prices the op. `ComputeModel.source` says which one priced an op, and the timeline
carries it.

No table makes a kernel faster than the accelerator: a row faster than its dtype's peak FLOP/s or the HBM bandwidth
is refused when the point loads (README: Point files), an op is never priced below its FLOPs at peak or its bytes at
the HBM bandwidth, and a kernel table's rate never above the peak.
"""

import csv
from bisect import bisect_left
from math import ceil, exp, isfinite, log
from pathlib import Path
from typing import Any, get_args

from dse.errors import SpecError
from dse.fields import DTYPE_BYTES, OpCategory
from dse.kernels import attention_table, covers, kernel_rate
from dse.system import AcceleratorSpec, AttentionKernelSpec
from dse.tables.attention import MeasuredAttention
from dse.tables.gemm import MeasuredGemms
from dse.workload import Op

ROOFLINE, TABLE, KERNEL_TABLE, FREE = "roofline", "table", "kernel_table", "free"
GEMM_TABLE, ATTENTION_TABLE, OUTSIDE_TABLE = "gemm_table", "attention_table", "roofline_outside_table"
FRAMEWORK_KERNEL = "framework"
"""workload.attention_kernel naming the serving framework's own attention kernel, which the measured attention
tables time (TensorRT-LLM's FMHA, vLLM's and SGLang's FlashAttention builds): a training step runs FlashAttention
through PyTorch, so its attention is never read from them."""
"""A GEMM or a fused attention op priced by the accelerator's measured per-shape tables; one they could not price (a
dtype they did not time, a size below theirs, a head dim beside theirs), priced by the existing path instead."""
SPLIT_K_MIN_DEPTH = 256
"""The least k a split-K slice keeps: a few iterations of a 32-64 deep k tile, so a slice's fixed prologue and
epilogue stay short beside its main loop."""
FIELD = "field 'system.accelerator.measured_table'"
KERNEL_TABLES_FIELD = "system.accelerator.kernel_tables"
OP_CATEGORIES: tuple[str, ...] = get_args(OpCategory)
ROUNDING = 1 + 1e-9
"""A row exactly at a peak, given in microseconds, is at it: its rate in floating point may be a hair above."""
MAX_TABLE_BYTES = 2**26
"""A measured table's size limit (64 MiB; a thorough sweep is a few thousand rows)."""


class MeasuredTable:
    """Measured kernel times per (category, dtype), sorted along the size they are interpolated on.

    Every row is checked against physics when the table is read: its FLOPs no faster than the accelerator's peak
    for its dtype, its bytes no faster than the HBM bandwidth (a row in microseconds given in seconds, or a size
    off by 1e3, would otherwise give an MFU of 10^7). Log-log interpolation between two such rows stays within
    both bounds: the rate it gives runs monotonically between the two rows' rates."""

    def __init__(self, path: Path, accelerator: AcceleratorSpec) -> None:
        self.path = path
        rows: dict[tuple[str, str, bool], list[tuple[float, float]]] = {}
        try:
            if not path.is_file():  # a folder, or a device or pipe that could be read forever
                raise SpecError(f"{FIELD}: {path} is not a file; fix the path")
            if path.stat().st_size > MAX_TABLE_BYTES:
                raise SpecError(f"{FIELD}: {path} is over {MAX_TABLE_BYTES:,} bytes; is it the CSV?")
            with path.open(newline="", encoding="utf-8") as handle:
                for number, row in enumerate(csv.DictReader(handle), start=2):
                    key, size, seconds = _row(row, path, number)
                    _check_physics(row, key, seconds, accelerator, f"{FIELD}: {path}: line {number}")
                    rows.setdefault(key, []).append((size, seconds))
        except OSError as exc:
            raise SpecError(f"{FIELD}: cannot read {path} ({exc.strerror}); fix the path") from None
        except (UnicodeDecodeError, csv.Error) as exc:
            raise SpecError(f"{FIELD}: {path} is not UTF-8 CSV text ({exc}); fix the file") from None
        self._rows = {key: sorted(values) for key, values in rows.items()}

    def lookup(self, op: Op, dtype: str) -> float | None:
        """Seconds interpolated for the op, or None when no two rows bracket its size (one exact row will do)."""
        by_flops = op.flops > 0
        size = op.flops * op.density if by_flops else op.bytes
        rows = self._rows.get((op.category, dtype, by_flops))
        if not rows or size <= 0:
            return None
        sizes = [s for s, _ in rows]
        i = bisect_left(sizes, size)
        if i < len(rows) and sizes[i] == size:
            return rows[i][1]
        if i == 0 or i == len(rows):
            return None
        (s0, t0), (s1, t1) = rows[i - 1], rows[i]
        w = (log(size) - log(s0)) / (log(s1) - log(s0))
        return exp(log(t0) + w * (log(t1) - log(t0)))


def _row(row: dict[str, Any], path: Path, number: int) -> tuple[tuple[str, str, bool], float, float]:
    """One CSV row as ((category, dtype, keyed by FLOPs), the size it is keyed by, seconds)."""
    where = f"{FIELD}: {path}: line {number}"
    try:
        flops, nbytes, micros = float(row["flops"] or 0), float(row["bytes"] or 0), float(row["time_us"])
        category, dtype = row["category"].strip(), row["dtype"].strip()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SpecError(f"{where} needs category,dtype,flops,bytes,time_us with numbers ({exc})") from None
    if category not in OP_CATEGORIES:
        raise SpecError(f"{where}: category {category!r} prices no op; use one of {', '.join(OP_CATEGORIES)}")
    if dtype not in DTYPE_BYTES:
        raise SpecError(f"{where}: dtype {dtype!r} prices no op; use one of {', '.join(DTYPE_BYTES)}")
    by_flops = flops > 0
    size = flops if by_flops else nbytes
    if not (isfinite(size) and isfinite(nbytes) and isfinite(micros)) or size <= 0 or nbytes < 0 or micros <= 0:
        raise SpecError(f"{where} needs a positive, finite size (flops or bytes) and time_us")
    return (category, dtype, by_flops), size, micros * 1e-6


def _check_physics(
    row: dict[str, Any], key: tuple[str, str, bool], seconds: float, accelerator: AcceleratorSpec, where: str
) -> None:
    """A row faster than the accelerator's peak FLOP/s for its dtype or its HBM bandwidth is refused."""
    _, dtype, _ = key
    flops, nbytes = float(row["flops"] or 0), float(row["bytes"] or 0)
    if flops and dtype in accelerator.peak_tflops and flops / seconds > accelerator.peak_flops(dtype) * ROUNDING:
        raise SpecError(
            f"{where}: {flops:g} FLOPs in {seconds * 1e6:g} us is {flops / seconds / 1e12:.4g} TFLOP/s, above "
            f"the peak_tflops.{dtype} of {accelerator.peak_tflops[dtype]:g} of accelerator '{accelerator.name}': no "
            "kernel runs faster than its peak; fix the row (time_us is in microseconds) or the peak"
        )
    if nbytes / seconds > accelerator.hbm_bandwidth * ROUNDING:
        raise SpecError(
            f"{where}: {nbytes:g} bytes in {seconds * 1e6:g} us is {nbytes / seconds / 1e9:.4g} GB/s, above "
            f"the hbm_bandwidth_GBps of {accelerator.hbm_bandwidth_GBps:g} of accelerator '{accelerator.name}': no "
            "kernel moves bytes faster than its memory; fix the row (time_us is in microseconds) or the bandwidth"
        )


def compute_time(
    op: Op,
    accelerator: AcceleratorSpec,
    dtype: str,
    attention: AttentionKernelSpec | None = None,
    working_set: float | None = None,
) -> float:
    """Seconds one compute op takes by the roofline, its math at the rate `attention` (the workload's kernel table)
    gives a fused attention op of known shape, its bytes at the memory tiers the step's `working_set` (bytes)
    fills (`AcceleratorSpec.seconds_per_byte`); an op that neither computes nor moves bytes is free."""
    if op.flops == 0 and op.bytes == 0:
        return 0.0
    math = 0.0
    if op.flops:
        executed = op.flops * op.density
        peak = kernel_rate(attention, op)
        if peak is not None:  # a backward derived from the other mask's may not exceed the peak either
            kernels = accelerator.attention_kernels
            scale = kernels.rate_scale(accelerator.peak_tflops[dtype]) if kernels is not None else 1.0
            peak = min(peak * scale, accelerator.peak_flops(dtype))
        else:
            efficiency = accelerator.compute_efficiency.get(op.category)
            if efficiency is None:
                raise SpecError(
                    f"accelerator '{accelerator.name}' has no system.accelerator.compute_efficiency.{op.category} "
                    f"(needed by op '{op.name}'); add it to the point's accelerator or its catalog entry"
                )
            peak = accelerator.peak_flops(dtype) * efficiency
        peak *= accelerator.clock_share
        if op.gemm is not None and accelerator.sm_count:
            math = executed / (peak * tile_share(op.gemm, accelerator.sm_count, accelerator.gemm_tile))
        else:
            math = executed / peak
            if op.category == "gemm" and accelerator.gemm_half_efficiency_gflop:
                math += accelerator.gemm_half_efficiency_gflop * 1e9 / peak
    memory = op.bytes * accelerator.seconds_per_byte(working_set)
    return max(math, memory) + accelerator.kernel_launch_us * 1e-6


def tile_share(shape: tuple[float, float, float, float], sms: int, tile: tuple[int, int]) -> float:
    """The share of its waves' tile slots a GEMM of this (batch, m, n, k) fills, with the tile either way round
    (the better of the two), k split over idle SMs when the tiles do not fill one wave."""
    batch, m, n, k = (max(1.0, x) for x in shape)
    return max(_oriented_share(batch, m, n, k, sms, tm, tn) for tm, tn in (tile, tile[::-1]))


def _oriented_share(batch: float, m: float, n: float, k: float, sms: int, tm: int, tn: int) -> float:
    tiles = batch * _ceil(m / tm) * _ceil(n / tn)
    splits = max(1, min(int(sms // tiles), int(k // SPLIT_K_MIN_DEPTH))) if tiles < sms else 1
    waves = _ceil(tiles * splits / sms)
    return batch * m * n * splits / (waves * sms * tm * tn)


def _ceil(x: float) -> int:
    """ceil, forgiving the rounding of sizes divided by parallel degrees (8192 / 3 * 3)."""
    return ceil(x - 1e-9 * max(1.0, x))


class ComputeModel:
    """Prices compute ops for one accelerator and dtype, from its measured table first when it has one."""

    def __init__(
        self,
        accelerator: AcceleratorSpec,
        dtype: str,
        attention_kernel: str = "auto",
        working_set: float | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.dtype = dtype
        self.working_set = working_set
        """The step's peak bytes, which place it in the accelerator's memory tiers (None: HBM alone)."""
        framework = attention_kernel == FRAMEWORK_KERNEL
        self.attention = None if framework else attention_table(accelerator, attention_kernel, dtype)
        """The published table of the workload's attention kernel; None: compute_efficiency.attention prices it (or,
        for the framework's own kernel, the measured attention tables where they cover the call)."""
        self.table: MeasuredTable | None = None
        if accelerator.measured_table:  # load_point made a point file's relative path absolute (its folder's)
            self.table = MeasuredTable(Path(accelerator.measured_table), accelerator)
        self.per_shape: dict[str, tuple[MeasuredGemms | MeasuredAttention, str]] = {}
        """Per op category, the measured per-shape tables that price it and the source they give."""
        if accelerator.reads_tables:
            tables = accelerator.kernel_tables
            assert tables is not None  # AcceleratorSpec refuses tables without them
            self.per_shape = {"gemm": (MeasuredGemms(tables, accelerator, dtype, KERNEL_TABLES_FIELD), GEMM_TABLE)}
            if framework:  # the tables time the serving framework's kernel, not FlashAttention's: only its calls
                measured = MeasuredAttention(tables, accelerator, dtype, KERNEL_TABLES_FIELD)
                self.per_shape["attention"] = (measured, ATTENTION_TABLE)
        elif framework:
            raise SpecError(
                f"field 'workload.attention_kernel': {FRAMEWORK_KERNEL} is the kernel the measured tables timed "
                "under their framework; set system.accelerator.kernel_source: tables, or name fa2, fa3 or cudnn"
            )

    def _physical_floor(self, op: Op) -> float:
        """The least time the op can take: its FLOPs at the accelerator's peak, its bytes at the HBM bandwidth. A
        table row holds one kernel's FLOPs or bytes; an op priced by the row's FLOPs may move more bytes than it."""
        accelerator = self.accelerator
        flops = op.flops * op.density / accelerator.peak_flops(self.dtype) if op.flops else 0.0
        return max(flops, op.bytes / accelerator.hbm_bandwidth)

    def price(self, op: Op) -> tuple[float, str]:
        """(seconds, source): source is 'table' (the measured CSV), 'gemm_table' or 'attention_table' (the
        accelerator's measured per-shape tables), 'kernel_table' (the attention kernel's table), 'roofline',
        'roofline_outside_table' (a GEMM or fused attention op the per-shape tables could not price, priced by the
        roofline or the attention kernel's table) or 'free' (an op with no work runs no kernel)."""
        if op.flops == 0 and op.bytes == 0:
            return 0.0, FREE
        if self.table is not None:
            measured = self.table.lookup(op, self.dtype)
            if measured is not None:
                return max(measured, self._physical_floor(op)), TABLE
        if (per_shape := self.per_shape.get(op.category)) is not None:
            tables, source = per_shape
            measured = tables.seconds(op)
            if measured is not None:
                return max(measured, self._physical_floor(op)), source
            return compute_time(op, self.accelerator, self.dtype, self.attention, self.working_set), OUTSIDE_TABLE
        seconds = compute_time(op, self.accelerator, self.dtype, self.attention, self.working_set)
        return seconds, KERNEL_TABLE if covers(self.attention, op) else ROOFLINE
