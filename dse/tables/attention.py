"""Fused attention's latency read from aiconfigurator-core's measured attention tables.

What the tables time (checked against the collector, ai-dynamo/aiconfigurator collector/trtllm/collect_attn.py, and
the package's own reader, aic-core perf_database/attention.rs): one framework attention call replayed from a CUDA
graph, latency in milliseconds.
- context_attention_perf: the prefill of `batch_size` sequences of `isl` tokens with nothing cached, so queries =
  keys = isl, under the causal mask (the package's speed of light halves the isl^2 work), `num_heads` query heads
  over `num_key_value_heads` key/value heads.
- generation_attention_perf: one new token per sequence (isl = 1) over `step` cached tokens and its own, a KV length
  of isl + step (the package keys these rows by that sum).
Rows also vary the sliding window and the attention and KV-cache dtypes; dse reads the full-attention (window 0) bf16
rows of the table's densest kernel lane (a table may time a framework's fallback kernel beside its default one:
SGLang's Triton beside FlashAttention-3; the default is timed on the full grid, the fallback on a few shapes).

Axes, and why:
- batch x heads, the parallel work. The kernel runs a thread block per (sequence, head, query tile), so b sequences
  of n heads fill the SMs as one sequence of b n heads would: H100 rows that split one product differently (1 x 32,
  4 x 8) agree to a median 0.6% (90th percentile 2.6%). A cell keeps the median of its rows.
- the GQA ratio, heads / KV heads. MHA runs 20-40% slower per FLOP than GQA in the context tables, and a decode call
  reads batch x heads / ratio heads' keys and values.
- the length: isl for context, the KV length for generation.
- the head dim, (query/key width + value width) / 2 as the op says it.
Between measured values log(time) is interpolated linearly in the log of each axis: exact on a power law (time
proportional to the heads, to the KV length in decode, to its square in a compute-bound prefill), so it follows both
regimes and the knee between them without a fitted curve. It is piecewise multilinear, so monotone between measured
points: a time lies between those of the points it is read from, and every measured cell is reproduced exactly.
The grid is ragged (long sequences were timed at fewer batch sizes, each ratio at its own head counts), so the axes
are nested, head dim, then ratio, then length, then batch x heads, and each level brackets the query between the
two nearest values measured under the level above; a length at which the call's batch x heads was not timed is
passed over for the nearest lengths at which it was (not the head dim or ratio: they pick the kernel).

Beyond the measured values, only where no measured values bracket the call, first along batch x heads at the
call's own length, then also along the length:
- above the largest: the largest call's rate. Batch x heads: time linear in them (that call run back to back);
  length: time times (L / L_max)^2 in context (its FLOPs), L / L_max in decode (its KV bytes).
- below the smallest: the local slope of the two smallest (log-log), clamped between flat (a latency-bound call:
  a smaller one is not faster) and the power above (a filled GPU: it is).
- a head dim or ratio outside the measured ones: not priced; the caller's existing path prices the op and says so.
Held out 10% at random, H100 rows are predicted with a median error of 1.5% (context) and 0.8% (decode); the tail
is the tables' own noise between neighbouring shapes (tests/test_attention_tables.py prints the figures).

Which table prices a call: a single query (decode) the generation table at its KV length; a causal call of q
queries over k keys (a context-parallel rank's chunk over every key) the context table at the length with the same
query x key count, sqrt(q k), as dse.kernels reads its tables; a non-causal call of several queries (an encoder, a
ring step off the diagonal) is neither table's kernel and goes to the existing path.

Backward: none. The tables time serving kernels, which have no backward pass, and a training step runs FlashAttention
through PyTorch, not them: only a workload whose attention_kernel is `framework` (prefill or decode) reads them.
"""

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import lru_cache
from math import exp, log, sqrt
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from dse.errors import SpecError
from dse.tables.scale import DeviceScale
from dse.tables.source import LATENCY_UNIT_S, KernelTables, file_state, read_rows, table_file
from dse.workload import Op

if TYPE_CHECKING:
    from dse.system import AcceleratorSpec

Table = Literal["context_attention_perf", "generation_attention_perf"]
DTYPES = {"bf16": "bfloat16"}
"""dse's dtypes and the tables' names for them (attention and KV cache alike); another dtype's attention is priced
by the existing path."""
LENGTH_POWER: dict[Table, float] = {"context_attention_perf": 2.0, "generation_attention_perf": 1.0}
"""How a call's work grows with its length beyond the longest measured: a causal prefill's FLOPs with its square, a
decode's KV bytes with the KV length."""
COLUMNS = ["kernel_source", "batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim", "step", "latency"]
Level = tuple[list[float], list]
"""One axis of the nested grid: log of its measured values, ascending, and per value the next axis's Level, or at
the last axis the cell's seconds."""
SIZE_AXES = 2
"""The axes from which on (length, batch x heads) a reading may pass over a measured value that cannot price the
query for the next one that can; the head dim and the ratio before them pick the kernel and are not passed over."""
Powers = tuple[float | None, ...]
"""Per axis, how a reading may go beyond the measured values: None, not at all; else the power of the axis that time
grows with above the largest (below the smallest, the local slope, at most that)."""


@dataclass(frozen=True)
class AttentionGrid:
    """Measured seconds of one table's calls by (head dim, GQA ratio, length, batch x heads), nested in that order."""

    root: Level
    length_power: float
    _memo: dict[tuple[float, float, float, float], float | None] = field(
        default_factory=dict, compare=False, repr=False
    )
    """seconds_of's answers: the grid is shared by every accelerator priced from it (a sweep's many)."""

    @classmethod
    def from_rows(
        cls,
        head_dim: np.ndarray,
        ratio: np.ndarray,
        length: np.ndarray,
        work: np.ndarray,
        seconds: np.ndarray,
        length_power: float,
    ) -> "AttentionGrid":
        """The grid of these rows (one value per row and axis); rows of one cell give their median."""
        import pandas as pd  # with the first table read (source.read_rows)

        values = {"d": head_dim, "g": ratio, "n": length, "w": work, "t": seconds}
        frame = pd.DataFrame({name: np.asarray(column, dtype=float) for name, column in values.items()})
        cells = frame.groupby(["d", "g", "n", "w"])["t"].median()
        tree: dict = {}
        for (d, g, n, w), value in cells.items():
            tree.setdefault(d, {}).setdefault(g, {}).setdefault(n, {})[w] = value
        return cls(_level(tree), length_power)

    def seconds_of(self, head_dim: float, ratio: float, length: float, work: float) -> float | None:
        """One call's seconds, or None where the grid does not reach (a head dim or ratio outside the measured)."""
        key = (head_dim, ratio, length, work)
        if key not in self._memo:
            point, found = tuple(log(x) for x in key), None
            # Between measured values; else beyond them along batch x heads at the call's length; else also along it.
            for powers in ((None, None, None, None), (None, None, None, 1.0), (None, None, self.length_power, 1.0)):
                if (found := _read(self.root, point, powers)) is not None:
                    break
            self._memo[key] = found
        return self._memo[key]


def _level(tree: dict) -> Level:
    keys = sorted(tree)
    return [log(k) for k in keys], [_level(tree[k]) if isinstance(tree[k], dict) else tree[k] for k in keys]


def _read(level: Level, point: tuple[float, ...], powers: Powers, depth: int = 0) -> float | None:
    """Seconds at `point` (log values, one per axis) from this level down, or None where it cannot be read.

    At each level the query is bracketed between the nearest measured values below and above it whose own levels
    can price it (a length at which only larger batches were timed is passed over for the lengths around it).
    Where one side has none and powers[depth] is set, time grows as that power of the axis above the largest value
    (the largest call's rate), and below the smallest as the local slope of the two smallest (in log-log), clamped
    between flat (a latency-bound call: a smaller one is not faster) and that power (a filled GPU: it is)."""
    keys, children = level
    x = point[depth]

    def child(j: int) -> float | None:
        return children[j] if depth == len(point) - 1 else _read(children[j], point, powers, depth + 1)

    def nearest(indices: range) -> tuple[int, float] | None:
        return next(((j, v) for j in indices if (v := child(j)) is not None), None)

    i = bisect_left(keys, x)
    at_key = i < len(keys) and keys[i] == x
    if depth < SIZE_AXES:  # the call's own kernel: read at its own head dim and ratio, or between their neighbours
        if at_key:
            return child(i)
        if i == 0 or i == len(keys) or (below := child(i - 1)) is None or (above := child(i)) is None:
            return None
        return _between(keys, (i - 1, below), (i, above), x)
    if at_key and (exact := child(i)) is not None:
        return exact
    lo = nearest(range(i - 1, -1, -1))
    hi = nearest(range(i + at_key, len(keys)))
    if lo is not None and hi is not None:
        return _between(keys, lo, hi, x)
    power = powers[depth]
    if power is None or (lo is None and hi is None):
        return None
    if lo is not None:
        return lo[1] * exp(power * (x - keys[lo[0]]))
    assert hi is not None
    slope = 0.0
    if (second := nearest(range(hi[0] + 1, len(keys)))) is not None:
        slope = min(max((log(second[1]) - log(hi[1])) / (keys[second[0]] - keys[hi[0]]), 0.0), power)
    return hi[1] * exp(slope * (x - keys[hi[0]]))


def _between(keys: list[float], lo: tuple[int, float], hi: tuple[int, float], x: float) -> float:
    """log(time) linear in the axis's log between two measured values (indices into keys, seconds)."""
    w = (x - keys[lo[0]]) / (keys[hi[0]] - keys[lo[0]])
    return exp((1 - w) * log(lo[1]) + w * log(hi[1]))


@lru_cache(maxsize=16)
def _grid(path: Path, size: int, mtime_ns: int, table: Table, dtype: str) -> AttentionGrid:
    """One table's grid for one dtype, read once per process per version of the file (its size and time)."""
    filters = [("window_size", "=", 0), ("attn_dtype", "=", dtype), ("kv_cache_dtype", "=", dtype)]
    rows = read_rows(path, COLUMNS, filters)
    if rows.empty:
        raise SpecError(
            f"{path} has no full-attention {dtype} rows; use a collection that measured them or the roofline"
        )
    counts = rows["kernel_source"].value_counts()
    rows = rows[rows["kernel_source"] == counts.index[np.argmax(counts.to_numpy())]]
    heads = rows["num_heads"].to_numpy(dtype=float)
    return AttentionGrid.from_rows(
        rows["head_dim"].to_numpy(dtype=float),
        heads / rows["num_key_value_heads"].to_numpy(dtype=float),
        (rows["isl"] + rows["step"]).to_numpy(dtype=float),
        rows["batch_size"].to_numpy(dtype=float) * heads,
        rows["latency"].to_numpy(dtype=float) * LATENCY_UNIT_S,
        LENGTH_POWER[table],
    )


def attention_grid(path: Path, table: Table, dtype: str) -> AttentionGrid:
    """The grid of one attention table's calls of one of its dtypes, cached by the file's state."""
    return _grid(*file_state(path), table, dtype)


class MeasuredAttention:
    """Prices the fused attention ops of one dtype on one accelerator from its kernel tables; on an accelerator other
    than the measured device a call keeps the measured share of its roofline (`DeviceScale`). The files are found
    now (a collection without them is refused in one line) and read at the first call that needs them."""

    def __init__(
        self,
        tables: KernelTables,
        accelerator: "AcceleratorSpec",
        dtype: str,
        field: str,
    ) -> None:
        self._paths: dict[Table, Path] = {}
        if dtype not in DTYPES or dtype not in accelerator.peak_tflops:
            return  # the tables time bf16 attention; the existing path prices the rest
        self._paths = {name: table_file(tables, "attention", name, field) for name in LENGTH_POWER}
        self._dtype = DTYPES[dtype]
        self._scale = DeviceScale(tables, accelerator, dtype, field)

    def seconds(self, op: Op) -> float | None:
        """The op's seconds by the tables, or None where they cannot price it (the caller's existing path does)."""
        shape = op.attention
        if not self._paths or shape is None or shape.backward or min(shape.batch, shape.heads, shape.kv_heads) <= 0:
            return None
        if shape.queries == 1:
            table: Table = "generation_attention_perf"
            length, per_channel = shape.keys, 4 * shape.keys  # the call's FLOPs per head and head-dim channel
        elif shape.causal:
            table = "context_attention_perf"
            length, per_channel = sqrt(shape.queries * shape.keys), 2 * shape.queries * shape.keys
        else:
            return None
        grid = attention_grid(self._paths[table], table, self._dtype)
        measured = grid.seconds_of(shape.head_dim, shape.heads / shape.kv_heads, length, shape.batch * shape.heads)
        if measured is None:
            return None
        forward_flops = per_channel * shape.batch * shape.heads * shape.head_dim
        return self._scale(measured * op.flops * op.density / forward_flops, op)  # the op's FLOPs, if not the table's
