"""Fused attention priced by its kernel's own microbenchmark: which measured table prices a workload's attention,
and the TFLOP/s one kernel call reaches by it.

The tables (AcceleratorSpec.attention_kernels) are the kernels' published benchmarks: TFLOP/s by head dim and
sequence length, forward and backward, with and without the causal mask, for queries = keys = seq_len. A call of
another shape (a context-parallel rank's query chunk against every key, a ring step's chunk against another's) is
looked up at the sequence length with the same query x key count, sqrt(queries * keys): the kernel's loss at short
lengths is a fixed cost per tile row (loading its block, writing its output, the partly masked diagonal tiles),
paid per query block over the keys in forward and per key block over the queries in backward, so the geometric mean
weighs both alike, and it is the table's own length on a square call.

Between measured lengths the TFLOP/s is interpolated linearly in log(seq_len) (the benchmarks double the length from
bar to bar), between head dims linearly; outside the measured range it is the nearest measured figure. Clamping is
the honest extrapolation: above the longest length the curves have flattened (FlashAttention-2 on H100 gains 0-2
TFLOP/s from 8k to 16k tokens: the kernel is bound by its inner loop, which more of the same does not speed up),
while below the shortest, or beyond the widest head, any curve drawn would be invented (the clamped figure is then
an upper bound on a shorter call's rate).
"""

from bisect import bisect_left
from math import log, sqrt

from dse.system import ATTENTION_TABLE_DTYPES, AcceleratorSpec, AttentionKernelSpec, KernelRow
from dse.workload import AttentionShape, Op

AUTO_KERNEL = "fa2"
"""What `attention_kernel: auto` runs where the accelerator has its table: PyTorch's SDPA dispatches to
FlashAttention-2, and the calibration set's runs used it."""
TABLE_DTYPES = ATTENTION_TABLE_DTYPES
"""The dtypes the kernels' benchmarks ran in; another dtype's attention is priced by the flat efficiency."""


def attention_table(accelerator: AcceleratorSpec, kernel: str, dtype: str) -> AttentionKernelSpec | None:
    """The measured table that prices the workload's fused attention, or None for the flat
    compute_efficiency.attention: the named kernel's, or for auto FlashAttention-2's where the accelerator has one."""
    if dtype not in TABLE_DTYPES or accelerator.attention_kernels is None:
        return None
    return accelerator.attention_kernels.table(AUTO_KERNEL if kernel == "auto" else kernel)


def covers(table: AttentionKernelSpec | None, op: Op) -> bool:
    """Whether the table prices the op: a fused attention op whose generator gave its shape."""
    return table is not None and op.category == "attention" and op.attention is not None


def kernel_rate(table: AttentionKernelSpec | None, op: Op) -> float | None:
    """FLOP/s the table gives the op's executed FLOPs; None where it does not cover the op."""
    if not covers(table, op):
        return None
    assert table is not None and op.attention is not None
    return kernel_tflops(table, op.attention) * 1e12


def kernel_tflops(table: AttentionKernelSpec, shape: AttentionShape) -> float:
    """TFLOP/s of one kernel call, as the benchmark counts its FLOPs (the op's executed FLOPs). A backward not
    measured under the call's mask is the other mask's, times the ratio of the two masks' forwards at that size."""
    seq = sqrt(shape.queries * shape.keys)
    mask, other = (table.causal, table.noncausal) if shape.causal else (table.noncausal, table.causal)
    if not shape.backward:
        return _interpolate(mask.fwd, shape.head_dim, seq)
    if mask.bwd:
        return _interpolate(mask.bwd, shape.head_dim, seq)
    ratio = _interpolate(mask.fwd, shape.head_dim, seq) / _interpolate(other.fwd, shape.head_dim, seq)
    return _interpolate(other.bwd, shape.head_dim, seq) * ratio


def _interpolate(rows: list[KernelRow], head_dim: float, seq: float) -> float:
    """Along log(seq_len) within each measured head dim, then linearly between the two head dims around
    `head_dim`; clamped to the measured range on both axes (see the module docstring)."""
    by_head: dict[int, list[tuple[int, float]]] = {}
    for width, length, tflops in rows:
        by_head.setdefault(width, []).append((length, tflops))
    widths = sorted(by_head)
    i = bisect_left(widths, head_dim)
    if i == len(widths):
        return _along_seq(by_head[widths[-1]], seq)
    if i == 0 or widths[i] == head_dim:
        return _along_seq(by_head[widths[i]], seq)
    w0, w1 = widths[i - 1], widths[i]
    t0, t1 = _along_seq(by_head[w0], seq), _along_seq(by_head[w1], seq)
    return t0 + (head_dim - w0) / (w1 - w0) * (t1 - t0)


def _along_seq(points: list[tuple[int, float]], seq: float) -> float:
    points = sorted(points)
    lengths = [length for length, _ in points]
    i = bisect_left(lengths, seq)
    if i < len(points) and lengths[i] == seq:
        return points[i][1]
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (s0, t0), (s1, t1) = points[i - 1], points[i]
    return t0 + (log(seq) - log(s0)) / (log(s1) - log(s0)) * (t1 - t0)
