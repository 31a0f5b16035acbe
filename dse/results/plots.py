"""Pareto plots of a study, as the STAGE paper draws its DSE figures: step time against peak memory per GPU,
colour by parallel shape (tp x pp x dp), marker by ZeRO stage, the front joined by a line.

A PNG (matplotlib, for reports and the MLflow artifact preview) and an interactive HTML (plotly, self-contained
so it opens offline from MLflow's artifact view) with every trial's shape and metrics on hover. What any study's
plots share (the rows drawn, a figure with a legend margin) is here too; `serving_plots` draws a serving study's.
"""

from pathlib import Path
from typing import Any

import pandas as pd

from dse.fields import GiB

PNG = "pareto.png"
HTML = "pareto.html"
X, Y = "peak_memory_bytes", "step_time_s"
MARKERS = {0: "o", 1: "s", 2: "^", 3: "D"}
PLOTLY_MARKERS = {0: "circle", 1: "square", 2: "triangle-up", 3: "diamond"}
MAX_POINTS = 20_000
"""Points drawn at most (a sample of the table's, the front always whole): a sweep's million would make a PNG take
minutes and an HTML page of hundreds of megabytes, and show no more than a sample does."""
LEGEND_COLUMN_IN = 1.7
"""Inches of figure width per legend column at least (a label like 'tp8 pp8 dp16 zero3' at 7 pt)."""
LEGEND_CHAR_IN = 0.055
"""Inches a character of a 7 pt legend label takes, about."""


def _shape(frame: pd.DataFrame) -> pd.Series:
    def degree(column: str) -> pd.Series:
        if column not in frame:
            return pd.Series(["1"] * len(frame), index=frame.index)
        return frame[column].map(lambda v: "?" if pd.isna(v) else f"{v:.0f}")

    return "tp" + degree("parallel.tp") + " pp" + degree("parallel.pp") + " dp" + degree("parallel.dp")


def drawn(frame: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """The rows a plot of y against x draws: COMPLETE trials with both, one per design point, MAX_POINTS of them
    at most."""
    if frame.empty or x not in frame or y not in frame:
        return frame.iloc[:0]
    done = frame[(frame["state"] == "COMPLETE") & frame[x].notna() & frame[y].notna()].drop_duplicates("point_key")
    return done.sample(MAX_POINTS, random_state=0) if len(done) > MAX_POINTS else done


def figure(labels: list[str], panels: int = 1, plot_width: float = 9) -> tuple[Any, list[Any], int]:
    """A bare Agg Figure (pyplot takes a third of a second to import, and a tight bounding box a second draw: most
    of the post-search time of the quickstart) of `panels` axes side by side over `plot_width` inches, with a
    margin of its own on the right for a legend of `labels`, where it covers no point; returns it, its axes and the
    legend's columns."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = 1 + len(labels) // 30
    column_in = max(LEGEND_COLUMN_IN, LEGEND_CHAR_IN * max(map(len, labels), default=0) + 0.5)
    width = plot_width + column_in * columns
    fig = Figure(figsize=(width, 6), dpi=110)
    FigureCanvasAgg(fig)
    right = 1 - (column_in * columns + 0.2) / width
    fig.subplots_adjust(left=0.7 / width, right=right, top=0.93, bottom=0.09, wspace=0.25)
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)], columns


def legend(ax: Any, columns: int) -> None:
    ax.legend(fontsize=7, ncol=columns, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


def _points(frame: pd.DataFrame) -> pd.DataFrame:
    """The drawn trials with their shape, ZeRO stage and feasibility."""
    done = drawn(frame, X, Y)
    if done.empty:
        return pd.DataFrame(columns=[X, Y, "shape", "zero", "feasible", "number"])
    out = done[["number", X, Y, "feasible"]].copy()
    out["shape"] = _shape(done)
    out["zero"] = done["parallel.zero"].fillna(0).astype(int) if "parallel.zero" in done else 0
    return out


def pareto_png(frame: pd.DataFrame, front: pd.DataFrame, path: Path, title: str) -> Path:
    from matplotlib import colormaps

    points = _points(frame)
    labels = [f"{shape} zero{zero}" for shape, zero in points.groupby(["shape", "zero"]).groups]
    fig, (ax,), columns = figure(labels + ["Pareto front"] * (not front.empty))
    colours = colormaps["tab20"]
    for index, (shape, group) in enumerate(points.groupby("shape", sort=True)):
        for zero, rows in group.groupby("zero"):
            feasible = rows["feasible"] == True  # noqa: E712 - nullable column
            style = {"marker": MARKERS.get(int(zero), "x"), "color": colours(index % 20), "s": 36}
            label = f"{shape} zero{zero}"
            ax.scatter(
                rows.loc[feasible, X] / GiB, rows.loc[feasible, Y], **style, label=label if feasible.any() else None
            )
            ax.scatter(
                rows.loc[~feasible, X] / GiB,
                rows.loc[~feasible, Y],
                **style,
                alpha=0.25,
                label=None if feasible.any() else label,
            )
    if not front.empty:
        ax.plot(front[X] / GiB, front[Y], color="black", linewidth=1, drawstyle="steps-post", label="Pareto front")
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"{title}: faded points do not fit in HBM")
    ax.grid(alpha=0.3)
    if len(points):
        legend(ax, columns)
    fig.savefig(path)
    return path


def pareto_html(frame: pd.DataFrame, front: pd.DataFrame, path: Path, title: str) -> Path:
    import plotly.graph_objects as go

    points = _points(frame)
    fig = go.Figure()
    for shape, group in points.groupby("shape", sort=True):
        fig.add_trace(
            go.Scatter(
                x=group[X] / GiB,
                y=group[Y],
                mode="markers",
                name=shape,
                marker={
                    "symbol": [PLOTLY_MARKERS.get(int(z), "x") for z in group["zero"]],
                    "opacity": [1.0 if f == True else 0.3 for f in group["feasible"]],  # noqa: E712
                    "size": 9,
                },
                text=[f"trial {n}, zero {z}" for n, z in zip(group["number"], group["zero"], strict=True)],
                hovertemplate="%{text}<br>%{x:.2f} GiB, %{y:.4g} s<extra>%{fullData.name}</extra>",
            )
        )
    if not front.empty:
        fig.add_trace(go.Scatter(x=front[X] / GiB, y=front[Y], mode="lines", name="Pareto front", line={"shape": "hv"}))
    fig.update_layout(
        title=f"{title} (marker: ZeRO stage circle 0, square 1, triangle 2, diamond 3; faded: over HBM)",
        xaxis_title="peak memory per GPU (GiB)",
        yaxis_title="step time (s)",
    )
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    return path
