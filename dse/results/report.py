"""What a finished study says, from its trials table alone: the best feasible point per objective, which parallel
shape wins along the Pareto front, and how two studies' fronts differ (`dse compare`).

These figures are also what a nightly sweep tracks from one night to the next.
"""

from collections.abc import Mapping
from pathlib import Path

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table

from dse.fields import GiB
from dse.results import pareto, plots

SHAPE = ("parallel.tp", "parallel.pp", "parallel.dp", "parallel.zero")


def feasible(frame: pd.DataFrame) -> pd.DataFrame:
    if frame.empty:
        return frame
    return frame[(frame["state"] == "COMPLETE") & (frame["feasible"] == True)]  # noqa: E712 - nullable column


def shape(row: pd.Series) -> str:
    """A point's parallel shape, e.g. 'tp8 pp2 dp4 zero1' (fields the table lacks are left out)."""
    return " ".join(f"{f.split('.')[1]}{row[f]:.0f}" for f in SHAPE if f in row and pd.notna(row[f]))


def best_per_objective(frame: pd.DataFrame, objectives: Mapping[str, str] | None = None) -> dict[str, pd.Series]:
    """Per objective metric, the feasible trial with the best value (the first such trial on a tie)."""
    objectives = objectives or frame.attrs["objectives"]
    done = feasible(frame)
    out: dict[str, pd.Series] = {}
    for metric, direction in objectives.items():
        if done.empty or metric not in done:
            continue
        index = done[metric].idxmin() if direction == "minimize" else done[metric].idxmax()
        out[metric] = done.loc[index]
    return out


def fmt(metric: str, value: float) -> str:
    if metric.endswith("_bytes"):
        return f"{value / GiB:.3f} GiB"
    if metric.endswith("_s"):
        return f"{value:.5g} s"
    return f"{value:.4g}"


def winners(front: pd.DataFrame) -> list[str]:
    """Along the front from least memory to fastest: each run of consecutive points sharing a shape, with the
    step-time and memory ranges it covers ("which parallelism wins where")."""
    if front.empty:
        return []
    rows = front.sort_values("peak_memory_bytes") if "peak_memory_bytes" in front else front
    out: list[str] = []
    groups: list[tuple[str, list[pd.Series]]] = []
    for _, row in rows.iterrows():
        name = shape(row)
        if groups and groups[-1][0] == name:
            groups[-1][1].append(row)
        else:
            groups.append((name, [row]))
    for name, members in groups:
        times = [m["step_time_s"] for m in members if "step_time_s" in m]
        memory = [m["peak_memory_bytes"] / GiB for m in members if "peak_memory_bytes" in m]
        span = ""
        if times and memory:
            span = f": step {_range(times, '.4g')} s at {_range(memory, '.1f')} GiB"
        out.append(f"{name or 'one shape'} ({len(members)} point{'s' * (len(members) > 1)}){span}")
    return out


def _range(values: list[float], spec: str) -> str:
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}-{high}"


def print_report(console: Console, frame: pd.DataFrame, out_dir: Path) -> list[Path]:
    """The summary after the front (which cli prints): best per objective and the winning shapes; writes the
    Pareto plots next to the table and returns their paths."""
    best = pareto.front(frame)
    table = Table(title="best feasible point per objective", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("objective", "best", "trial", "shape"):
        table.add_column(header)
    for metric, row in best_per_objective(frame).items():
        direction = frame.attrs["objectives"][metric]
        table.add_row(f"{metric} ({direction})", fmt(metric, row[metric]), str(int(row["number"])), shape(row))
    if table.row_count:
        console.print(table)
    lines = winners(best)
    if lines:
        console.print("which parallelism wins where (Pareto front, least memory first):")
        for line in lines:
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    title = f"study {frame.attrs.get('study', out_dir.name)}"
    return [
        plots.pareto_png(frame, best, out_dir / plots.PNG, title),
        plots.pareto_html(frame, best, out_dir / plots.HTML, title),
    ]


def compare(a: pd.DataFrame, b: pd.DataFrame, name_a: str, name_b: str) -> Table:
    """Two studies' fronts side by side: best per objective in each and the change, and which design points
    (by point key) are on one front only."""
    objectives = a.attrs["objectives"]
    table = Table(title=f"{name_a} -> {name_b}", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("figure", name_a, name_b, "change"):
        table.add_column(header, justify="right")
    best_a, best_b = best_per_objective(a, objectives), best_per_objective(b, objectives)
    for metric in objectives:
        va = best_a[metric][metric] if metric in best_a else None
        vb = best_b[metric][metric] if metric in best_b else None
        change = "-" if va is None or vb is None or va == 0 else f"{100 * (vb - va) / abs(va):+.2f} %"
        table.add_row(
            f"best {metric}", "-" if va is None else fmt(metric, va), "-" if vb is None else fmt(metric, vb), change
        )
    front_a, front_b = pareto.front(a, objectives), pareto.front(b, objectives)
    keys_a, keys_b = (
        set(front_a["point_key"]) if len(front_a) else set(),
        set(front_b["point_key"]) if len(front_b) else set(),
    )
    table.add_row("front size", str(len(front_a)), str(len(front_b)), f"{len(front_b) - len(front_a):+d}")
    table.add_row("points on both fronts", str(len(keys_a & keys_b)), str(len(keys_a & keys_b)), "")
    table.add_row("points on one front only", str(len(keys_a - keys_b)), str(len(keys_b - keys_a)), "")
    return table
