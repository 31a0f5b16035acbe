"""MLflow as a team runs it: a real `mlflow server` over HTTP, stopped mid-study (an outage) and started again,
then `dse sync` uploading exactly the runs it missed; and the child_runs choice for large studies.

The study runs as a user runs it, a subprocess; `dse sync` runs in this process (helpers.run_cli), which spares the
CLI's start (2-4 s) twice: what it uploads is the test's point, and its writer is a process of its own either way.
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import yaml
from conftest import ROOT, patience, wait_until
from helpers import run_cli
from mlflow import MlflowClient

from dse.results.tracking import logged_trials
from dse.search.storage import JOURNAL

TRIALS = 160
"""The outage study's: one worker runs them in about half a second (2.7-4 ms a trial here), and the server stops
once a quarter of them are told, as the journal shows, which leaves 120 (0.3-0.5 s) for after the stop. Waiting for
child runs on the server instead raced the study: the background writer can lag the trials by seconds, and the
study had finished before the outage in some runs. The writer lags enough that it has written few child runs, if
any, when the server stops, so `dse sync` uploads nearly every trial's (0.1-0.2 s each over HTTP): 400 trials made
that sync alone take over a minute."""


def study_file(tmp_path: Path, name: str, **fields) -> Path:
    """The quickstart's space, random sampler."""
    spec = yaml.safe_load((ROOT / "studies" / "quickstart.yaml").read_text())
    spec.update({"name": name, "sampler": "random", "workers": 2, **fields})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def dse(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dse.cli", *args], cwd=ROOT, capture_output=True, text=True, **kwargs)


def runs(uri: str, experiment: str) -> tuple[list, list]:
    """(parent runs, child runs) of an experiment."""
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return [], []
    everything = client.search_runs([found.experiment_id], max_results=5000)
    children = [r for r in everything if "mlflow.parentRunId" in r.data.tags]
    return [r for r in everything if "mlflow.parentRunId" not in r.data.tags], children


def test_an_mlflow_outage_mid_study_loses_nothing_and_sync_uploads_exactly_the_missing_runs(
    mlflow_server, ray_address, tmp_path
):
    out = tmp_path / "out"
    uri = mlflow_server.uri
    stopped_at: list[pd.Timestamp] = []

    def stop_server_mid_study() -> None:
        def told() -> int:  # completed trials in the study's journal
            journal = out / JOURNAL
            return journal.read_text().count('"state":1,') if journal.exists() else 0

        wait_until(lambda: told() >= TRIALS // 4, "a quarter of the trials", timeout=120, poll=0.02)
        stopped_at.append(pd.Timestamp.now(tz="UTC"))  # the outage starts with the signal, not when shutdown ends
        mlflow_server.stop()

    stopper = threading.Thread(target=stop_server_mid_study)
    stopper.start()
    try:
        # One worker, so that the trials after the stop take a while (see TRIALS).
        path = study_file(tmp_path, "outage", trials=TRIALS, workers=1)
        args = ["run", str(path), "--out", str(out)]
        result = dse(*args, "--address", ray_address, "--tracking-uri", uri, timeout=patience(300))
    finally:
        stopper.join()
        if mlflow_server.process is None:
            mlflow_server.start()

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"warning: MLflow at {uri} failed" in result.stderr and f"dse sync {out}" in result.stderr
    frame = pd.read_parquet(out / "trials.parquet")
    assert frame["evaluation"].sum() == TRIALS and set(frame["state"]) <= {"COMPLETE", "PRUNED"}
    assert (frame["datetime_complete"].dt.tz_localize("UTC") > stopped_at[0]).any(), "the study went on"

    _, before = runs(uri, "outage")
    written = {int(r.data.tags["trial_number"]) for r in before if r.info.status != "RUNNING"}
    logged = logged_trials(frame)  # every trial but a repeat of an evaluated point
    assert len(written) < len(logged)

    code, stdout, stderr = run_cli("sync", str(out))
    assert code == 0, stderr
    missing = len(logged - written)
    assert f"uploaded {missing} child runs" in stdout

    parents, children = runs(uri, "outage")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(int(r.data.tags["trial_number"]) for r in children) == sorted(logged), "each run once"
    pareto = {int(r.data.tags["trial_number"]) for r in children if r.data.tags["pareto"] == "true"}
    assert pareto == set(pd.read_csv(out / "pareto.csv")["number"])
    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(parents[0].info.run_id)}
    assert {"study.yaml", "trials.parquet", "pareto.csv", "pareto.png", "pareto.html", "best"} <= artifacts

    code, stdout, _ = run_cli("sync", str(out))
    assert code == 0 and "uploaded 0 child runs" in stdout
    assert len(runs(uri, "outage")[1]) == len(logged)


def test_child_runs_pareto_writes_only_the_front_and_none_writes_no_child(mlflow_server, tmp_path):
    """Each study runs --inline (40 quickstart trials take well under a second), which spares two Ray actors' start
    per study: child runs are the MLflow writer's, whatever evaluates the trials."""
    for mode in ("pareto", "none"):
        out = tmp_path / mode
        path = study_file(tmp_path, f"children-{mode}", trials=40, tracking={"child_runs": mode})
        started = time.monotonic()
        result = dse("run", str(path), "--inline", "--out", str(out), "--tracking-uri", mlflow_server.uri)
        assert result.returncode == 0, result.stderr
        assert time.monotonic() - started < patience(120)
        frame = pd.read_parquet(out / "trials.parquet")
        assert frame["evaluation"].sum() == 40 and len(frame) == frame["number"].max() + 1, "every trial"
        parents, children = runs(mlflow_server.uri, f"children-{mode}")
        assert len(parents) == 1
        numbers = sorted(int(r.data.tags["trial_number"]) for r in children)
        if mode == "pareto":
            front = sorted(pd.read_csv(out / "pareto.csv")["number"])
            assert numbers == front and front
            # one line leads to the trials and one to the parent run, instead of MLflow's 'View run' line per child
            experiment, parent = parents[0].info.experiment_id, parents[0].info.run_id
            view = f"{mlflow_server.uri}/#/experiments/{experiment}/runs?workflowType=machine_learning&"
            page = f"{mlflow_server.uri}/#/experiments/{experiment}/runs/{parent}?workflowType=machine_learning"
            assert f"browse        {view}viewStateShareKey=dse-{parent}\n" in result.stdout
            assert f"study run     {page}" in result.stdout and "View run" not in result.stdout
            assert {r.data.tags["pareto"] for r in children} == {"true"}
        else:
            assert numbers == []
