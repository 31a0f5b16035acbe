"""The `dse` command as a user runs it: a subprocess, its exit code, stdout and stderr.

Bad input must give exit code 2 and one stderr line naming the file or field, never a traceback. A `dse run` that
evaluates on Ray joins the session's (--address) instead of starting its own; one whose point is its output runs
--inline, which spares the pool's actors their start (seconds each on a loaded machine). A subprocess costs 2-4 s
of imports, so each kind of outcome (a result on stdout, a user error, a run, an interrupt) is checked once in a
real process, and the rest of the cases, whose point is what the command says rather than how a process ends, run
in this one (`cli`).
"""

import json
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, patience
from helpers import run_cli

from dse.cli.main import main

SMALL = ROOT / "studies" / "small.yaml"


def dse(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dse.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=patience(120)
    )


def cli(*args: str) -> subprocess.CompletedProcess:
    """`dse ARGS` in this process (helpers.run_cli), shaped as `dse` returns it."""
    code, out, err = run_cli(*args)
    return subprocess.CompletedProcess(["dse", *args], code, out, err)


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


POINT = """\
model: llama3-8b
workload: {mode: train, seq_len: 8192, global_batch: 16, micro_batch: 2}
parallel: {dp: 8, zero: 3, recompute: selective}
system: {base: dgx-h100, network: {1: {npus: 1}}}
"""


def test_evaluate_json_prints_one_object_and_nothing_else(tmp_path):
    result = dse("evaluate", str(write(tmp_path, "p.yaml", POINT)), "--json")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    assert result.stdout.strip().count("\n") == 0
    assert metrics["step_time_s"] > 0 and metrics["peak_memory_bytes"] > 0
    assert isinstance(metrics["fits_memory"], bool)


def test_evaluate_json_of_the_llama3_70b_example_has_the_stable_keys():
    result = cli("evaluate", str(ROOT / "studies" / "points" / "llama3-70b-dgx-h100.yaml"), "--json")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    stable = {
        "step_time_s",
        "peak_memory_bytes",
        "overlap_ratio",
        "mfu",
        "tokens_per_s_per_gpu",
        "compute_time_s",
        "comm_time_s",
        "exposed_comm_time_s",
        "fits_memory",
    }
    assert stable <= set(metrics)
    # 1024 GPUs, 1024 sequences of 8192 tokens per step.
    assert metrics["tokens_per_s_per_gpu"] == pytest.approx(1024 * 8192 / metrics["step_time_s"] / 1024)
    assert 0 < metrics["mfu"] < 1 and 0 <= metrics["overlap_ratio"] <= 1
    assert metrics["exposed_comm_time_s"] <= metrics["comm_time_s"]


def test_evaluate_prints_a_readable_table(tmp_path):
    result = cli("evaluate", str(write(tmp_path, "p.yaml", POINT)))
    assert result.returncode == 0, result.stderr
    assert "step_time_s" in result.stdout and " s" in result.stdout and "GiB" in result.stdout


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (POINT.replace("llama3-8b", "llama3-9b"), ["p.yaml", "unknown model 'llama3-9b'", "llama3-8b"]),
        (POINT.replace("dp: 8", "dp: 8, tpp: 2"), ["p.yaml", "field 'parallel.tpp'", "unknown field"]),
        (
            POINT.replace("dp: 8", "dp: 1, tp: 3").replace("npus: 1}", "npus: 1}, 0: {npus: 3}"),
            ["parallel.tp=3 does not divide model.heads=32", "use tp in {1, 2, 4, 8, 16, 32}"],
        ),
        ("model: llama3-8b\nworkload: {seq_len: 8192\n", ["p.yaml", "malformed YAML at line"]),
    ],
    ids=["unknown-model", "misspelled-field", "tp-does-not-divide-heads", "malformed-yaml"],
)
def test_evaluate_bad_input(tmp_path, text, fragments):
    assert_user_error(cli("evaluate", str(write(tmp_path, "p.yaml", text)), "--json"), *fragments)


def test_evaluate_missing_file(tmp_path):
    assert_user_error(dse("evaluate", str(tmp_path / "nope.yaml")), "nope.yaml: file not found")


STUDY = SMALL.read_text()


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (STUDY.replace("model: tiny-llama", "model: tiny-llama2"), ["s.yaml", "field 'base.model'", "unknown model"]),
        (
            STUDY.replace("system.accelerator.hbm_GiB:", "system.accelerator.hbm_GB:"),
            ["s.yaml", "field 'system.accelerator.hbm_GB'", "unknown field"],
        ),
        (STUDY.replace("world / (", "world / max("), ["s.yaml", "field 'derived.parallel.dp'", "is not allowed"]),
        (STUDY.replace("trials: 8", "trails: 8"), ["s.yaml", "field 'trails'", "unknown field"]),
        (STUDY.replace("[1, 2, 4, 8]", "[1, 2, 4, 8"), ["s.yaml", "malformed YAML at line"]),
    ],
    ids=["unknown-model", "misspelled-path", "call-in-expression", "misspelled-field", "malformed-yaml"],
)
def test_run_bad_study(tmp_path, text, fragments, request):
    """One case is refused by a real process (its exit code and its one stderr line as a user sees them); the
    others differ only in what that line says, so they run in this process."""
    run = dse if request.node.callspec.id == "unknown-model" else cli
    assert_user_error(run("run", str(write(tmp_path, "s.yaml", text)), "--out", str(tmp_path / "out")), *fragments)
    assert not (tmp_path / "out").exists()


def test_run_then_report(tmp_path):
    out = tmp_path / "small"
    result = dse("run", str(SMALL), "--trials", "6", "--inline", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "Pareto front of small" in result.stdout
    assert f"trials table  {out / 'trials.parquet'}" in result.stdout
    assert "browse        http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning&" in result.stdout
    assert f"start the UI  dse ui {out}\n" in result.stdout
    frame = pd.read_parquet(out / "trials.parquet")
    assert frame["evaluation"].sum() == 6

    report = cli("report", str(out))
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith(f"{len(frame)} trials: 6 evaluations, ")
    assert "Pareto front of small" in report.stdout
    frame = pd.read_parquet(out / "trials.parquet")
    fastest = frame[frame["feasible"] == True].sort_values("step_time_s").iloc[0]  # noqa: E712
    best_line = next(line for line in report.stdout.splitlines() if "step_time_s (minimize)" in line)
    assert f"{fastest['step_time_s']:.5g} s" in best_line and f" {int(fastest['number'])} " in best_line
    assert "which parallelism wins where" in report.stdout
    assert f"plots         {out / 'pareto.png'}  {out / 'pareto.html'}" in report.stdout
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "plotly" in (out / "pareto.html").read_text()[:100_000].lower()
    points = sorted((out / "best").glob("trial-*.yaml"))
    assert len(points) == len(pd.read_csv(out / "pareto.csv"))
    evaluated = cli("evaluate", str(points[0]), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    number = int(points[0].stem.removeprefix("trial-"))
    assert json.loads(evaluated.stdout)["step_time_s"] == pytest.approx(
        frame.set_index("number").loc[number, "step_time_s"]
    )


def test_report_without_a_study(tmp_path):
    assert_user_error(cli("report", str(tmp_path)), "trials.parquet: no trials table here", "dse run")


def test_help_describes_every_command():
    result = cli("--help")
    assert result.returncode == 0
    for command in ("run", "evaluate", "report", "sync", "compare", "nightly"):
        assert command in result.stdout
    run_help = cli("run", "--help").stdout
    for option in ("--trials", "--workers", "--address", "--out", "--storage", "--tracking-uri", "resumes"):
        assert option in run_help


def test_ctrl_c_stops_cleanly_and_says_how_to_resume(ray_address, tmp_path):
    out = tmp_path / "quickstart"  # 1,296 points: the small study's 48 are all evaluated in a second
    args = ["run", str(ROOT / "studies" / "quickstart.yaml"), "--trials", "100000", "--address", ray_address]
    args += ["--out", str(out)]
    process = subprocess.Popen(
        [sys.executable, "-m", "dse.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    journal = out / "optuna-journal.log"
    deadline = time.monotonic() + patience(60)
    while not (journal.exists() and journal.stat().st_size > 50_000) and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=patience(60))
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().endswith("run the same command again to resume the study (finished trials are kept)")
    frame = pd.read_parquet(out / "trials.parquet")
    assert 0 < len(frame) < 100000
    assert "RUNNING" not in set(frame["state"])
    assert f"{len(frame)} trials: " in stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["nightly", "{root}/studies/nightly", "--threshold", "5"], ["--threshold 5.0", "between 0 and 1"]),
        (["sync", "{tmp}"], ["study.yaml: no study was run into", "dse run --out"]),
        (["nightly", "{tmp}"], ["no study files (*.yaml) here"]),
    ],
    ids=["nightly-threshold", "sync-without-study", "nightly-empty-suite"],
)
def test_sync_and_nightly_bad_input(tmp_path, args, fragments):
    result = cli(*[arg.format(tmp=tmp_path, root=ROOT) for arg in args])
    assert_user_error(result, *fragments)


def test_summary_counts_points_over_hbm_as_infeasible_a_rerun_says_nothing_is_left_and_compare_two_studies(tmp_path):
    """The quickstart's space has points that run but exceed HBM: the summary counts them as infeasible (it said
    "0 infeasible" while a quarter did not fit), the table marks the front, and a second run of a finished study
    says that nothing was left to run. The MLflow sqlite store is written in WAL mode (see dse.results.sqlite_store).
    `dse compare` sets it beside a small study: each one's best per objective and the change, the fronts' sizes,
    and warnings that they plan different models and workloads."""
    out = tmp_path / "quick"
    args = ["run", str(ROOT / "studies" / "quickstart.yaml"), "--trials", "24", "--out", str(out)]
    first = dse(*args)
    assert first.returncode == 0, first.stderr
    frame = pd.read_parquet(out / "trials.parquet")
    complete = frame["state"] == "COMPLETE"
    fits = int((complete & (frame["feasible"] == True)).sum())  # noqa: E712
    over, pruned = int(complete.sum()) - fits, int((frame["state"] == "PRUNED").sum())
    assert over > 0, "the quickstart's first trials include points over HBM"
    repeats = int(frame["duplicate_of"].notna().sum())
    assert frame["evaluation"].sum() == frame.loc[complete, "point_key"].nunique() == 24
    assert (
        f"{len(frame)} trials: 24 evaluations, {repeats} repeats of an evaluated point, {pruned} pruned before "
        f"evaluation; {fits} feasible, {over + pruned} infeasible ({over} evaluated over fits_memory, {pruned} "
        f"pruned), 0 failed; 24 distinct points"
    ) in first.stdout
    assert frame["pareto"].sum() == len(pd.read_csv(out / "pareto.csv")) > 0
    assert f"dse timeline {out}" in first.stdout
    assert "nothing left to run" not in first.stdout
    with sqlite3.connect(out / "mlflow.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    again = cli(*args)  # nothing left to run: this process, whichever Ray it has joined
    assert again.returncode == 0, again.stderr
    assert f"study quickstart already has 24 of 24 evaluations in {out}: nothing left to run" in again.stdout
    assert len(pd.read_parquet(out / "trials.parquet")) == len(frame)

    small = tmp_path / "small"
    assert cli("run", str(SMALL), "--trials", "4", "--inline", "--out", str(small)).returncode == 0
    compared = cli("compare", str(out), str(small))
    assert compared.returncode == 0, compared.stderr
    warnings = [line for line in compared.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, compared.stdout
    assert "plan different models (llama3-8b vs tiny-llama)" in warnings[0]
    assert "run different workloads (global_batch 256 vs 16, seq_len 8192 vs 512)" in warnings[1]
    a, b = frame, pd.read_parquet(small / "trials.parquet")
    best = [f[f["feasible"] == True]["step_time_s"].min() for f in (a, b)]  # noqa: E712
    row = next(line for line in compared.stdout.splitlines() if "best step_time_s" in line)
    assert f"{best[0]:.5g} s" in row and f"{best[1]:.5g} s" in row
    assert f"{100 * (best[1] - best[0]) / best[0]:+.2f} %" in row
    assert "front size" in compared.stdout
    assert_user_error(cli("compare", str(out), str(tmp_path / "none")), "none: no such folder", "dse run --out")


def test_run_with_an_address_where_nothing_listens_fails_in_seconds(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        start = time.monotonic()
        result = dse("run", str(SMALL), "--address", f"127.0.0.1:{port}", "--out", str(tmp_path / "out"))
    assert_user_error(result, f"--address 127.0.0.1:{port}: no Ray cluster answers there", "ray start --head")
    assert time.monotonic() - start < patience(30), "the connection is refused at once; the rest is the CLI starting"


def test_run_with_out_naming_a_file(tmp_path):
    taken = write(tmp_path, "taken", "a file, not a folder")
    assert_user_error(cli("run", str(SMALL), "--out", str(taken)), f"--out {taken}: a file is in the way")
    assert taken.read_text() == "a file, not a folder"


def test_best_points_leave_out_what_their_point_ignores(tmp_path, capsys):
    """A study may set `fsdp: fsdp1` for its ZeRO-3 points while searching zero over 1 and 3; a ZeRO-1 point of
    its front is written without the setting it ignores, so `dse evaluate` takes the file and prices the trial."""
    study = write(
        tmp_path,
        "s.yaml",
        STUDY.replace("parallel: {zero: 1}", "parallel: {fsdp: fsdp1}").replace(
            "  parallel.pp: {choices: [1, 2, 4]}", "  parallel.pp: {choices: [1]}\n  parallel.zero: {choices: [1, 3]}"
        ),
    )
    out = tmp_path / "out"
    assert cli("run", str(study), "--trials", "12", "--inline", "--out", str(out)).returncode == 0
    frame = pd.read_parquet(out / "trials.parquet").set_index("number")
    points = sorted((out / "best").glob("trial-*.yaml"))
    zeros = {int(frame.loc[int(p.stem.removeprefix("trial-")), "parallel.zero"]) for p in points}
    assert 1 in zeros, "the front has a ZeRO-1 point (else the test proves nothing)"
    # One ZeRO-1 point through the command as a user runs it, and every point (9 here) through the same `dse
    # evaluate` in this process, which spares a subprocess (the CLI's start, 2-4 s) per point.
    zero_1 = next(p for p in points if frame.loc[int(p.stem.removeprefix("trial-")), "parallel.zero"] == 1)
    evaluated = dse("evaluate", str(zero_1), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    number = int(zero_1.stem.removeprefix("trial-"))
    assert json.loads(evaluated.stdout)["step_time_s"] == pytest.approx(frame.loc[number, "step_time_s"])
    for path in points:
        capsys.readouterr()
        assert main(["evaluate", str(path), "--json"]) == 0
        number = int(path.stem.removeprefix("trial-"))
        assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(frame.loc[number, "step_time_s"])
        assert ("fsdp1" in path.read_text()) == (frame.loc[number, "parallel.zero"] == 3)
