"""A study file's `report:` section: the plots a paper draws (a line, a heat map, a bar chart), named by the
study's own fields and metrics, checked when the study is loaded so that a misspelt name fails before the search
rather than after it (`dse.results.study_plots` draws them)."""

from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dse import plugins
from dse.errors import SpecError
from dse.objective import Direction, Objective, in_seconds

EVALUATION_METRICS = (
    "step_time_s",
    "compute_time_s",
    "comm_time_s",
    "exposed_comm_time_s",
    "overlap_ratio",
    "peak_memory_bytes",
    "hbm_bytes",
    "model_flops",
)
"""What `dse.point.evaluate.metrics_of` reports of every point besides the objectives' and constraints' metrics
(tests/test_study_plots.py pins the two lists equal)."""
SMALLER_IS_BETTER = ("_bytes", "_usd", "_J", "_W", "_kW")
"""Metric name endings of amounts a planner wants small: memory, money, energy, power (times: `in_seconds`)."""
MAX_PLOTS = 50


class PlotSpec(BaseModel):
    """One plot: each point (line), cell (heatmap) or bar is the best feasible trial among those sharing its x (and
    series, or y for a heatmap), by the plotted metric's direction."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: Literal["line", "heatmap", "bar"]
    x: str = Field(description="a searched, derived or base field (dotted path) or a metric")
    y: str = Field(description="line and bar: the metric drawn; heatmap: the field (or metric) of the rows")
    series: str | None = Field(None, description="line and bar: one line (or bar per x) for each of its values")
    value: str | None = Field(None, description="heatmap: the metric colouring each cell")
    title: str | None = Field(None, max_length=200)
    direction: Direction | None = Field(
        None, description="which of the metric's values is best, for a metric whose name does not say"
    )

    @model_validator(mode="after")
    def _check(self) -> "PlotSpec":
        if self.kind == "heatmap" and self.value is None:
            raise ValueError("a heatmap colours each (x, y) cell by a metric: give value (e.g. value: step_time_s)")
        if self.kind == "heatmap" and self.series is not None:
            raise ValueError("a heatmap has no series (y is its second field); remove series or use kind line")
        if self.kind == "heatmap" and self.x == self.y:
            raise ValueError(f"a heatmap's x and y are both {self.x}; give y another field (its rows)")
        if self.kind != "heatmap" and self.value is not None:
            raise ValueError(f"value colours a heatmap's cells, and a {self.kind} draws y; remove value")
        return self

    @property
    def metric(self) -> str:
        """What each point, cell or bar is the best of."""
        return self.value if self.kind == "heatmap" else self.y  # type: ignore[return-value]

    @property
    def groups(self) -> list[str]:
        """The columns whose values a point, cell or bar shares."""
        names = [self.x, self.y if self.kind == "heatmap" else self.series]
        return list(dict.fromkeys(name for name in names if name is not None))


class ReportSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    plots: list[PlotSpec] = Field(default_factory=list, max_length=MAX_PLOTS)


def metric_direction(metric: str, objectives: Mapping[str, Direction]) -> Direction | None:
    """Which of a metric's values is best: the study's direction for one of its objectives, else the installed
    objective's own, else by its name (times, memory, money and energy: minimize; rates: maximize); None when
    none of these says."""
    if metric in objectives:
        return objectives[metric]
    installed = {item.metric: item.direction for item in plugins.objectives() if isinstance(item, Objective)}
    if metric in installed:
        return installed[metric]
    if in_seconds(metric) or metric.endswith(SMALLER_IS_BETTER):
        return "minimize"
    if metric.endswith("per_s") or "_per_" in metric:
        return "maximize"
    return None


def known_metrics() -> set[str]:
    """Every metric a trials table can have a column of: the evaluation's and each installed objective's and
    constraint's."""
    return {*EVALUATION_METRICS, *(item.metric for item in plugins.objectives())}


def leaf_paths(node: Any, prefix: str = "") -> list[str]:
    """The dotted path of every value in a nested mapping (list items by their index: system.network.0.x)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
    if items is None:
        return [prefix]
    return [path for key, child in items for path in leaf_paths(child, f"{prefix}.{key}" if prefix else str(key))]


def check_report(
    report: ReportSpec,
    source: str,
    fields: Collection[str],
    categorical: Collection[str],
    objectives: Mapping[str, Direction],
) -> None:
    """Each plot names fields the trials table (or the base) has and a metric whose best it can tell: `fields` are
    the study's searched, derived, recorded and base paths, `categorical` the searched ones with non-numeric
    choices."""
    metrics = known_metrics()
    for index, plot in enumerate(report.plots):
        where = f"{source}: field 'report.plots.{index}"
        for role in ("x", "y", "series", "value"):
            name = getattr(plot, role)
            if name is not None and name not in fields and name not in metrics:
                raise SpecError(
                    f"{where}.{role}': '{name}' is neither a searched, derived or base field nor a metric; name a "
                    f"field of space, derived or base by its dotted path, or a metric ({', '.join(sorted(metrics))})"
                )
        role = "value" if plot.kind == "heatmap" else "y"
        if plot.metric not in metrics:
            raise SpecError(
                f"{where}.{role}': '{plot.metric}' is a field, and a {plot.kind}'s {role} is the metric each "
                f"{'cell' if role == 'value' else 'point'} is the best of; name a metric (e.g. step_time_s)"
            )
        if plot.direction is None and metric_direction(plot.metric, objectives) is None:
            raise SpecError(
                f"{where}.direction': which value of '{plot.metric}' is best its name does not say; give direction: "
                "minimize or maximize"
            )
        if plot.kind == "line" and plot.x in categorical:
            raise SpecError(
                f"{where}.x': '{plot.x}' has non-numeric choices, and a line needs a numeric x; use kind: bar"
            )
