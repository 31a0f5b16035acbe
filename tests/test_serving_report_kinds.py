"""A study of both deployment kinds as `dse report` and the frontier tell it: labels naming the kind and both pools,
the winning kind per SLO with its margin over the other kind, and the frontier coloured by kind."""

from pathlib import Path

import pandas as pd
import pytest
from helpers import run_cli
from test_serving_results import swept, traces

from dse.results import pareto, report
from dse.results.serving_plots import KIND_COLOURS

TIGHT, LOOSE = 0.0005, 0.01
STUDY = f"""\
name: serving-kinds
objectives: {{tokens_per_s_per_user: maximize, tokens_per_s_per_gpu: maximize}}
constraints: [fits_memory]
sampler: grid
sweep: true
base:
  model: tiny-llama
  workload:
    mode: serve
    serving: {{isl: 64, osl: 16, concurrency: 64, decode: {{dp: 1}}}}
  system: tiny-ring
space:
  workload.serving.slo.ttft_p99_s: {{choices: [{TIGHT}, {LOOSE}]}}
  workload.serving.kind: {{choices: [aggregated, disaggregated]}}
  parallel.tp: {{choices: [1, 2]}}
  workload.serving.decode.dp: {{choices: [2, 4]}}
derived:
  parallel.dp: (world - (workload.serving.kind == 'disaggregated') * workload.serving.decode.dp) / parallel.tp
"""
"""Sixteen points on 8 NPUs, each of four deployments under two TTFT bounds. A disaggregated request waits for its
prefill, its KV hand-off and a decode iteration before its first token, so only aggregated points make the tight
TTFT; under the loose one the decode pool, never stalled by prompts, gives each user the most tokens/s. The
aggregated points' searched decode.dp is ignored, as they ignore it."""


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pd.DataFrame, str]:
    """The study swept in this process and `dse report`'s output on it (which writes the frontier too)."""
    _, out, results = swept(tmp_path_factory.mktemp("kinds"), STUDY)
    code, stdout, stderr = run_cli("report", str(out))
    assert code == 0, stderr
    return out, results.frame, stdout


def test_labels_name_the_kind_and_both_pools_and_ignore_an_aggregated_points_decode_pool():
    frame = pd.DataFrame(
        {
            "workload.serving.kind": ["aggregated", "disaggregated", "disaggregated"],
            "parallel.tp": [4, 2, 1],
            "parallel.pp": [1, 1, 2],
            "parallel.ep": [1, 1, 8],
            "parallel.dp": [2, 2, 8],
            "workload.serving.decode.tp": [8, 4, 1],
            "workload.serving.decode.ep": [1, 1, 16],
            "workload.serving.decode.dp": [3, 1, 16],
        }
    )
    assert pareto.deployment(frame, counts=True).tolist() == [
        "agg tp4 x2",
        "disagg P: tp2 x2 | D: tp4 x1",
        "disagg P: tp1 pp2 ep8 x8 | D: tp1 ep16 x16",
    ]
    assert pareto.deployment(frame).tolist() == [
        "agg tp4",
        "disagg P: tp2 | D: tp4",
        "disagg P: tp1 pp2 ep8 | D: tp1 ep16",
    ]
    shown = pareto.without_ignored(frame)
    assert shown.loc[0, "workload.serving.decode.tp":].isna().all()
    assert shown.loc[1:].equals(frame.loc[1:].astype(shown.dtypes))
    # A study that did not search the kind: a disaggregated point is told by its decode pool's capacity.
    results = pd.DataFrame({"parallel.tp": [2, 2], "decode_capacity_per_s": [None, 12.5]})
    assert pareto.deployment(results).tolist() == ["agg tp2", "disagg P: tp2 | D: tp1"]


def label(row: pd.Series) -> str:
    """A row's deployment with counts, spelled from its columns (the other path to `pareto.deployment`'s)."""
    prefill = f"tp{row['parallel.tp']:.0f} x{row['parallel.dp']:.0f}"
    if row["workload.serving.kind"] == "aggregated":
        return f"agg {prefill}"
    return f"disagg P: {prefill} | D: tp1 x{row['workload.serving.decode.dp']:.0f}"


def best(rows: pd.DataFrame) -> pd.Series:
    return rows.sort_values("tokens_per_s_per_user", ascending=False, kind="stable").iloc[0]


def test_report_names_the_winning_kind_per_slo_and_its_margin_over_the_other_kind(study):
    _, frame, stdout = study
    front = pareto.front(frame)
    lines = [line for line in stdout.splitlines() if line.startswith("SLO ")]
    assert len(lines) == 2
    for bound, line in zip((TIGHT, LOOSE), lines, strict=True):
        rows = frame[frame["workload.serving.slo.ttft_p99_s"] == bound]
        held = rows[rows["ttft_p99_s"] <= bound]
        agg, disagg = (held[held["workload.serving.kind"] == kind] for kind in ("aggregated", "disaggregated"))
        members = front[front["workload.serving.slo.ttft_p99_s"] == bound]
        met = int((members["ttft_p99_s"] <= bound).sum())
        head = f"SLO ttft_p99_s <= {bound} s: met by {met} of {len(members)} front members; "
        if bound == TIGHT:  # a prompt's hand-off keeps every disaggregated point over the tight TTFT
            assert disagg.empty and len(agg) == 4
            win = best(agg)
            assert line == (
                f"{head}aggregated wins: {label(win)} (trial {win['number']}) at "
                f"{win['tokens_per_s_per_user']:.4g} tokens_per_s_per_user; no disaggregated point meets it"
            )
        else:
            assert len(held) == 8
            win, runner = best(disagg), best(agg)
            margin = win["tokens_per_s_per_user"] / runner["tokens_per_s_per_user"] - 1
            assert 0.01 < margin < 0.05  # 2649 against 2590 tokens/s per user
            assert line == (
                f"{head}disaggregated wins: {label(win)} (trial {win['number']}) at "
                f"{win['tokens_per_s_per_user']:.4g} tokens_per_s_per_user, {100 * margin:.3g} % above the best "
                f"aggregated: {label(runner)} (trial {runner['number']}) at {runner['tokens_per_s_per_user']:.4g}"
            )
    best_user = best(frame)
    assert f"tokens_per_s_per_user (maximize)   {best_user['tokens_per_s_per_user']:.4g}" in stdout
    assert label(best_user) in next(line for line in stdout.splitlines() if "tokens_per_s_per_user (max" in line)


def test_the_frontier_colours_by_kind_and_marks_each_pool_shape(study):
    out, frame, _ = study
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    drawn = {t["name"]: t for t in traces(out / "pareto.html")}
    shapes = {  # name: kind, prefill (or aggregated) tp, marker
        "agg tp1": ("aggregated", 1, "circle"),
        "agg tp2": ("aggregated", 2, "square"),
        "disagg P: tp1 | D: tp1": ("disaggregated", 1, "circle"),
        "disagg P: tp2 | D: tp1": ("disaggregated", 2, "square"),
    }
    assert set(drawn) == {*shapes, "Pareto front"}
    for name, (kind, tp, symbol) in shapes.items():
        trace = drawn[name]
        assert (trace["marker"]["color"], trace["marker"]["symbol"]) == (KIND_COLOURS[kind], symbol)
        assert trace["legendgroup"] == kind
        rows = frame[(frame["workload.serving.kind"] == kind) & (frame["parallel.tp"] == tp)]
        # an aggregated point's trials at each searched (ignored) decode pool are one point, drawn once
        assert sorted(trace["y"]) == sorted(rows.drop_duplicates("point_key")["tokens_per_s_per_gpu"])
        # the aggregated points' searched decode pool, which they ignore, is not in their hover text
        assert all(("workload.serving.decode.dp" in text) == (kind == "disaggregated") for text in trace["text"])


def test_a_verdict_on_a_latency_objective_names_the_kind_below_the_other():
    """Minimised, the winner's figure is below the runner-up's: 1 ms against 1.25 ms is 20 % below. A point over
    its SLO does not compete, and of one kind the verdict names the best point only."""
    rows = pd.DataFrame(
        {
            "number": [0, 1, 2],
            "workload.serving.kind": ["aggregated", "disaggregated", "disaggregated"],
            "parallel.tp": [4, 2, 2],
            "parallel.dp": [2, 2, 1],
            "workload.serving.decode.tp": [1, 4, 2],
            "workload.serving.decode.dp": [1, 1, 3],
            "ttft_p99_s": [0.00125, 0.001, 0.0005],
            "slo_excess": [-0.5, -0.1, 0.2],
        }
    )
    assert report.kind_verdict(rows, {"ttft_p99_s": "minimize"}) == (
        "disaggregated wins: disagg P: tp2 x2 | D: tp4 x1 (trial 1) at 0.001 s ttft_p99_s, 20 % below the best "
        "aggregated: agg tp4 x2 (trial 0) at 0.00125 s"
    )
    assert report.kind_verdict(rows.iloc[:1], {"ttft_p99_s": "minimize"}) == (
        "best: agg tp4 x2 (trial 0) at 0.00125 s ttft_p99_s"
    )
    assert report.kind_verdict(rows.iloc[2:], {"ttft_p99_s": "minimize"}) == "no feasible point meets it"
