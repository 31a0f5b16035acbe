"""A serving study's pictures and report: the throughput frontier coloured by deployment, the front members' latency
CDFs from the event simulation, and `dse report`'s serving columns and SLO line."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from dse.point.points import build_point, expand
from dse.results import pareto, sweep_results, tracking
from dse.results.serving_plots import at_fixed_load, spread
from dse.search import sweep
from dse.search.space import StudySpec, load_study
from dse.search.sweep_parts import PartStore

TPOT_SLO = 0.005
STUDY = f"""\
name: serving-pictures
objectives: {{tokens_per_s_per_gpu: maximize, tokens_per_s_per_user: maximize}}
constraints: [fits_memory]
sampler: grid
sweep: true
base:
  model: llama3-8b
  workload:
    mode: serve
    serving:
      isl: 128
      osl: 16
      concurrency: 4
      depth: events
      requests: 600
      lengths: {{distribution: lognormal, cv: 0.5}}
      slo: {{tpot_p99_s: {TPOT_SLO}}}
  system: tiny-ring
space:
  parallel.tp: {{choices: [1, 2, 4]}}
  workload.serving.concurrency: {{choices: [1, 16, 256]}}
derived:
  parallel.dp: world / parallel.tp
"""
"""Nine points on 8 roofline H100s: Llama-3-8B is slow enough per GPU that tp trades throughput for per-user speed,
so the front holds several deployments, and the SLO splits it (tp4 at one client meets it, 256 clients do not).
Lognormal lengths spread the latencies, so the tables show p99s and the CDFs have shape."""


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tracking.Results]:
    """The study swept in this process, its tables and pictures written as `dse run` writes them."""
    spec, out, results = swept(tmp_path_factory.mktemp("serving"), STUDY)
    tracking.write_plots(spec, results, out)
    return out, results


def swept(folder: Path, text: str) -> tuple[StudySpec, Path, tracking.Results]:
    """The grid study of `text` swept in this process into `folder`/out, and its tables as `dse run` writes them."""
    (folder / "study.yaml").write_text(text)
    spec = load_study(folder / "study.yaml")
    out = folder / "out"
    out.mkdir()
    tracking.save_spec(spec, out)
    sweep.run(spec, PartStore(out), sweep.InlinePool(spec))
    results = sweep_results.write_tables(spec, out)
    assert results is not None
    return spec, out, results


def traces(page: Path) -> list[dict]:
    """The traces of the plotly figure a page draws (the last `Plotly.newPlot` call: the library comes before)."""
    html = page.read_text()
    call = html[html.rindex("Plotly.newPlot(") :]
    return json.JSONDecoder().raw_decode(call[call.index("[") :])[0]


def test_the_frontier_draws_every_point_by_deployment_and_joins_the_front(study):
    out, results = study
    front = results.front
    assert pareto.deployment(front).nunique() > 1
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    drawn = {t["name"]: t for t in traces(out / "pareto.html")}
    assert set(drawn) == {"agg tp1", "agg tp2", "agg tp4", "Pareto front"}
    assert sum(len(t["x"]) for name, t in drawn.items() if name != "Pareto front") == 9
    line = front.sort_values("tokens_per_s_per_user")
    assert drawn["Pareto front"]["x"] == line["tokens_per_s_per_user"].tolist()
    assert drawn["Pareto front"]["y"] == line["tokens_per_s_per_gpu"].tolist()
    for (_, row), hover in zip(line.iterrows(), drawn["Pareto front"]["text"], strict=True):
        assert hover.startswith(f"trial {row['number']}<br>")
        assert f"workload.serving.concurrency: {row['workload.serving.concurrency']}<br>" in hover
        assert f"TTFT mean {1000 * row['ttft_mean_s']:.4g} ms, p99 {1000 * row['ttft_p99_s']:.4g} ms" in hover
        assert f"TPOT mean {1000 * row['tpot_mean_s']:.4g} ms, p99 {1000 * row['tpot_p99_s']:.4g} ms" in hover
    tp1 = results.frame[results.frame["parallel.tp"] == 1]
    assert sorted(drawn["agg tp1"]["x"]) == sorted(tp1["tokens_per_s_per_user"])


def test_latency_cdfs_are_the_event_simulation_the_study_measured(study):
    """The CDFs come from `latencies` after the study, the table's percentiles from the sweep's own evaluation of
    the same point (same seed, same requests): the CDF's 99th percentile is the table's p99."""
    out, results = study
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
    members = spread(results.front)
    assert len(members) == len(results.front) > 1  # fewer than 6, and no ties on both throughputs
    drawn = traces(out / "latency_cdf.html")
    assert len(drawn) == 2 * len(members)  # a TTFT and a TPOT curve each
    for (_, row), ttft, tpot in zip(members.iterrows(), drawn[0::2], drawn[1::2], strict=True):
        clients = row["workload.serving.concurrency"]
        shape = f"agg tp{row['parallel.tp']} x{row['parallel.dp']:.0f}"
        assert ttft["name"] == f"trial {row['number']}: {shape}, {clients} client{'s' * (clients > 1)}"
        assert ttft["xaxis"] == "x" and tpot["xaxis"] == "x2"
        for curve, metric in ((ttft, "ttft"), (tpot, "tpot")):
            x, share = np.array(curve["x"]) / 1000, np.array(curve["y"])
            assert np.all(np.diff(x) >= 0) and share[-1] == 1.0
            assert np.percentile(x, 99) == pytest.approx(row[f"{metric}_p99_s"], rel=1e-9)
            assert np.percentile(x, 50) == pytest.approx(row[f"{metric}_p50_s"], rel=1e-9)


def test_report_prints_the_serving_front_and_the_slo_it_met(study):
    out, results = study
    code, stdout, stderr = run_cli("report", str(out))
    assert code == 0, stderr
    front = results.front
    header = next(line for line in stdout.splitlines() if line.lstrip().startswith("trial "))
    assert header.split() == [
        *("trial", "tp", "pp", "instances", "clients"),
        *("TTFT", "p99", "ms", "TPOT", "p99", "ms", "tokens/s/GPU", "tokens/s/user"),
    ]
    for _, row in front.iterrows():
        cells = next(line for line in stdout.splitlines() if line.split()[:1] == [str(row["number"])]).split()
        assert cells[1:5] == [
            str(row["parallel.tp"]),
            "1",
            f"{row['parallel.dp']:.0f}",
            str(row["workload.serving.concurrency"]),
        ]
        assert cells[5:] == [
            f"{1000 * row['ttft_p99_s']:.4g}",
            f"{1000 * row['tpot_p99_s']:.4g}",
            f"{row['tokens_per_s_per_gpu']:,.0f}",
            f"{row['tokens_per_s_per_user']:,.1f}",
        ]
    met = int((front["tpot_p99_s"] <= TPOT_SLO).sum())
    assert 0 < met < len(front)
    assert f"SLO tpot_p99_s <= {TPOT_SLO} s: met by {met} of {len(front)} front members" in stdout
    assert "which deployment wins where (Pareto front, most tokens/s per GPU first):" in stdout
    assert "micro batch" not in stdout and "MFU" not in stdout
    assert f"plots         {out / 'pareto.png'}  {out / 'pareto.html'}" in stdout


def test_a_max_rate_point_is_drawn_at_the_rate_it_sustains_and_its_table_shows_it(study):
    _, results = study
    serving = {"isl": 128, "osl": 16, "max_rate": True, "slo": {"tpot_p99_s": TPOT_SLO}}
    raw = {
        "model": "tiny-llama",
        "workload": {"mode": "serve", "serving": serving},
        "parallel": {},
        "system": "tiny-ring",
    }
    point = build_point(expand(raw), "test")
    fixed = at_fixed_load(point, 12.5)
    assert fixed.workload.serving.rate_per_s == 12.5 and not fixed.workload.serving.max_rate
    assert fixed.model_dump(exclude={"workload"}) == point.model_dump(exclude={"workload"})
    assert fixed.workload.serving.slo == point.workload.serving.slo
    assert at_fixed_load(fixed, 99.0) is fixed  # a point at a load of its own is drawn at it
    rows = results.front.assign(max_rate_per_s=12.5 * (1 + np.arange(len(results.front))))
    table = pareto.table(rows, rows.attrs["objectives"], "t")
    assert table.columns[-1].header == "max rate/s"
    assert list(table.columns[-1].cells) == [f"{12.5 * (1 + i):.4g}" for i in range(len(rows))]
