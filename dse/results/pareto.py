"""The Pareto front of a trials table and its printout.

It works on the table (Parquet) rather than the Optuna study so that `dse report` needs nothing but the file.
Only feasible COMPLETE trials compete, one per design point (duplicates reuse a result and would tie).
A table of serving points (`is_serving`) is printed with the serving figures instead of the training step's.
"""

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd
from rich import box
from rich.table import Table

from dse.fields import GiB


def non_dominated(costs: np.ndarray) -> np.ndarray:
    """Mask of rows no other row dominates; every column is minimised (negate maximised ones first). Equal rows
    do not dominate one another.

    The first of the rows left in lexicographic order is dominated by none (one that dominated it would come
    before it, and would have been dropped only for a row that dominates both): it is kept, and the rows it
    dominates are dropped, until none is left. Each step is one numpy pass over the rows left, and the rows left
    shrink fast, so a sweep's million points with a front of hundreds take about a second, where comparing every
    pair would take hours."""
    costs = np.asarray(costs, dtype=float)
    keep = np.zeros(len(costs), dtype=bool)
    left = np.lexsort(costs.T[::-1])
    while len(left):
        first, left = left[0], left[1:]
        keep[first] = True
        row, rest = costs[first], costs[left]
        left = left[~(np.all(rest >= row, axis=1) & np.any(rest > row, axis=1))]
    return keep


def front(frame: pd.DataFrame, objectives: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Non-dominated feasible COMPLETE trials, sorted by the first objective.

    objectives: {metric: "minimize" | "maximize"}; by default the table's own (frame.attrs["objectives"]).
    """
    objectives = objectives or frame.attrs["objectives"]
    if frame.empty:
        return frame
    done = frame[(frame["state"] == "COMPLETE") & (frame["feasible"] == True)]  # noqa: E712 - nullable column
    done = done.drop_duplicates("point_key")
    if done.empty:
        return done
    signs = np.array([1.0 if d == "minimize" else -1.0 for d in objectives.values()])
    costs = done[list(objectives)].to_numpy(dtype=float) * signs
    return done[non_dominated(costs)].sort_values(next(iter(objectives)), ascending=bool(signs[0] > 0))


PER_USER, PER_GPU = "tokens_per_s_per_user", "tokens_per_s_per_gpu"
KIND = "workload.serving.kind"
DECODE = "workload.serving.decode."
"""The deployment kind and the decode pool's fields (`dse.serving.spec`): a disaggregated point's `parallel` is its
prefill pool."""
POOLS_MARK = "decode_capacity_per_s"


def is_serving(frame: pd.DataFrame) -> bool:
    """Whether the table's points are serving points: only they have a tokens/s per user."""
    return PER_USER in frame and bool(frame[PER_USER].notna().any())


def kinds(frame: pd.DataFrame) -> pd.Series:
    """Each row's deployment kind: its column where the study searched it, else what its result says (only a
    disaggregated point has a decode pool's capacity)."""
    if KIND in frame:
        return frame[KIND]
    apart = frame[POOLS_MARK].notna() if POOLS_MARK in frame else pd.Series(False, index=frame.index)
    return apart.map({True: "disaggregated", False: "aggregated"})


def without_ignored(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of the table with the values its points ignore blanked: the decode pool's columns of aggregated
    points, which a study searching both kinds fills for every point, so that no table or hover text shows a pool
    that does not exist."""
    out = frame.copy()
    out.loc[kinds(frame) != "disaggregated", [c for c in frame if c.startswith(DECODE)]] = np.nan
    return out


def _degrees(frame: pd.DataFrame, column: str) -> pd.Series:
    """A degree column as text ('?' where the row lacks it); 1, every degree's default, where the table lacks it."""
    if column not in frame:
        return pd.Series("1", index=frame.index)
    return frame[column].map(lambda v: "?" if pd.isna(v) else f"{v:.0f}")


def _pool(frame: pd.DataFrame, prefix: str, counts: bool) -> pd.Series:
    """Each row's instances of one pool, e.g. 'tp2 ep8' (tp always, pp and ep above 1), then ' x4' instances."""
    label = "tp" + _degrees(frame, prefix + "tp")
    for part in ("pp", "ep"):
        degree = _degrees(frame, prefix + part)
        label = label + (f" {part}" + degree).where(degree != "1", "")
    return (label + " x" + _degrees(frame, prefix + "dp")) if counts else label


def deployment(frame: pd.DataFrame, counts: bool = False) -> pd.Series:
    """Each row's deployment: its kind and instance shapes, 'agg tp4' for aggregated instances (`parallel`),
    'disagg P: tp2 | D: tp4' for a prefill pool (`parallel`) and a decode pool (`workload.serving.decode`), with
    each pool's instance count when `counts` ('agg tp4 x2', 'disagg P: tp2 x2 | D: tp4 x1'), then the accelerator
    when the study searched it (a catalog name in a `system.accelerator` column).

    The frontier groups its points by the label without counts (a study searching the ratio of prefill to decode
    instances would draw one group per ratio); the report names a point by the label with them. The decode columns
    of an aggregated point are not read: the point ignores them."""
    prefill = _pool(frame, "parallel.", counts)
    apart = kinds(frame) == "disaggregated"
    label = ("agg " + prefill).where(~apart, "disagg P: " + prefill + " | D: " + _pool(frame, DECODE, counts))
    if "system.accelerator" in frame and pd.api.types.is_string_dtype(frame["system.accelerator"]):
        label = label + " " + frame["system.accelerator"].astype(str)
    return label


def latency_statistic(rows: pd.DataFrame) -> str:
    """'p99' when the rows' latencies spread (an event simulation measured them), else 'mean': the steady state's
    percentiles equal its means, and the table should not claim a tail it did not measure."""
    spread = [(rows[f"{m}_p99_s"] - rows[f"{m}_mean_s"]).abs().max() for m in ("ttft", "tpot") if f"{m}_p99_s" in rows]
    return "p99" if any(s > 0 for s in spread) else "mean"


Format = tuple[str, Callable[[Any], str]]
_SHAPE: dict[str, Format] = {
    "parallel.tp": ("tp", "{:.0f}".format),
    "parallel.pp": ("pp", "{:.0f}".format),
    "parallel.dp": ("dp", "{:.0f}".format),
    "parallel.cp": ("cp", "{:.0f}".format),
    "parallel.zero": ("zero", "{:.0f}".format),
    "parallel.sp": ("sp", lambda v: "yes" if v else "no"),
    "parallel.recompute": ("recompute", str),
    "workload.micro_batch": ("micro batch", "{:.0f}".format),
    "system.accelerator.hbm_GiB": ("HBM GiB", "{:g}".format),
}
_ALWAYS = ("parallel.tp", "parallel.pp", "parallel.dp", "workload.micro_batch", "system.accelerator.hbm_GiB")
_METRICS: dict[str, Format] = {
    "step_time_s": ("step time s", "{:.4g}".format),
    "peak_memory_bytes": ("peak memory GiB", lambda v: f"{v / GiB:.3g}"),
    "mfu": ("MFU %", lambda v: f"{100 * v:.1f}"),
    "overlap_ratio": ("overlap %", lambda v: f"{100 * v:.0f}"),
    "tokens_per_s_per_gpu": ("tokens/s/GPU", "{:,.0f}".format),
    "tokens_per_s_per_user": ("tokens/s/user", "{:,.1f}".format),
    "max_rate_per_s": ("max rate/s", "{:.4g}".format),
    "requests_per_s": ("requests/s", "{:.4g}".format),
    **{
        f"{what}_{stat}_s": (f"{what.upper()} {stat} ms", lambda v: f"{1000 * v:.4g}")
        for what in ("ttft", "tpot", "e2e")
        for stat in ("mean", "p50", "p90", "p99")
    },
}
_SERVING_SHAPE: dict[str, Format] = {
    "parallel.tp": ("tp", "{:.0f}".format),
    "parallel.pp": ("pp", "{:.0f}".format),
    "parallel.dp": ("instances", "{:.0f}".format),
    "system.accelerator": ("accelerator", str),
    "workload.serving.concurrency": ("clients", "{:.0f}".format),
    "workload.serving.rate_per_s": ("rate/s", "{:.4g}".format),
}


def _training_columns(rows: pd.DataFrame, objectives: Mapping[str, str]) -> list[tuple[str, str, Callable]]:
    """The parallel shape, then step time, memory, MFU and the objectives; cp, zero, sp and recompute only when
    they vary across the rows, to keep the table narrow."""
    shape = [f for f in _SHAPE if f in rows and (f in _ALWAYS or rows[f].nunique() > 1)]
    metrics = [m for m in ("step_time_s", "peak_memory_bytes", "mfu") if m in rows]
    metrics += [m for m in objectives if m not in metrics and m in rows]
    return [(f, *_SHAPE[f]) for f in shape] + [(m, *_METRICS.get(m, (m, "{:.4g}".format))) for m in metrics]


def _plain(value: Any) -> str:
    """A searched value as given: 4 rather than 4.0 where blanked rows (`without_ignored`) made a column float."""
    return f"{value:.0f}" if isinstance(value, float) and value.is_integer() else str(value)


def _serving_columns(rows: pd.DataFrame, objectives: Mapping[str, str]) -> list[tuple[str, str, Callable]]:
    """The instance shape and count, the accelerator and the load when searched (else the mean requests in flight),
    any other searched serving field that varies, then TTFT and TPOT (p99 or mean: `latency_statistic`),
    tokens/s per GPU and per user, the highest rate meeting the SLO when the points searched for it, and the
    objectives."""
    shape = [f for f in _SERVING_SHAPE if f in rows]
    if not {"workload.serving.concurrency", "workload.serving.rate_per_s"} & set(rows):
        shape.append("concurrency_mean")
    others = [
        c for c in rows if c.startswith("workload.serving.") and c not in _SERVING_SHAPE and rows[c].nunique() > 1
    ]
    statistic = latency_statistic(rows)
    metrics = [f"ttft_{statistic}_s", f"tpot_{statistic}_s", PER_GPU, PER_USER, "max_rate_per_s"]
    metrics = [m for m in metrics if m in rows and rows[m].notna().any()]
    metrics += [m for m in objectives if m not in metrics and m in rows]
    formats = {**_SERVING_SHAPE, "concurrency_mean": ("in flight", "{:.4g}".format)}
    return (
        [(f, *formats[f]) for f in shape]
        + [(c, c.removeprefix("workload.serving."), _plain) for c in others]
        + [(m, *_METRICS.get(m, (m, "{:.4g}".format))) for m in metrics]
    )


def table(rows: pd.DataFrame, objectives: Mapping[str, str], title: str) -> Table:
    """The front as a rich table: trial, then the training or the serving columns (`is_serving`); a serving
    table leaves out what its points ignore (`without_ignored`)."""
    serving = is_serving(rows)
    rows = without_ignored(rows) if serving else rows
    columns = (_serving_columns if serving else _training_columns)(rows, objectives)
    cells = [
        [str(int(row["number"]))] + [fmt(row[name]) if pd.notna(row[name]) else "-" for name, _, fmt in columns]
        for _, row in rows.iterrows()
    ]
    out = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0, 0, 1))
    for index, header in enumerate(["trial", *(header for _, header, _ in columns)]):
        # Values are never cut short; headers wrap at spaces instead when the terminal is narrow.
        out.add_column(header, justify="right", min_width=max((len(r[index]) for r in cells), default=1))
    for row in cells:
        out.add_row(*row)
    return out
