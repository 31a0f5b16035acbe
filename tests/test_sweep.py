"""Sweeps (`sweep: true`): every grid point a row, equal to its point-by-point evaluation, the front marked as
pareto.non_dominated marks it, decode errors as rows, a stopped sweep resumed, Ray and the CLI end to end."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from helpers import run_cli

from dse.errors import SpecError
from dse.results import pareto
from dse.results.sweep_results import write_tables
from dse.search import sweep, sweep_grid
from dse.search.decoding import decode
from dse.search.executor import PluginEvaluation
from dse.search.space import load_study
from dse.search.sweep_grid import SweepGrid
from dse.search.sweep_parts import PartStore

STUDY = """\
name: tiny-sweep
objectives: {step_time: minimize, peak_memory: minimize}
constraints: [fits_memory]
sampler: grid
sweep: true
cost_model_options: {exact: true}
base:
  model: tiny-llama
  workload: {mode: train, seq_len: 512, global_batch: 16}
  parallel: {zero: 1}
  system: tiny-ring
space:
  parallel.tp: {choices: [1, 2, 4, 8]}
  parallel.pp: {choices: [1, 2, 4]}
  workload.micro_batch: {choices: [1, 2]}
  system.network.0.npus: {choices: [1, 4]}
  system.network.0.bandwidth_GBps: {choices: [50, 200]}
  system.network.1.npus: {choices: [2, 1048576]}
  system.accelerator.hbm_GiB: {choices: [0.55, 80], feasibility_only: true}
derived:
  parallel.dp: world / (parallel.tp * parallel.pp)
"""
"""384 points: 24 structures x 16 systems of 2, 8 and 2^20 NPUs (each structure decoded per world). dp = world /
(tp x pp) is fractional for some (pruned by decode) and too large for the batch at 2^20 (pruned by the feasibility
rules); 4 x 2^20 NPUs is over the limit of 2^20, so those systems fail to decode (rows with the reason); the two HBM
sizes put some points over it and some under."""


@pytest.fixture
def study(tmp_path: Path) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(STUDY)
    return path


def _frame(spec, out: Path, pool) -> pd.DataFrame:
    sweep.run(spec, PartStore(out), pool)
    results = write_tables(spec, out)
    assert results is not None
    return results.frame


def test_rows_equal_point_by_point_evaluation_and_the_front_is_non_dominated(study, tmp_path):
    spec = load_study(study)
    grid = SweepGrid(spec)
    frame = _frame(spec, tmp_path / "out", sweep.InlinePool(spec))
    assert sorted(frame["number"]) == list(range(grid.size)) == list(range(384))
    states = frame["state"].value_counts()
    assert states["COMPLETE"] > 0 and states["PRUNED"] > 0 and "FAIL" not in states
    evaluate = PluginEvaluation(spec.generator, spec.cost_model, spec.cost_model_options)
    for _, row in frame.iterrows():
        params = grid.params_of(int(row["number"]))
        assert {name: row[name] for name in grid.names} == params
        try:
            point = decode(spec, params)
        except SpecError as exc:  # as a study's trial is pruned with it
            point = str(exc)
        if isinstance(point, str):
            assert (row["state"], row["reason"]) == ("PRUNED", point)
            continue
        assert row["state"] == "COMPLETE" and row["point_key"] == point.key
        result = evaluate(point)
        for name, value in result["metrics"].items():
            if isinstance(value, bool):
                assert row[name] == value, name
            else:
                assert math.isclose(row[name], value, rel_tol=1e-9), (name, row[name], value)
        assert row["feasible"] == all(v <= 0 for v in result["violations"].values())

    feasible = frame[(frame["state"] == "COMPLETE") & (frame["feasible"] == True)].drop_duplicates("point_key")  # noqa: E712
    mask = pareto.non_dominated(feasible[["step_time_s", "peak_memory_bytes"]].to_numpy())
    assert set(feasible[mask]["number"]) == set(frame.loc[frame["pareto"], "number"])
    assert 0 < frame["pareto"].sum() < len(feasible)
    over = frame[(frame["state"] == "COMPLETE") & (frame["feasible"] == False)]  # noqa: E712
    assert len(over) and not over["pareto"].any()


def test_a_system_that_fails_to_decode_is_rows_with_the_reason(study, tmp_path):
    spec = load_study(study)
    frame = _frame(spec, tmp_path / "out", sweep.InlinePool(spec))
    huge = frame[(frame["system.network.0.npus"] == 4) & (frame["system.network.1.npus"] == 1048576)]
    assert len(huge) == 96 and (huge["state"] == "PRUNED").all()
    assert huge["reason"].str.contains("field 'system': network.*.npus = 4 x 1048576", regex=False).all()
    assert huge["point_key"].isna().all() and not huge["evaluation"].any()


def test_non_dominated_equals_every_pair_compared():
    costs = np.random.default_rng(3).integers(0, 12, size=(600, 3)).astype(float)  # many ties and equal rows
    pairs = np.array(
        [not np.any(np.all(costs <= row, axis=1) & np.any(costs < row, axis=1)) for row in costs], dtype=bool
    )
    assert (pareto.non_dominated(costs) == pairs).all() and 1 < pairs.sum() < len(costs)
    assert not pareto.non_dominated(np.empty((0, 2))).any()


def test_a_stopped_sweep_keeps_valid_parts_and_a_rerun_resumes(study, tmp_path, monkeypatch):
    spec = load_study(study)
    out = tmp_path / "out"
    store = PartStore(out)
    monkeypatch.setattr(sweep, "FLUSH_S", 0.0)  # a part per task: the stop below leaves several on disk
    monkeypatch.setattr(sweep_grid, "TASK_POINTS", 16)  # a task per structure (16 systems)
    told: list[int] = []
    first = sweep.run(spec, store, sweep.InlinePool(spec), told.append, stop=lambda: len(told) >= 5)
    assert not first.complete and first.priced == sum(told) == store.rows() == 5 * 16 and len(store.paths()) == 5
    partial = pq.read_table(store.paths()[0])  # each part is a whole Parquet file
    assert partial.num_rows > 0 and "state" in partial.column_names
    assert write_tables(spec, out) is not None and len(pd.read_parquet(out / "trials.parquet")) == first.priced

    second = sweep.run(spec, store, sweep.InlinePool(spec), told.append, stop=lambda: len(told) >= 20)
    assert not second.complete and second.before == 80 and second.priced == 15 * 16  # the first 5 skipped

    # Resumed under the default cut (structures 0-15 in one task, 16-23 in the other): the first task's points are
    # all on disk, so only the second is priced, whole (structures 16-19 again), and each number is one row.
    monkeypatch.setattr(sweep_grid, "TASK_POINTS", 256)
    third = sweep.run(spec, store, sweep.InlinePool(spec))
    assert third.complete and third.before == 320 and third.priced == 8 * 16
    frame = write_tables(spec, out).frame
    assert sorted(frame["number"]) == list(range(384))


def test_ray_workers_give_the_rows_of_one_process(study, tmp_path, ray_address):
    spec = load_study(study, workers=2)
    grid = SweepGrid(spec)
    pool = sweep.RayPool(spec, grid, 2, ray_address)
    try:
        on_ray = _frame(spec, tmp_path / "ray", pool)
    finally:
        pool.close()
    inline = _frame(spec, tmp_path / "inline", sweep.InlinePool(spec))
    assert on_ray["node"].dropna().nunique() == 1 and inline["node"].isna().all()
    columns = [c for c in inline.columns if c != "node"]
    pd.testing.assert_frame_equal(on_ray[columns], inline[columns])


def test_dse_run_writes_the_table_report_plots_and_one_mlflow_run(study, tmp_path, ray_address):
    out = tmp_path / "out"
    code, stdout, stderr = run_cli("run", str(study), "--out", str(out), "--address", ray_address, "--workers", "2")
    assert code == 0, stderr
    assert "sweep of 384 points (24 structures x 16 systems, 2 workers)" in stdout
    assert "Pareto front of tiny-sweep" in stdout
    for name in ("trials.parquet", "pareto.csv", "pareto.png", "pareto.html", "sweep.json"):
        assert (out / name).is_file(), name
    frame = pd.read_parquet(out / "trials.parquet")
    assert len(frame) == 384
    assert frame.attrs["objectives"] == {"step_time_s": "minimize", "peak_memory_bytes": "minimize"}
    best = list((out / "best").glob("trial-*.yaml"))
    assert len(best) == frame["pareto"].sum() > 0
    code, stdout, _ = run_cli("evaluate", str(best[0]), "--json")
    assert code == 0

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny-sweep")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].data.tags["sweep"] == "true"
    assert runs[0].data.metrics["points"] == 384 and runs[0].data.metrics["pareto_size"] == frame["pareto"].sum()
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"trials.parquet", "pareto.png", "pareto.html", "pareto.csv", "best"} <= artifacts

    code, stdout, _ = run_cli("report", str(out))
    assert code == 0 and "best feasible point per objective" in stdout
    code, stdout, stderr = run_cli("run", str(study), "--out", str(out), "--inline")  # finished: nothing to price
    assert code == 0 and "this run priced 0 points" in stdout, stderr
    assert len(client.search_runs([experiment.experiment_id])) == 1


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (
            ("{choices: [50, 200]}", "{low: 50, high: 200}"),
            ["field 'space.system.network.0.bandwidth_GBps'", "choices", "50"],
        ),
        (("sweep: true", "sweep: true\ntrials: 10"), ["field 'trials'", "384 points", "remove trials"]),
        (("sampler: grid", "sampler: nsga2"), ["field 'sweep'", "set sampler: grid"]),
        (
            ("derived:", "derived:\n  system.accelerator.hbm_bandwidth_GBps: parallel.tp * 1000"),
            ["field 'derived.system.accelerator.hbm_bandwidth_GBps'", "system field"],
        ),
    ],
    ids=["range", "trials", "sampler", "derived-system"],
)
def test_bad_sweep_is_one_line_naming_the_file_and_field(tmp_path, edit, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(STUDY.replace(*edit))
    code, stdout, stderr = run_cli("run", str(path), "--out", str(tmp_path / "out"))
    assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1, stderr
    for fragment in [str(path), *fragments]:
        assert fragment in stderr, (fragment, stderr)
