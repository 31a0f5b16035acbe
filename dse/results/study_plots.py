"""The plots a study file asks for in `report: plots:` (`dse.search.report_spec`), drawn as the papers draw theirs:
a metric against one field as lines (one per series value), as a heat map over two fields, or as bars.

Each point, cell or bar is the best feasible trial among those sharing its x (and series, or y), by the metric's
direction: the figure answers "what is the best this hardware (or this setting) can do", not "what did the sampler
happen to try". The data each plot was drawn from is returned with it, so that tests (and notebooks) read the
figures rather than pixels.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dse.fields import GiB
from dse.results.plots import figure, legend
from dse.search.decoding import fields_at
from dse.search.report_spec import PlotSpec, metric_direction
from dse.search.space import StudySpec

PLOTS_DIR = "plots"
"""The subfolder of the output folder the study's plots go to (the Pareto plots stay beside the tables)."""
NUMBER = "number"
Orders = Mapping[str, list[Any]]
LOG_SPAN = 16
"""A line's x spanning this factor or more (bandwidths 3.125 to 100 GB/s, 2 to 128 nodes) is drawn on a log axis."""
TICK_CHAR_IN = 0.08
"""Inches a character of a tick label (10 pt) takes, about."""


@dataclass(frozen=True)
class StudyPlot:
    plot: PlotSpec
    path: Path
    data: pd.DataFrame
    """The best trial per group: the plot's group columns, its metric and the trial's number, in drawing order."""
    orders: dict[str, list[Any]]
    """Each group column's values in drawing order (`order`)."""


def draw(spec: StudySpec, frame: pd.DataFrame, out_dir: Path) -> list[StudyPlot]:
    """Every plot of the study's report section into OUT/plots/ (those of an earlier run removed first)."""
    folder = out_dir / PLOTS_DIR
    for stale in folder.glob("*.png"):
        stale.unlink()
    plots = spec.report.plots if spec.report is not None else []
    if not plots:
        return []
    folder.mkdir(exist_ok=True)
    objectives = frame.attrs.get("objectives", {})
    choices = {name: param.choices for name, param in spec.space.items() if param.choices is not None}
    out = []
    for index, plot in enumerate(plots):
        direction = plot.direction or metric_direction(plot.metric, objectives) or "minimize"
        data, orders = best_per_group(with_base_columns(spec, frame, plot), plot, direction, choices)
        path = folder / f"plot{index + 1}-{_slug(plot)}.png"
        DRAWERS[plot.kind](data, plot, orders, path)
        out.append(StudyPlot(plot, path, data, orders))
    return out


def with_base_columns(spec: StudySpec, frame: pd.DataFrame, plot: PlotSpec) -> pd.DataFrame:
    """The frame with a constant column for each of the plot's fields that the base sets and the table lacks."""
    names = [name for name in (plot.x, plot.y, plot.series) if name and name not in frame]
    found = fields_at(spec.expanded_base, names)
    return frame.assign(**found) if found else frame


def best_per_group(
    frame: pd.DataFrame, plot: PlotSpec, direction: str, choices: Mapping[str, Sequence[Any]]
) -> tuple[pd.DataFrame, dict[str, list[Any]]]:
    """Among the feasible completed trials with the metric, the best (the first trial on a tie) per group, in
    drawing order (the series, or a heatmap's rows, slowest; x fastest), and each group column's order."""
    columns = list(dict.fromkeys([*plot.groups, plot.metric]))
    if frame.empty or any(name not in frame for name in columns):
        return pd.DataFrame(columns=[*columns, NUMBER]), {name: [] for name in plot.groups}
    done = frame[(frame["state"] == "COMPLETE") & (frame["feasible"] == True) & frame[plot.metric].notna()]  # noqa: E712
    done = done.sort_values(NUMBER, kind="stable")
    orders = {name: order(done[name], choices.get(name, ())) for name in plot.groups}
    ranked = done.sort_values(plot.metric, ascending=direction == "minimize", kind="stable")
    best = ranked.drop_duplicates(plot.groups)[[*columns, NUMBER]]
    by = [name for name in plot.groups if name != plot.x] + [plot.x]
    ranks = pd.DataFrame({name: best[name].map({v: i for i, v in enumerate(orders[name])}) for name in by})
    return best.loc[ranks.sort_values(by, kind="stable").index].reset_index(drop=True), orders


def order(values: pd.Series, choices: Sequence[Any] = ()) -> list[Any]:
    """A column's distinct values in drawing order: numbers ascending; anything else (names, flags) in the order
    of the file's choices, else as the trials first had it."""
    distinct = list(dict.fromkeys(values.dropna()))
    if all(isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_) for v in distinct):
        return sorted(distinct)
    rank = {choice: index for index, choice in enumerate(choices)}
    return sorted(distinct, key=lambda value: rank.get(value, len(rank)))


def _scaled(metric: str, values: pd.Series) -> tuple[pd.Series, str]:
    """A metric's values as drawn, and its axis label (bytes in GiB)."""
    if metric.endswith("_bytes"):
        return values / GiB, f"{metric.removesuffix('_bytes')} (GiB)"
    return values, metric


def _title(plot: PlotSpec) -> str:
    return plot.title or f"best {plot.metric} by {' and '.join(plot.groups)}"


def _slug(plot: PlotSpec) -> str:
    text = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{plot.kind}-{plot.metric}-by-{plot.x}")
    return text[:80]


def _series(data: pd.DataFrame, plot: PlotSpec, orders: Orders) -> list[tuple[str | None, pd.DataFrame]]:
    if plot.series is None:
        return [(None, data)]
    return [(f"{plot.series}={value}", data[data[plot.series] == value]) for value in orders[plot.series]]


def _line(data: pd.DataFrame, plot: PlotSpec, orders: Orders, path: Path) -> None:
    groups = _series(data, plot, orders)
    fig, (ax,), columns = figure([label for label, _ in groups if label])
    for label, rows in groups:
        ax.plot(rows[plot.x].astype(float), _scaled(plot.y, rows[plot.y])[0], marker="o", label=label)
    xs = [float(x) for x in orders[plot.x]]
    if len(xs) > 2 and xs[0] > 0 and xs[-1] / xs[0] >= LOG_SPAN:  # a doubling sweep, as the papers draw it
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
    _finish(fig, ax, plot, path, data, ylabel=_scaled(plot.y, data[plot.y])[1], columns=columns)


def _bar(data: pd.DataFrame, plot: PlotSpec, orders: Orders, path: Path) -> None:
    groups = _series(data, plot, orders)
    xs = orders[plot.x]
    fig, (ax,), columns = figure([label for label, _ in groups if label])
    width = 0.8 / max(len(groups), 1)
    for index, (label, rows) in enumerate(groups):
        at = np.array([xs.index(v) for v in rows[plot.x]]) + (index - (len(groups) - 1) / 2) * width
        ax.bar(at, _scaled(plot.y, rows[plot.y])[0], width=width, label=label)
    ax.set_xticks(range(len(xs)), [str(v) for v in xs], rotation=30 if len(xs) > 6 else 0)
    _finish(fig, ax, plot, path, data, ylabel=_scaled(plot.y, data[plot.y])[1], columns=columns)


def _heatmap(data: pd.DataFrame, plot: PlotSpec, orders: Orders, path: Path) -> None:
    xs, ys = orders[plot.x], orders[plot.y]
    grid = data.pivot_table(index=plot.y, columns=plot.x, values=plot.metric, aggfunc="first")
    cells, label = _scaled(plot.metric, grid.reindex(index=ys, columns=xs))
    fig, (ax,), _ = figure([])
    values = cells.to_numpy(dtype=float)
    if values.size:
        fig.colorbar(ax.imshow(values, origin="lower", aspect="auto", cmap="viridis"), ax=ax, label=label)
    middle = np.nanmean(values) if np.isfinite(values).any() else 0
    for (row, column), value in np.ndenumerate(values):
        if np.isfinite(value):
            colour = "black" if value > middle else "white"  # on viridis' light and dark ends
            ax.text(column, row, f"{value:.3g}", ha="center", va="center", fontsize=7, color=colour)
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_yticks(range(len(ys)), [str(v) for v in ys])
    longest = max((len(str(v)) for v in ys), default=0)  # names as row labels need a wider left margin
    fig.subplots_adjust(left=max(0.7, 0.5 + TICK_CHAR_IN * longest) / fig.get_figwidth())
    _finish(fig, ax, plot, path, data, ylabel=plot.y, columns=0, grid=False)


def _finish(
    fig: Any, ax: Any, plot: PlotSpec, path: Path, data: pd.DataFrame, ylabel: str, columns: int, grid: bool = True
) -> None:
    ax.set_xlabel(plot.x)
    ax.set_ylabel(ylabel)
    each = "no feasible trial" if data.empty else "best feasible trial each"
    ax.set_title(f"{_title(plot)} ({each})", fontsize=10)
    if grid:
        ax.grid(alpha=0.3)
    if columns and ax.get_legend_handles_labels()[1]:
        legend(ax, columns)
    fig.savefig(path)


DRAWERS = {"line": _line, "bar": _bar, "heatmap": _heatmap}
