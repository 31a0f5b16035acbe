"""Where a multi-fidelity study's two cost models disagree, from its trials table: per refined point the screened
and refined value of each objective and their gap, the gaps' mean and maximum per objective, and whether the
Pareto front changes when the refined figures replace the screened ones (`dse report`).

The refined front is recomputed among the refined points only, on their refined figures and refined feasibility:
the screened front's members are all refined (the study refines every one), so a member that leaves it was
overtaken or dropped by the better model, and a point that joins it was outside the screened front but among the
top k of an objective.
"""

from collections.abc import Mapping

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table

from dse.results import pareto, report

PREFIX = "refined."
"""Of the trials table's refined figures: refined.<metric> (tracking.refined_columns)."""


def refined_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per refined design point (a refinement that succeeded), in trial order."""
    if frame.empty or "fidelity" not in frame:
        return frame.iloc[0:0]
    return frame[frame["fidelity"] == "refined"].drop_duplicates("point_key").sort_values("number")


def front(frame: pd.DataFrame, objectives: Mapping[str, str] | None = None) -> pd.DataFrame:
    """The Pareto front of the refined points on their refined figures (rows of `frame`, as pareto.front)."""
    objectives = objectives or frame.attrs["objectives"]
    rows = refined_rows(frame)
    if rows.empty or not all(f"{PREFIX}{m}" in rows for m in objectives):
        return rows
    view = rows.drop(columns=[*objectives, "feasible"]).rename(
        columns={f"{PREFIX}{m}": m for m in [*objectives, "feasible"]}
    )
    view.attrs = frame.attrs
    return frame.loc[pareto.front(view, objectives).index]


def gaps(frame: pd.DataFrame, objectives: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Per refined point and objective metric: screened value, refined value and gap (refined / screened - 1)."""
    objectives = objectives or frame.attrs["objectives"]
    rows = refined_rows(frame)
    out = rows[["number", "point_key"]].copy()
    for metric in objectives:
        if f"{PREFIX}{metric}" in rows:
            screened, refined = rows[metric].astype(float), rows[f"{PREFIX}{metric}"].astype(float)
            out[f"{metric}.screen"], out[f"{metric}.refined"] = screened, refined
            out[f"{metric}.gap"] = (refined - screened) / screened.abs()
    return out


def print_refinement(console: Console, frame: pd.DataFrame) -> None:
    """The refinement report: nothing for a study that refined nothing."""
    if frame.empty or "fidelity" not in frame or "refined.cost_model" not in frame:
        return
    attempted = frame[frame["refined.cost_model"].notna()].drop_duplicates("point_key")
    if attempted.empty:
        return
    objectives = frame.attrs["objectives"]
    table_of_gaps = gaps(frame, objectives)
    models = ", ".join(sorted(attempted["refined.cost_model"].astype(str).unique()))
    failed = attempted[attempted["fidelity"] != "refined"]
    over = int((refined_rows(frame)["refined.feasible"] == False).sum())  # noqa: E712 - nullable column
    infeasible = f" ({over} of them infeasible there)" if over else ""
    console.print(
        f"refined {len(attempted)} points with {models}: {len(table_of_gaps)} priced{infeasible}, {len(failed)} failed",
        soft_wrap=True,
    )
    if not table_of_gaps.empty:
        console.print(_points_table(frame, table_of_gaps, objectives))
        console.print(_summary_table(table_of_gaps, objectives))
        console.print(front_change(frame, objectives), soft_wrap=True, highlight=False)
    for _, row in failed.iterrows():
        console.print(f"  trial {int(row['number'])} not refined: {row['refined.reason']}", soft_wrap=True)


def _points_table(frame: pd.DataFrame, table_of_gaps: pd.DataFrame, objectives: Mapping[str, str]) -> Table:
    table = Table(title="screened vs refined, per refined point", box=box.SIMPLE_HEAD, pad_edge=False)
    metrics = [m for m in objectives if f"{m}.gap" in table_of_gaps]
    labels = [m.removesuffix("_s").removesuffix("_bytes") for m in metrics]
    for header in ("trial", "shape", *(f"{m} {kind}" for m in labels for kind in ("screen", "refined", "gap"))):
        table.add_column(header, justify="right")
    shapes = frame.set_index("number")
    for _, row in table_of_gaps.iterrows():
        cells = [str(int(row["number"])), report.shape(shapes.loc[row["number"]])]
        for m in metrics:
            cells += [report.fmt(m, row[f"{m}.screen"]), report.fmt(m, row[f"{m}.refined"]), _percent(row[f"{m}.gap"])]
        table.add_row(*cells)
    return table


def _summary_table(table_of_gaps: pd.DataFrame, objectives: Mapping[str, str]) -> Table:
    table = Table(title="gap (refined / screened - 1) per objective", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("objective", "mean gap", "mean |gap|", "max |gap|", "at trial"):
        table.add_column(header, justify="right")
    for metric in objectives:
        if f"{metric}.gap" in table_of_gaps:
            gap = table_of_gaps[f"{metric}.gap"]
            worst = gap.abs().idxmax()
            table.add_row(
                metric,
                _percent(gap.mean()),
                _percent(gap.abs().mean(), signed=False),
                _percent(abs(gap[worst]), signed=False),
                str(int(table_of_gaps.loc[worst, "number"])),
            )
    return table


def front_change(frame: pd.DataFrame, objectives: Mapping[str, str]) -> str:
    """Whether the front changes under the refined figures: its members that left and the points that joined."""
    before, after = set(pareto.front(frame, objectives)["point_key"]), set(front(frame, objectives)["point_key"])
    priced = set(refined_rows(frame)["point_key"])
    numbers = frame.drop_duplicates("point_key").set_index("point_key")["number"]

    def trials(keys: set[str]) -> list[int]:
        return sorted(int(numbers[key]) for key in keys)

    left, joined, unrefined = trials((before & priced) - after), trials(after - before), trials(before - priced)
    tail = f"; {len(unrefined)} screened members not refined (trials {_numbers(unrefined)})" if unrefined else ""
    if not left and not joined:
        return f"Pareto front unchanged by the refinement ({len(after)} members){tail}"
    return (
        f"Pareto front changes with the refined figures: {len(before)} -> {len(after)} members, {len(left)} left "
        f"(trials {_numbers(left)}), {len(joined)} joined (trials {_numbers(joined)}){tail}"
    )


def _numbers(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers)) or "none"


def _percent(value: float, signed: bool = True) -> str:
    return "-" if pd.isna(value) else f"{100 * value:{'+' if signed else ''}.2f} %"
