"""What a finished study says, from its trials table alone: the best feasible point per objective, which parallel
shape wins along the Pareto front, and how two studies' fronts differ (`dse compare`). A serving study's front is
told by deployment and throughput, with the SLO its points were held to (which only the saved study file says) and,
per SLO, which deployment kind wins (aggregated or disaggregated, with its pools) and by how much.

These figures are also what a nightly sweep tracks from one night to the next.
"""

from collections.abc import Mapping
from pathlib import Path

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table

from dse.errors import DseError
from dse.fields import GiB
from dse.objective import in_seconds
from dse.results import folders, pareto, plots, serving_plots, study_plots

SHAPE = ("parallel.tp", "parallel.pp", "parallel.dp", "parallel.zero")
SLO = "workload.serving.slo"


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
    if in_seconds(metric):
        return f"{value:.5g} s"
    return f"{value:.4g}"


def _runs(rows: pd.DataFrame, names: pd.Series) -> list[tuple[str, pd.DataFrame]]:
    """The rows in their order, cut into runs of consecutive rows that share a name."""
    cuts = (names != names.shift()).cumsum()
    return [(names[group.index[0]], group) for _, group in rows.groupby(cuts, sort=False)]


def winners(front: pd.DataFrame) -> list[str]:
    """Along the front from least memory to fastest: each run of consecutive points sharing a shape, with the
    step-time and memory ranges it covers ("which parallelism wins where")."""
    if front.empty:
        return []
    rows = front.sort_values("peak_memory_bytes") if "peak_memory_bytes" in front else front
    out: list[str] = []
    for name, members in _runs(rows, rows.apply(shape, axis=1)):
        span = ""
        if "step_time_s" in members and "peak_memory_bytes" in members:
            memory = list(members["peak_memory_bytes"] / GiB)
            span = f": step {_range(list(members['step_time_s']), '.4g')} s at {_range(memory, '.1f')} GiB"
        out.append(f"{name or 'one shape'} ({_count(len(members))}){span}")
    return out


def serving_winners(front: pd.DataFrame) -> list[str]:
    """Along the front from the most tokens/s per GPU to the fastest per user: each run of consecutive points of
    one deployment, with the throughputs it covers ("which deployment wins where")."""
    if front.empty:
        return []
    rows = front.sort_values([pareto.PER_GPU, pareto.PER_USER], ascending=False)
    return [
        f"{name} ({_count(len(members))}): {_range(list(members[pareto.PER_GPU]), ',.0f')} tokens/s/GPU at "
        f"{_range(list(members[pareto.PER_USER]), ',.1f')} tokens/s/user"
        for name, members in _runs(rows, pareto.deployment(rows))
    ]


def _count(points: int) -> str:
    return f"{points} point{'s' * (points > 1)}"


def _range(values: list[float], spec: str) -> str:
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}-{high}"


def slo_lines(frame: pd.DataFrame, front: pd.DataFrame, out_dir: Path) -> list[str]:
    """For each SLO the feasible points were held to (their workload.serving.slo: the saved study file's, with any
    searched bound), its bounds, how many front members meet it, and which deployment kind wins under it
    (`kind_verdict`); for points held to none, only which kind wins, when they are of both."""
    done = feasible(frame)
    if done.empty:
        return []
    try:
        spec = folders.load_saved_spec(out_dir)
    except DseError as exc:
        return [f"the SLO of the front is not known: {exc}"]
    bounds_columns = [c for c in done if c.startswith(SLO)]
    groups = done.groupby(bounds_columns, sort=False, dropna=False) if bounds_columns else [((), done)]
    out = []
    for _, rows in groups:
        point = next(iter(serving_plots.points_of(spec, rows.head(1)).values()), None)
        serving = point.workload.serving if point else None
        slo = serving.slo if serving else {}
        verdict = kind_verdict(rows, frame.attrs["objectives"])
        if slo:
            members = front[front.index.isin(rows.index)]
            bounds = ", ".join(f"{name} <= {fmt(name, bound)}" for name, bound in sorted(slo.items()))
            out.append(f"SLO {bounds}: met by {int(meets(members).sum())} of {len(members)} front members; {verdict}")
        elif pareto.kinds(rows).nunique() > 1:  # of one kind, the best is the best-per-objective table's
            out.append(f"no SLO: {verdict}")
    return out


def meets(rows: pd.DataFrame) -> pd.Series:
    """Which rows meet the SLO they were held to (every row when the table has no SLO excess)."""
    return rows["slo_excess"] <= 0 if "slo_excess" in rows else pd.Series(True, index=rows.index)


def kind_verdict(rows: pd.DataFrame, objectives: Mapping[str, str]) -> str:
    """Among points held to one SLO, the best feasible point meeting it by the study's first objective, its kind
    and pools, and, where the points hold another kind, by how much it beats that kind's best (or that none of that
    kind meets the SLO), e.g. 'disaggregated wins: disagg P: tp2 x2 | D: tp1 x4 (trial 23) at 2649
    tokens_per_s_per_user, 2.27 % above the best aggregated: agg tp1 x8 (trial 12) at 2590'."""
    metric, direction = next(iter(objectives.items()))
    ok = rows[meets(rows) & rows[metric].notna()] if metric in rows else rows.iloc[:0]
    if ok.empty:
        return "no feasible point meets it"
    ranked = ok.sort_values(metric, ascending=direction == "minimize", kind="stable")
    kind = pareto.kinds(ranked)

    def named(index: object) -> str:
        name = pareto.deployment(ranked.loc[[index]], counts=True)[index]
        return f"{name} (trial {ranked.at[index, 'number']:.0f}) at {fmt(metric, ranked.at[index, metric])}"

    first = ranked.index[0]
    others = sorted(set(pareto.kinds(rows)) - {kind[first]})
    line = f"{kind[first] + ' wins' if others else 'best'}: {named(first)} {metric}"
    for other in others:
        theirs = kind.index[kind == other]
        if theirs.empty:
            line += f"; no {other} point meets it"
            continue
        best, runner = ranked.at[first, metric], ranked.at[theirs[0], metric]
        side = "below" if direction == "minimize" else "above"
        line += f", {100 * abs(best - runner) / abs(runner):.3g} % {side} the best {other}: {named(theirs[0])}"
    return line


def pareto_plots(frame: pd.DataFrame, front: pd.DataFrame, out_dir: Path, title: str) -> list[Path]:
    """The Pareto plots, PNG and HTML: a serving study's frontier or a training study's step time and memory."""
    if pareto.is_serving(frame):
        png, html = serving_plots.frontier_png, serving_plots.frontier_html
    else:
        png, html = plots.pareto_png, plots.pareto_html
    return [png(frame, front, out_dir / plots.PNG, title), html(frame, front, out_dir / plots.HTML, title)]


def print_report(console: Console, frame: pd.DataFrame, out_dir: Path) -> list[Path]:
    """The summary after the front (which cli prints): best per objective and the winning shapes (a serving
    study's: deployments, and the SLO the front met); writes the Pareto plots next to the table and the study file's
    report plots (its saved copy's) into OUT/plots, and returns their paths."""
    best = pareto.front(frame)
    serving = pareto.is_serving(frame)
    table = Table(title="best feasible point per objective", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("objective", "best", "trial", "deployment" if serving else "shape"):
        table.add_column(header)
    for metric, row in best_per_objective(frame).items():
        direction = frame.attrs["objectives"][metric]
        name = pareto.deployment(row.to_frame().T, counts=True).iloc[0] if serving else shape(row)
        table.add_row(f"{metric} ({direction})", fmt(metric, row[metric]), str(int(row["number"])), name)
    if table.row_count:
        console.print(table)
    if serving:
        lines = serving_winners(best)
        heading = "which deployment wins where (Pareto front, most tokens/s per GPU first):"
    else:
        lines = winners(best)
        heading = "which parallelism wins where (Pareto front, least memory first):"
    if lines:
        console.print(heading)
        for line in lines:
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    for line in slo_lines(frame, best, out_dir) if serving else []:
        console.print(line, highlight=False, soft_wrap=True)
    written = pareto_plots(frame, best, out_dir, f"study {frame.attrs.get('study', out_dir.name)}")
    try:
        spec = folders.load_saved_spec(out_dir)
    except DseError as exc:
        console.print(f"the study file's report plots are not drawn: {exc}", highlight=False, soft_wrap=True)
        return written
    return written + [drawn.path for drawn in study_plots.draw(spec, frame, out_dir)]


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
