"""The MLflow UI, as a person browsing a study sees it: a real `mlflow server`, a real headless Chromium (Debian's
chromium package), screenshots of the experiment's runs table and of its trials compared side by side, and the
rendered page's text checked for the study's runs and metrics."""

import json
import re
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
from conftest import ROOT
from mlflow import MlflowClient

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
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed: apt-get install chromium")
    command = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}", *action, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def visible_text(html: str) -> str:
    """The page's text: the rendered DOM without scripts, styles and tags, whitespace collapsed."""
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def test_the_mlflow_ui_lists_the_study_runs_with_their_metrics(mlflow_server, tmp_path):
    study = tmp_path / "ui-study.yaml"
    study.write_text((ROOT / "studies" / "small.yaml").read_text().replace("name: small", "name: ui-study"))
    out, uri = tmp_path / "out", mlflow_server.uri
    run = subprocess.run(
        [sys.executable, "-m", "dse.cli", "run", str(study), "--inline", "--out", str(out), "--tracking-uri", uri],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("ui-study").experiment_id
    children = client.search_runs([experiment], "tags.state = 'COMPLETE'")
    assert children

    runs_page = f"{mlflow_server.uri}/#/experiments/{experiment}/runs"
    runs_png = tmp_path / "mlflow-runs.png"
    chromium(runs_page, tmp_path / "profile-runs", f"--screenshot={runs_png}")
    runs_text = visible_text(chromium(runs_page, tmp_path / "profile-runs-dom", "--dump-dom"))
    assert "ui-study" in runs_text and "Training runs" in runs_text
    assert "9 matching runs" in runs_text, "the parent and its 8 trials"

    ids = urllib.parse.quote(json.dumps([r.info.run_id for r in children]))
    compare = (
        f"{mlflow_server.uri}/#/compare-runs?runs={ids}&experiments={urllib.parse.quote(json.dumps([experiment]))}"
    )
    compare_png = tmp_path / "mlflow-trials.png"
    chromium(compare, tmp_path / "profile-compare", f"--screenshot={compare_png}", size="1800,2400")
    compare_text = visible_text(chromium(compare, tmp_path / "profile-compare-dom", "--dump-dom", size="1800,2400"))
    for child in children:
        assert child.info.run_name in compare_text
    for metric in ("step_time_s", "peak_memory_bytes", "mfu"):
        assert metric in compare_text
    step_time = children[0].data.metrics["step_time_s"]
    assert f"{step_time:.5g}"[:5] in compare_text, "metric values are rendered"
    for png in (runs_png, compare_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000
    print(f"screenshots: {runs_png} {compare_png}")
