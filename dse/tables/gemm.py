"""A GEMM's latency read from a measured per-shape table: multilinear interpolation of log(latency) over
(log m, log n, log k).

aiconfigurator-core times `C[m x n] = A[m x k] @ B[k x n]` on a grid: m (the tokens) at 1-17 and on both sides of
every 256-wide tile boundary (4096 and 4097), n and k (the weights) from 32 to 65536. Why this interpolation:
- Log-log because a GEMM's time is near a power law of each size (linear in m, n and k once the SMs are full, flat
  while it is latency-bound); interpolating log(time) linearly in log(size) is exact on any power law, so it follows
  both regimes and the knee between them without a fitted curve.
- Multilinear (piecewise, not a spline) because it is monotone between measured points: it never overshoots, so a
  predicted time always lies between the times of the grid cell's corners, and every measured point is reproduced
  exactly. The grid's paired points at tile boundaries (4096, 4097) keep the step a new row of tiles costs.
- Above the largest measured size along an axis a GEMM is that axis's largest measured GEMM run back to back:
  time scales linearly with the size. That is an upper bound a larger GEMM meets (it fills the SMs at least as well),
  and the physics of the split, not a curve extended. Below the smallest n or k (32) there is nothing to read:
  `seconds` returns None and the caller prices the op by the roofline and records that it did.

A batched GEMM (`Op.gemm` batch > 1: MoE experts, per-head MLA products) has its own weights per batch element
(the tracer's batch dimensions are in both operands), which a grouped kernel runs in one launch: its tiles are those
of one GEMM of batch x m rows (the table's time for that shape), and it reads batch x n x k weights, which that GEMM
does not. It takes the longer of that time and the table's one-row GEMM of depth batch x k:
those weights streamed through one GEMM launch at the rate the table measures for them, with its fixed cost paid
once, a bound from below that rules in decode (8 experts of 14 rows each, fp8, 2048 x 7168: 20.4 us for 112 rows,
43.0 us for the weights). Not batch x table(m, n, k): that runs the experts one launch after another, an upper
bound that pays the fixed cost batch times. A GEMM that fills the SMs (prefill, training) keeps the rows' time.

A collection misses a few cells of its grid (a shape that failed to run). Each is filled from its measured
neighbours along whichever axis brackets it most tightly (log-log, as a lookup would), so a lookup near it still
interpolates; `measured` keeps which cells were measured. The same fill predicts held-out rows in the tests.
"""

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dse.tables.scale import DeviceScale
from dse.tables.source import LATENCY_UNIT_S, KernelTables, file_state, medians, read_columns, table_file
from dse.workload import Op

if TYPE_CHECKING:
    from dse.system import AcceleratorSpec

DTYPES = {"bf16": "bfloat16", "fp8": "fp8"}
"""dse's dtypes and the table's names for them; another dtype's GEMMs are priced by the roofline."""


@dataclass(frozen=True)
class GemmGrid:
    axes: tuple[np.ndarray, np.ndarray, np.ndarray]
    """log of the measured m, n and k, ascending."""
    log_seconds: np.ndarray
    """log(seconds) per (m, n, k) cell, measured or filled; NaN where nothing could fill it."""
    seconds: np.ndarray
    """seconds per cell as measured (the median of repeated rows), NaN where not measured."""
    _memo: dict[tuple[float, float, float], float | None] = field(default_factory=dict, compare=False, repr=False)
    """seconds_of's answers: the grid is shared by every accelerator priced from it (a sweep's many)."""

    @classmethod
    def from_rows(cls, m: np.ndarray, n: np.ndarray, k: np.ndarray, seconds: np.ndarray) -> "GemmGrid":
        """The grid the rows span; repeated rows of one shape give their median (a row without a time is left out,
        and a shape with none is not measured)."""
        values = [np.unique(np.asarray(x, dtype=float)) for x in (m, n, k)]
        index = tuple(np.searchsorted(v, np.asarray(x, dtype=float)) for v, x in zip(values, (m, n, k), strict=True))
        shape = tuple(len(v) for v in values)
        measured = np.full(shape, np.nan)
        (cells,), cell_seconds = medians([np.ravel_multi_index(index, shape)], np.asarray(seconds, dtype=float))
        measured.flat[cells] = cell_seconds
        axes = tuple(np.log(v) for v in values)
        filled = np.log(measured)
        while (missing := np.isnan(filled).sum()) > 0:  # a corner no measured cell reaches, from the filled ones
            filled = _filled(filled, axes)
            if np.isnan(filled).sum() == missing:
                break
        return cls(axes, filled, measured)  # type: ignore[arg-type]

    def lookup(self, m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Seconds per (m, n, k) query, NaN where the table cannot price it (below its smallest size, or next to a
        cell nothing could fill). Vectorised: a sweep prices every GEMM shape of a workload in one call."""
        total = np.zeros(np.broadcast(m, n, k).shape)
        corners: list[tuple[np.ndarray, np.ndarray]] = []  # per axis: (lower index, weight of the upper)
        at_node = np.ones(total.shape, dtype=bool)
        for axis, size in zip(self.axes, (m, n, k), strict=True):
            x = np.log(np.broadcast_to(np.asarray(size, dtype=float), total.shape))
            below = x < axis[0]
            beyond = np.maximum(x - axis[-1], 0.0)  # log of how many times the largest measured size
            xc = np.clip(x, axis[0], axis[-1])
            lower = np.clip(np.searchsorted(axis, xc, side="right") - 1, 0, len(axis) - 2)
            weight = (xc - axis[lower]) / (axis[lower + 1] - axis[lower])
            total = total + beyond + np.where(below, np.nan, 0.0)
            at_node &= (weight == 0.0) | (weight == 1.0)
            at_node &= (beyond == 0.0) & ~below
            corners.append((lower, weight))
        (i, wi), (j, wj), (kk, wk) = corners
        value = np.zeros(total.shape)
        for di in (0, 1):
            for dj in (0, 1):
                for dk in (0, 1):
                    w = (wi if di else 1 - wi) * (wj if dj else 1 - wj) * (wk if dk else 1 - wk)
                    corner = self.log_seconds[i + di, j + dj, kk + dk]
                    value = value + np.where(w == 0.0, 0.0, w * corner)  # a NaN cell weighs in only when used
        result = np.exp(value + total)
        exact = self.seconds[i + (wi == 1.0), j + (wj == 1.0), kk + (wk == 1.0)]
        return np.where(at_node & np.isfinite(exact), exact, result)

    def seconds_of(self, m: float, n: float, k: float) -> float | None:
        """One GEMM's seconds, or None where the table cannot price it."""
        shape = (m, n, k)
        if shape not in self._memo:
            found = float(self.lookup(np.array(m), np.array(n), np.array(k)))
            self._memo[shape] = found if np.isfinite(found) else None
        return self._memo[shape]


def _filled(log_measured: np.ndarray, axes: tuple[np.ndarray, ...]) -> np.ndarray:
    """The grid with each unmeasured cell interpolated from its nearest measured neighbours along the axis whose
    two neighbours lie closest together (in log size). A cell at the grid's edge on every axis (the largest GEMMs,
    too slow to be timed) takes its nearest measured neighbour's time: a smaller one's scaled linearly, as a lookup
    beyond the grid is, or a larger one's as it is (an upper bound: a smaller GEMM is not slower)."""
    filled = log_measured.copy()
    for cell in zip(*np.nonzero(np.isnan(log_measured)), strict=True):
        bracketed: tuple[float, float] | None = None  # (span, estimate)
        scaled: tuple[float, float] | None = None  # (distance, estimate)
        for a, axis in enumerate(axes):
            line = log_measured[tuple(slice(None) if d == a else c for d, c in enumerate(cell))]
            present = np.flatnonzero(~np.isnan(line))
            lo, hi = present[present < cell[a]], present[present > cell[a]]
            for near, estimate in ((lo[-1:], line[lo[-1:]] + axis[cell[a]] - axis[lo[-1:]]), (hi[:1], line[hi[:1]])):
                distance = np.abs(axis[cell[a]] - axis[near])
                if len(near) and (scaled is None or distance[0] < scaled[0]):
                    scaled = (float(distance[0]), float(estimate[0]))
            if not len(lo) or not len(hi):
                continue
            i0, i1 = lo[-1], hi[0]
            span = axis[i1] - axis[i0]
            estimate = line[i0] + (axis[cell[a]] - axis[i0]) / span * (line[i1] - line[i0])
            if bracketed is None or span < bracketed[0]:
                bracketed = (span, estimate)
        if (best := bracketed or scaled) is not None:
            filled[cell] = best[1]
    return filled


@lru_cache(maxsize=32)
def _grid(path: Path, size: int, mtime_ns: int, dtype: str) -> GemmGrid | None:
    """One table's grid for one dtype, read once per process per version of the file (its size and time); None
    where the collection timed no GEMM of that dtype."""
    rows = read_columns(path, ["gemm_dtype", "m", "n", "k", "latency"])
    of_dtype = rows["gemm_dtype"] == dtype
    if not of_dtype.any():
        return None
    m, n, k, latency = (rows[name][of_dtype] for name in ("m", "n", "k", "latency"))
    return GemmGrid.from_rows(m, n, k, latency * LATENCY_UNIT_S)


def gemm_grid(path: Path, dtype: str) -> GemmGrid | None:
    """The grid of the file's GEMMs of one of its dtypes (the table's name for it), cached by the file's state."""
    return _grid(*file_state(path), dtype)


class MeasuredGemms:
    """Prices the GEMM ops of one dtype on one accelerator from its kernel tables; on an accelerator other than the
    measured device a GEMM keeps the measured share of its roofline (`DeviceScale`)."""

    def __init__(self, tables: KernelTables, accelerator: "AcceleratorSpec", dtype: str, field: str) -> None:
        self.grid: GemmGrid | None = None
        if dtype not in DTYPES or dtype not in accelerator.peak_tflops:
            return  # the tables time bf16 and fp8 GEMMs; the roofline prices the rest (or says the peak is missing)
        self.grid = gemm_grid(table_file(tables, "gemm", "gemm_perf", field), DTYPES[dtype])
        if self.grid is not None:  # a collection that timed no GEMM of this dtype leaves them to the roofline
            self._scale = DeviceScale(tables, accelerator, dtype, field)

    def seconds(self, op: Op) -> float | None:
        """The op's seconds by the table, or None where the table cannot price it (the caller's roofline does)."""
        if self.grid is None or op.gemm is None:
            return None
        batch, m, n, k = op.gemm
        measured = self.grid.seconds_of(batch * m, n, k)  # a batched GEMM fills the SMs as batch times the rows
        if measured is None:
            return None
        if batch > 1:  # each batch element has its own weights, all read in one launch (the module docstring)
            weights = self.grid.seconds_of(1.0, n, batch * k)
            measured = measured if weights is None else max(measured, weights)
        return self._scale(measured, op)
