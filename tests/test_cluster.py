"""A study on a real multi-node Ray cluster started on this machine (two raylets on loopback, one CPU each):
`dse run --address auto` finds it through RAY_ADDRESS (and on the head, submitted with `ray job submit`),
`--address ray://` joins through the head's Ray Client server; each time one worker starts per cluster CPU when
the study does not say how many, and the trials table records which node evaluated each trial."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, patience


@pytest.mark.parametrize("how", ["dse-run", "ray-job-submit", "ray-client"])
def test_a_study_on_a_two_node_cluster_runs_trials_on_both_nodes(ray_cluster, tmp_path, how):
    study = tmp_path / "cluster.yaml"
    text = (ROOT / "studies" / "small.yaml").read_text().replace("name: small", "name: cluster")
    study.write_text(text.replace("workers: 2\n", "").replace("trials: 8", "trials: 30"))
    assert "workers" not in study.read_text()
    out = tmp_path / "out"
    run = ["run", str(study), "--address", "auto", "--out", str(out)]
    if how == "dse-run":
        command, env = [sys.executable, "-m", "dse.cli", *run], {**ray_cluster.env, "RAY_ADDRESS": ray_cluster.address}
    elif how == "ray-client":
        run[run.index("auto")] = ray_cluster.client_address
        command, env = [sys.executable, "-m", "dse.cli", *run], ray_cluster.env
    else:  # the driver runs on the head as a Ray job; the entrypoint is the installed console script
        dse = str(Path(sys.executable).parent / "dse")
        command = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", ray_cluster.jobs_address]
        command, env = [*command, "--", dse, *run], ray_cluster.env
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=patience(300))
    assert result.returncode == 0, result.stdout + result.stderr
    frame = pd.read_parquet(out / "trials.parquet")
    assert frame["evaluation"].sum() == 30
    nodes = frame["node"].dropna().value_counts()
    assert len(nodes) == ray_cluster.nodes == 2, "one worker per cluster CPU, one CPU per node: both nodes work"
    assert all(len(node) == 56 for node in nodes.index), "Ray node ids"
