"""Pictures of a serving study: the throughput frontier and the front's latency distributions.

The frontier is how serving papers and vendors draw a deployment search (Charon Fig. 13, aiconfigurator, NVIDIA's
InferenceMAX): output tokens/s per GPU, what the deployment costs, against tokens/s per user, what each user sees,
every point coloured by its deployment kind (aggregated or disaggregated) with a marker per instance shape
(`pareto.deployment`), and the front joined by a line. The latency CDFs come from the event simulation of a few
front members at their own load, whatever depth the study searched at: a percentile in a table says little about a
tail's shape, and the steady state has no tail at all.

Each is a PNG (matplotlib) and a self-contained interactive HTML page (plotly), as `plots` writes the training
Pareto plots, into the output folder and the study's MLflow parent run.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dse import plugins
from dse.errors import InfeasibleError
from dse.results.pareto import PER_GPU, PER_USER, deployment, kinds, without_ignored
from dse.results.plots import drawn, figure, legend
from dse.search.decoding import StudySpec, decode
from dse.serving.events import EventStats
from dse.serving.serve import latencies
from dse.spec import DesignPoint

CDF_PNG = "latency_cdf.png"
CDF_HTML = "latency_cdf.html"
CDF_MEMBERS = 6
"""Front members whose latencies are simulated and drawn: enough to span the front, few enough to tell apart
(each simulation takes a second or more)."""
FIELD_PREFIXES = ("parallel.", "workload.", "system.")
X_LABEL, Y_LABEL = "output tokens/s per user", "output tokens/s per GPU"


KIND_COLOURS = {"aggregated": "#1f77b4", "disaggregated": "#ff7f0e"}
"""Blue and orange, the first two of matplotlib's tab10 and plotly's default colours: a mixed study's two kinds are
told apart at a glance, whatever their shapes."""
MARKERS = (
    ("o", "circle"),
    ("s", "square"),
    ("^", "triangle-up"),
    ("D", "diamond"),
    ("v", "triangle-down"),
    ("P", "cross"),
    ("X", "x"),
    ("*", "star"),
    ("p", "pentagon"),
    ("h", "hexagon"),
    ("<", "triangle-left"),
    (">", "triangle-right"),
)
"""The markers of a kind's deployments in turn (matplotlib's, plotly's): past twelve they repeat, and the HTML's
hover text tells the points apart."""


def _points(frame: pd.DataFrame) -> pd.DataFrame:
    """The drawn points with their kind, deployment and feasibility (the hover text reads their other columns; a
    decode pool an aggregated point ignores is left out of it)."""
    points = without_ignored(drawn(frame, PER_USER, PER_GPU))
    points["kind"] = kinds(points)
    points["deployment"] = deployment(points)
    return points


def _groups(points: pd.DataFrame) -> list[tuple[str, str, int, pd.DataFrame]]:
    """The points by deployment, aggregated first: each group's label, colour (its kind's) and marker (its turn
    among its kind's deployments)."""
    out = []
    for kind, rows in points.groupby("kind", sort=True):
        for turn, (name, group) in enumerate(rows.groupby("deployment", sort=True)):
            out.append((name, KIND_COLOURS[str(kind)], turn % len(MARKERS), group))
    return out


def _front_line(front: pd.DataFrame) -> pd.DataFrame:
    """The front from the slowest per user (the most throughput) to the fastest."""
    return front.sort_values([PER_USER, PER_GPU])


def frontier_png(frame: pd.DataFrame, front: pd.DataFrame, path: Path, title: str) -> Path:
    points = _points(frame)
    groups = _groups(points)
    fig, (ax,), columns = figure([name for name, *_ in groups] + ["Pareto front"] * (not front.empty))
    for name, colour, marker, rows in groups:
        feasible = rows["feasible"] == True  # noqa: E712 - nullable column
        style = {"color": colour, "marker": MARKERS[marker][0], "s": 24}
        ax.scatter(rows.loc[feasible, PER_USER], rows.loc[feasible, PER_GPU], **style, label=name)
        ax.scatter(rows.loc[~feasible, PER_USER], rows.loc[~feasible, PER_GPU], **style, alpha=0.2)
    if not front.empty:
        line = _front_line(front)
        ax.plot(line[PER_USER], line[PER_GPU], color="black", linewidth=1, marker=".", label="Pareto front")
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(Y_LABEL)
    ax.set_title(f"{title}: serving frontier (faded: over a constraint)")
    ax.grid(alpha=0.3)
    if len(points):
        legend(ax, columns)
    fig.savefig(path)
    return path


def _hover(rows: pd.DataFrame, fields: list[str]) -> list[str]:
    """Per row: its trial, the fields that vary across the drawn points, TTFT and TPOT (mean and p99) and the two
    throughputs."""

    def value(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    def latency(row: pd.Series, what: str) -> str:
        mean, p99 = row.get(f"{what}_mean_s"), row.get(f"{what}_p99_s")
        return f"{what.upper()} mean {1000 * mean:.4g} ms, p99 {1000 * p99:.4g} ms"

    out = []
    for _, row in rows.iterrows():
        lines = [f"trial {int(row['number'])}"] + [f"{f}: {value(row[f])}" for f in fields if pd.notna(row[f])]
        lines += [latency(row, "ttft"), latency(row, "tpot")]
        lines.append(f"{row[PER_GPU]:,.1f} tokens/s/GPU, {row[PER_USER]:,.2f} tokens/s/user")
        if pd.notna(row.get("max_rate_per_s")):
            lines.append(f"max rate meeting the SLO {row['max_rate_per_s']:.4g} requests/s")
        out.append("<br>".join(lines))
    return out


def frontier_html(frame: pd.DataFrame, front: pd.DataFrame, path: Path, title: str) -> Path:
    """Values are plain JSON lists (not plotly's base64 arrays), so that the page can be searched for them."""
    import plotly.graph_objects as go

    points = _points(frame)
    fields = [c for c in points if c.startswith(FIELD_PREFIXES) and points[c].nunique() > 1]
    fig = go.Figure()
    for name, colour, marker, rows in _groups(points):
        fig.add_trace(
            go.Scatter(
                x=rows[PER_USER].tolist(),
                y=rows[PER_GPU].tolist(),
                mode="markers",
                name=name,
                legendgroup=rows["kind"].iloc[0],
                legendgrouptitle_text=rows["kind"].iloc[0],
                marker={
                    "color": colour,
                    "symbol": MARKERS[marker][1],
                    "opacity": [1.0 if f == True else 0.25 for f in rows["feasible"]],  # noqa: E712
                    "size": 8,
                },
                text=_hover(rows, fields),
                hovertemplate="%{text}<extra>%{fullData.name}</extra>",
            )
        )
    if not front.empty:
        line = without_ignored(_front_line(front))
        fig.add_trace(
            go.Scatter(
                x=line[PER_USER].tolist(),
                y=line[PER_GPU].tolist(),
                mode="lines+markers",
                name="Pareto front",
                line={"color": "black"},
                text=_hover(line, fields),
                hovertemplate="%{text}<extra>Pareto front</extra>",
            )
        )
    fig.update_layout(
        title=f"{title}: serving frontier (faded: over a constraint)", xaxis_title=X_LABEL, yaxis_title=Y_LABEL
    )
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    return path


def spread(front: pd.DataFrame, count: int = CDF_MEMBERS) -> pd.DataFrame:
    """Up to `count` front members evenly along it (by tokens/s per user), one of each set of members that tie on
    both throughputs (the same deployment at another instance count)."""
    line = _front_line(front).drop_duplicates([PER_USER, PER_GPU])
    picks = np.unique(np.linspace(0, len(line) - 1, min(count, len(line))).round().astype(int))
    return line.iloc[picks]


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def points_of(spec: StudySpec, rows: pd.DataFrame) -> dict[int, DesignPoint]:
    """The design points of table rows by trial (or sweep row) number, decoded from their searched columns as the
    study decoded them; a row whose params decode to no point (a reason) is left out."""
    out: dict[int, DesignPoint] = {}
    for _, row in rows.iterrows():
        point = decode(spec, {name: _plain(row[name]) for name in spec.space})
        if not isinstance(point, str):
            out[int(row["number"])] = point
    return out


def at_fixed_load(point: DesignPoint, max_rate_per_s: float) -> DesignPoint:
    """A max_rate point (no load of its own) at the rate it was found to sustain; any other point as it is."""
    serving = point.workload.serving
    if serving is None or not serving.max_rate:
        return point
    raw = point.model_dump(mode="json", exclude_none=True)
    raw["workload"]["serving"].update(max_rate=False, rate_per_s=max_rate_per_s)
    return DesignPoint.model_validate(raw)


def _load(point: DesignPoint) -> str:
    serving = point.workload.serving
    assert serving is not None
    if serving.concurrency is not None:
        return f"{serving.concurrency} client{'s' * (serving.concurrency > 1)}"
    return "trace" if serving.rate_per_s is None else f"{serving.rate_per_s:.3g} requests/s"


def simulate(spec: StudySpec, members: pd.DataFrame) -> dict[str, EventStats]:
    """Each member's event simulation at its load (a max_rate point at its max_rate_per_s), by a label naming its
    trial, deployment and load; a member its load overwhelms is left out."""
    generator = plugins.generator(spec.generator)
    cost_model = plugins.cost_model(spec.cost_model, spec.cost_model_options)
    rows = members.set_index("number")
    labels = deployment(rows, counts=True)
    out: dict[str, EventStats] = {}
    for number, point in points_of(spec, members).items():
        point = at_fixed_load(point, float(rows.at[number, "max_rate_per_s"]) if "max_rate_per_s" in rows else 0.0)
        try:
            stats = latencies(point, generator, cost_model)
        except InfeasibleError:
            continue
        out[f"trial {number}: {labels[number]}, {_load(point)}"] = stats
    return out


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values (NaN, a one-token request's TPOT, dropped) and the share of requests at or below each."""
    ordered = np.sort(values[~np.isnan(values)])
    return ordered, np.arange(1, len(ordered) + 1) / max(len(ordered), 1)


PANELS = (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"))
"""The CDFs drawn side by side, on log axes: latencies of one front span orders of magnitude."""


def cdf_png(curves: Mapping[str, EventStats], path: Path, title: str) -> Path:
    from matplotlib.ticker import LogFormatter

    fig, axes, columns = figure(list(curves), panels=len(PANELS), plot_width=12)
    for ax, (field, label) in zip(axes, PANELS, strict=True):
        for name, stats in curves.items():
            x, share = _cdf(getattr(stats, field))
            ax.step(1000 * x, share, where="post", label=name)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(LogFormatter())  # 5, not 5 x 10^0; minor ticks labelled within a decade
        ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.set_xlabel(label)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: latency CDFs of front members (event simulation)")
    legend(axes[-1], columns)
    fig.savefig(path)
    return path


def cdf_html(curves: Mapping[str, EventStats], path: Path, title: str) -> Path:
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(PANELS))
    colours = qualitative.Plotly
    for index, (name, stats) in enumerate(curves.items()):
        for column, (field, label) in enumerate(PANELS, start=1):
            x, share = _cdf(getattr(stats, field))
            fig.add_trace(
                go.Scatter(
                    x=(1000 * x).tolist(),
                    y=share.tolist(),
                    mode="lines",
                    line={"shape": "hv", "color": colours[index % len(colours)]},
                    name=name,
                    legendgroup=name,
                    showlegend=column == 1,
                    hovertemplate=f"{label.split()[0]} %{{x:.4g}} ms: %{{y:.1%}} of requests<extra>{name}</extra>",
                ),
                row=1,
                col=column,
            )
    for column, (_, label) in enumerate(PANELS, start=1):
        fig.update_xaxes(title_text=label, type="log", row=1, col=column)
    fig.update_yaxes(title_text="share of requests", row=1, col=1)
    fig.update_layout(title=f"{title}: latency CDFs of front members (event simulation)")
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    return path


def latency_cdfs(spec: StudySpec, front: pd.DataFrame, out_dir: Path, title: str) -> list[Path]:
    """The TTFT and TPOT CDFs of up to CDF_MEMBERS front members (`spread`), PNG and HTML; none (and an earlier
    run's removed) when no member could be simulated."""
    curves = simulate(spec, spread(front)) if not front.empty else {}
    paths = [out_dir / CDF_PNG, out_dir / CDF_HTML]
    if not curves:
        for stale in paths:
            stale.unlink(missing_ok=True)
        return []
    return [cdf_png(curves, paths[0], title), cdf_html(curves, paths[1], title)]
