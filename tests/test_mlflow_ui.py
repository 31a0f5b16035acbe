"""The MLflow UI, as a person browsing a study sees it: a real `mlflow server`, a real headless Chromium (Debian's
chromium package), screenshots of the page `dse run` links to and of the trials compared side by side, and the
rendered DOM checked for the study's runs, their order and their metric columns."""

import json
import re
import shutil
import subprocess
import urllib.parse
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

from conftest import ROOT, patience, skip_without
from helpers import run_cli
from mlflow import MlflowClient

from dse.results.tracking import logged_trials, read_parquet

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=20000",  # the UI is a JS app: let it fetch and render before the capture
]


def chromium(url: str, profile: Path, *action: str, size: str = "1800,1100") -> str:
    """The page rendered by one headless Chromium: `action` is what to take of it (--screenshot=FILE, --dump-dom or
    both at once, from the same render); returns its stdout (the DOM, with --dump-dom)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        skip_without("chromium", "chromium (headless, for the MLflow UI)")
    command = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}", *action, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=patience(120), check=True).stdout


def visible_text(html: str) -> str:
    """The page's text: the rendered DOM without scripts, styles and tags, whitespace collapsed."""
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


class RunsGrid(HTMLParser):
    """The runs table of a rendered page: its column ids in display order, and per row (in display order) its
    run id and cell texts by column id. The grid renders only the columns in view, so a column is found only if
    it is shown."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self._positions: dict[str, int] = {}
        self.row_ids: dict[int, str] = {}
        self.cells: dict[int, dict[str, str]] = defaultdict(dict)
        self._row: int | None = None
        self._cell: str | None = None
        self._depth = 0
        self._text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("role") == "columnheader" and a.get("col-id") and a.get("aria-colindex"):
            self._positions[a["col-id"] or ""] = int(a["aria-colindex"] or 0)
        if a.get("role") == "row" and a.get("row-index") is not None:
            self._row = int(a["row-index"] or 0)
            self.row_ids[self._row] = a.get("row-id") or ""
        if self._row is not None and a.get("role") == "gridcell":
            self._cell, self._depth, self._text = a.get("col-id"), 0, []
        if self._cell is not None and tag not in ("input", "br", "img"):
            self._depth += 1

    def handle_endtag(self, tag: str) -> None:
        if self._cell is not None:
            self._depth -= 1
            if self._depth == 0 and self._row is not None:
                self.cells[self._row][self._cell] = " ".join("".join(self._text).split())
                self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._text.append(data)

    @property
    def data_columns(self) -> list[str]:
        """Metric, parameter and tag columns (metrics.`step_time_s`), without the pinned and group headers."""
        return sorted((c for c in self._positions if "`" in c and "Run Name" not in c), key=self._positions.get)

    def column(self, col_id: str) -> list[str]:
        """A column's cell texts, row by row in display order."""
        return [self.cells[row].get(col_id, "") for row in sorted(self.row_ids)]


def test_dse_run_links_to_the_trials_table_with_the_objectives_as_columns(mlflow_server, tmp_path):
    """`dse run` prints a link that opens the study's trials (not the GenAI overview, not one folded parent run),
    best step time first, with step time and peak memory as columns; the trials compare side by side."""
    study = tmp_path / "ui-study.yaml"
    study.write_text((ROOT / "studies" / "small.yaml").read_text().replace("name: small", "name: ui-study"))
    out, uri = tmp_path / "out", mlflow_server.uri
    # In this process (the link is what `dse run` prints; a subprocess would add the CLI's start, 2-4 s).
    code, stdout, stderr = run_cli("run", str(study), "--inline", "--out", str(out), "--tracking-uri", uri)
    assert code == 0, stderr
    link = re.search(r"^browse +(\S+)$", stdout, flags=re.M)
    assert link, stdout
    page = link.group(1)
    assert page.startswith(f"{uri}/#/experiments/")
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("ui-study").experiment_id
    children = client.search_runs([experiment], "tags.trial_number != ''")
    trials = read_parquet(out)
    assert int(trials["evaluation"].sum()) == 8, "the study's budget: 8 evaluations"
    assert len(children) == len(logged_trials(trials)), "a child run per trial, but none for a repeated point"

    runs_png = tmp_path / "mlflow-runs.png"
    html = chromium(page, tmp_path / "profile-runs", f"--screenshot={runs_png}", "--dump-dom")
    assert "<title>Runs - Experiment" in html, "the runs table, not the GenAI overview"
    assert "ui-study trials" in visible_text(html), "the study run's saved view is active"
    grid = RunsGrid(html)
    step_time, peak_memory = "metrics.`step_time_s`", "metrics.`peak_memory_bytes`"
    assert grid.data_columns[:2] == [step_time, peak_memory], "the objectives lead the columns"
    assert {"tags.`feasible`", "tags.`pareto`"} <= set(grid.data_columns)
    by_id = {r.info.run_id: r for r in children}
    assert sorted(grid.row_ids.values()) == sorted(by_id), "every trial is a row (no parent row to unfold)"
    shown = [float(v) if v != "-" else float("inf") for v in grid.column(step_time)]
    assert shown == sorted(shown), "best step time first, infeasible trials last"
    for row, run_id in grid.row_ids.items():
        metrics = by_id[run_id].data.metrics
        for column, metric in ((step_time, "step_time_s"), (peak_memory, "peak_memory_bytes")):
            cell = grid.cells[row][column]
            assert (None if cell == "-" else float(cell)) == metrics.get(metric), "a trial's own values"

    ids = urllib.parse.quote(json.dumps([r.info.run_id for r in children]))
    compare = (
        f"{mlflow_server.uri}/#/compare-runs?runs={ids}&experiments={urllib.parse.quote(json.dumps([experiment]))}"
    )
    compare_png = tmp_path / "mlflow-trials.png"
    compare_html = chromium(
        compare, tmp_path / "profile-compare", f"--screenshot={compare_png}", "--dump-dom", size="1800,2400"
    )
    compare_text = visible_text(compare_html)
    for child in children:
        assert child.info.run_name in compare_text
    # The page lists the metrics in name order in a box of fixed height that renders the first rows only (with the
    # cost and energy metrics, 22 of them; the first 17 shown): the first ones are there, with their values.
    logged = sorted({name for child in children for name in child.data.metrics})
    assert logged[0] in compare_text and "model_flops" in compare_text and "mfu" in compare_text
    flops = [r.data.metrics["model_flops"] for r in children if r.data.metrics]
    assert flops and all(f"{value:.0f}" in compare_text for value in flops), "metric values are rendered"
    for png in (runs_png, compare_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000
    print(f"screenshots: {runs_png} {compare_png}")
