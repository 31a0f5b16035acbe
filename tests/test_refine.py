"""Multi-fidelity studies (`refine:`) and cost-model options: a study screens with one cost model and prices its
best points again with another, through the real executor, Optuna journal, Parquet and MLflow; bad options and
refine sections fail at load with one line naming the field.

The cheap refiner is the analytical model itself with `exact: true` (the whole step scheduled by the reference
rules instead of the fast path, which agrees within 1%); a refiner that disagrees on purpose and crashes on some
points is a plugin installed by the test, run inline (a Ray worker would not see the test's sys.path).
"""

import json
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
import ray
import yaml
from conftest import ROOT
from helpers import installed_plugin, run_cli
from mlflow import MlflowClient
from optuna.storages.journal import JournalFileBackend, JournalStorage

from dse import plugins
from dse.cli.main import main
from dse.results import browse
from dse.results.tracking import logged_trials
from dse.search import inline_first
from dse.search.executor import InlineExecutor
from dse.search.inline_first import TIMED_OUTCOMES, InlineFirstExecutor
from dse.search.refine import REFINED
from dse.search.study import POINT_KEY, evaluations

SMALL = yaml.safe_load((ROOT / "studies" / "small.yaml").read_text())
EXACT = {"cost_model": "analytical", "cost_model_options": {"exact": True}, "top_k": 3}
optuna.logging.set_verbosity(optuna.logging.WARNING)


def study_file(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({**SMALL, **changes}, sort_keys=False))
    return path


def stored(out: Path) -> optuna.Study:
    """The study as Optuna's own journal reader loads it: the record of truth."""
    return optuna.load_study(
        study_name="small", storage=JournalStorage(JournalFileBackend(str(out / "optuna-journal.log")))
    )


def refinement_lines(out: Path) -> int:
    return sum(f'"{REFINED}' in line for line in (out / "optuna-journal.log").read_text().splitlines())


def expected_candidates(frame: pd.DataFrame, top_k: int) -> set[str]:
    """The point keys a refine section should pick, from the table: the screened front and the top k feasible
    points per objective (both minimised in studies/small.yaml)."""
    done = frame[(frame["state"] == "COMPLETE") & (frame["feasible"] == True)].drop_duplicates(POINT_KEY)  # noqa: E712
    keys = set(frame.loc[frame["pareto"], POINT_KEY])
    for metric in ("step_time_s", "peak_memory_bytes"):
        keys |= set(done.sort_values([metric, "number"])[POINT_KEY].head(top_k))
    return keys


def non_dominated_keys(rows: pd.DataFrame, columns: list[str]) -> set[str]:
    values = rows[columns].to_numpy(dtype=float)
    keys = rows[POINT_KEY].tolist()
    return {
        keys[i]
        for i in range(len(rows))
        if not any((values[j] <= values[i]).all() and (values[j] < values[i]).any() for j in range(len(rows)))
    }


def test_a_study_refines_its_best_points_on_ray_and_keeps_both_fidelities(ray_address, tmp_path, capsys):
    out = tmp_path / "out"
    path = study_file(tmp_path, refine=EXACT)
    assert main(["run", str(path), "--out", str(out)]) == 0
    capsys.readouterr()

    frame = pd.read_parquet(out / "trials.parquet")
    node = ray.get_runtime_context().get_node_id()
    records = {k.removeprefix(REFINED): v for k, v in stored(out).user_attrs.items() if k.startswith(REFINED)}
    assert set(records) == expected_candidates(frame, top_k=3)
    assert set(frame.loc[frame["pareto"], POINT_KEY]) <= set(records), "every screened Pareto member is refined"
    for record in records.values():
        assert record["cost_model"] == "analytical" and record["options"] == {"exact": True}
        assert record["feasible"] is True and "reason" not in record
        assert record["node"] == node, "refined on the Ray workers"

    refined = frame[frame[POINT_KEY].isin(records)]
    assert (refined["fidelity"] == "refined").all() and (refined["refined.cost_model"] == "analytical").all()
    for key, record in records.items():
        rows = frame[frame[POINT_KEY] == key]
        assert (rows["refined.step_time_s"] == record["metrics"]["step_time_s"]).all()
    # The fast path the study screened with and the exact schedule agree within 1%, point by point.
    assert (refined["refined.step_time_s"] / refined["step_time_s"] - 1).abs().max() < 0.01
    assert (refined["refined.peak_memory_bytes"] / refined["peak_memory_bytes"] - 1).abs().max() < 0.01
    others = frame[~frame[POINT_KEY].isin(records)]
    assert (others["fidelity"] == "screen").all() and others["refined.step_time_s"].isna().all()
    unique = refined.drop_duplicates(POINT_KEY)
    assert set(frame.loc[frame["refined_pareto"], POINT_KEY]) == non_dominated_keys(
        unique, ["refined.step_time_s", "refined.peak_memory_bytes"]
    )

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("small").experiment_id
    parent = stored(out).user_attrs["mlflow_parent_run_id"]
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'", max_results=1000)
    assert len(runs) == len(logged_trials(frame))
    for run in runs:
        row = frame[frame["number"] == int(run.data.tags["trial_number"])].iloc[0]
        assert run.data.tags["fidelity"] == row["fidelity"]
        if row["fidelity"] == "refined":
            assert run.data.metrics["refined_step_time_s"] == pytest.approx(row["refined.step_time_s"])
            assert run.data.metrics["step_time_s"] == pytest.approx(row["step_time_s"])
            assert json.loads(run.data.tags["refined_with"]) == {"cost_model": "analytical", "options": {"exact": True}}
        else:
            assert "refined_step_time_s" not in run.data.metrics
        assert (run.data.tags.get("refined_pareto") == "true") == bool(row["refined_pareto"])

    view = json.loads(json.loads(client.get_experiment(experiment).tags[browse.view_key(parent)])["state"])
    assert {"metrics.`refined_step_time_s`", "tags.`fidelity`", "tags.`refined_pareto`"} <= set(view["selectedColumns"])

    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"refined {len(records)} points with analytical: {len(records)} priced, 0 failed" in printed
    assert "screened vs refined, per refined point" in printed and "gap (refined / screened - 1)" in printed
    assert f"Pareto front unchanged by the refinement ({frame['pareto'].sum()} members)" in printed

    lines = refinement_lines(out)
    assert lines == len(records)
    assert main(["run", str(path), "--out", str(out)]) == 0
    assert refinement_lines(out) == lines, "a resume refines nothing twice"
    assert len(client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'", max_results=1000)) == len(runs)


SKEWED = """
    from dataclasses import replace

    from pydantic import BaseModel, ConfigDict

    from dse.errors import DseError
    from simulators.analytical import AnalyticalCostModel


    class Skewed:
        \"\"\"A refiner that finds pipelines `pipeline_penalty` times slower than the analytical model does, and
        crashes on points with tensor parallelism `crash_tp`, as an external simulator may.\"\"\"

        name = "skewed"

        class Options(BaseModel):
            model_config = ConfigDict(extra="forbid", frozen=True)

            pipeline_penalty: float = 1.0
            crash_tp: int = 0

        def __init__(self, options=None):
            self.options = options or self.Options()

        def simulate(self, workload, system):
            axes = dict(workload.layout.axes)
            if axes["tp"] == self.options.crash_tp:
                raise DseError(f"skewed exited with code 134 (no kernel for tp={axes['tp']})")
            result = AnalyticalCostModel().simulate(workload, system)
            penalty = self.options.pipeline_penalty if axes["pp"] > 1 else 1.0
            return replace(result, step_time_s=result.step_time_s * penalty)
"""


@pytest.fixture
def skewed(tmp_path, monkeypatch):
    """The refiner installed as a user's plugin is: a distribution on sys.path declaring the entry point."""
    entry = "[dse.simulators]\nskewed = skewed_plugin:Skewed\n"
    with installed_plugin(tmp_path, monkeypatch, "skewed_plugin", entry, [plugins._registry], SKEWED):
        yield "skewed"


def test_a_refiner_that_disagrees_or_fails_keeps_the_screened_results_and_says_where(skewed, tmp_path, capsys):
    out = tmp_path / "out"
    options = {"pipeline_penalty": 3.0, "crash_tp": 4}
    path = study_file(
        tmp_path,
        trials=16,
        tracking={"child_runs": "none"},
        refine={"cost_model": skewed, "cost_model_options": options},
    )
    assert main(["run", str(path), "--out", str(out), "--inline"]) == 0
    capsys.readouterr()
    frame = pd.read_parquet(out / "trials.parquet")
    tried = frame[frame["refined.cost_model"] == skewed].drop_duplicates(POINT_KEY)
    failed, priced = tried[tried["parallel.tp"] == 4], tried[tried["parallel.tp"] != 4]
    assert len(failed) and len(priced)
    assert (failed["fidelity"] == "screen").all() and failed["refined.step_time_s"].isna().all()
    assert (failed["refined.reason"] == "DseError: skewed exited with code 134 (no kernel for tp=4)").all()
    assert (failed["state"] == "COMPLETE").all() and failed["step_time_s"].gt(0).all(), "the screened result stays"
    gap = priced["refined.step_time_s"] / priced["step_time_s"] - 1
    assert gap[priced["parallel.pp"] > 1].to_numpy() == pytest.approx(2.0)
    assert gap[priced["parallel.pp"] == 1].to_numpy() == pytest.approx(0.0, abs=1e-12)
    refined_front = non_dominated_keys(priced, ["refined.step_time_s", "refined.peak_memory_bytes"])
    assert set(frame.loc[frame["refined_pareto"], POINT_KEY]) == refined_front

    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"refined {len(tried)} points with skewed: {len(priced)} priced, {len(failed)} failed" in printed
    for number in failed["number"]:
        assert f"trial {number} not refined: DseError: skewed exited with code 134" in printed
    screened_front = set(frame.loc[frame["pareto"], POINT_KEY])
    left = (screened_front & set(priced[POINT_KEY])) - refined_front
    joined = refined_front - screened_front
    assert left or joined, "a 3x pipeline penalty reshapes the front of this study"
    assert (
        f"Pareto front changes with the refined figures: {len(screened_front)} -> {len(refined_front)} members, "
        f"{len(left)} left" in printed
    )
    assert f"{len(joined)} joined" in printed
    assert "+200.00 %" in printed, "the pipelined points' step-time gap"


def test_refine_every_n_trials_refines_during_the_search(tmp_path):
    """With `every: 4` the first refinements are stored once four evaluations are told, before a fifth is asked."""
    out = tmp_path / "out"
    path = study_file(tmp_path, tracking={"child_runs": "none"}, refine={**EXACT, "every": 4})
    assert main(["run", str(path), "--out", str(out), "--inline"]) == 0
    ops = [json.loads(line)["op_code"] for line in (out / "optuna-journal.log").read_text().splitlines()]
    lines = (out / "optuna-journal.log").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if f'"{REFINED}' in line)
    created = ops[:first].count(optuna.storages.journal._storage.JournalOperation.CREATE_TRIAL)
    numbers = [t.number for t in evaluations(stored(out).trials)]
    assert len(numbers) == 8 and numbers[3] < created <= numbers[4]


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"cost_model_options": {"exact": 3}}, "cost_model_options.exact"),
        ({"cost_model_options": {"exakt": True}}, "cost_model_options.exakt"),
        ({"refine": {"cost_model": "nosuch"}}, "refine.cost_model"),
        ({"refine": {"cost_model": "analytical", "top_k": -1}}, "refine.top_k"),
        ({"refine": {"cost_model": "analytical", "every": 0}}, "refine.every"),
        (
            {"refine": {"cost_model": "analytical", "cost_model_options": {"exact": "yes"}}},
            "refine.cost_model_options.exact",
        ),
        ({"refine": {"cost_model": "analytical", "top": 3}}, "refine.top"),
        ({"refine": "analytical"}, "refine"),
    ],
)
def test_bad_cost_model_options_and_refine_sections_exit_2_naming_the_field(tmp_path, changes, field):
    path = study_file(tmp_path, **changes)
    code, out, err = run_cli("run", str(path), "--out", str(tmp_path / "out"), "--inline")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {path}: field '{field}'"), err
    assert not (tmp_path / "out").exists(), "nothing ran"


TINY_POINT = {
    "model": "tiny-llama",
    "workload": {"mode": "train", "seq_len": 512, "global_batch": 16, "micro_batch": 1},
    "parallel": {"tp": 2, "pp": 2, "dp": 2},
    "system": "tiny-ring",
}


@pytest.mark.parametrize(
    "option, message",
    [
        ("exact=maybe", "error: --cost-option: field 'cost_model_options.exact': Input should be a valid boolean"),
        ("speed=2", "error: --cost-option: field 'cost_model_options.speed': unknown field"),
        ("exact", "error: --cost-option 'exact': give KEY=VALUE"),
    ],
)
def test_bad_cost_options_on_the_command_line_exit_2(tmp_path, option, message):
    point = tmp_path / "point.yaml"
    point.write_text(yaml.safe_dump(TINY_POINT))
    code, out, err = run_cli("evaluate", str(point), "--cost-option", option)
    assert code == 2 and out == "" and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_cost_options_on_the_command_line_reach_the_cost_model(skewed, tmp_path):
    point = tmp_path / "point.yaml"
    point.write_text(yaml.safe_dump(TINY_POINT))
    plain = json.loads(run_cli("evaluate", str(point), "--json")[1])
    options = ["--cost-option", "pipeline_penalty=3", "--cost-option", "crash_tp=8"]
    penalised = json.loads(run_cli("evaluate", str(point), "--json", "--cost-model", skewed, *options)[1])
    assert penalised["step_time_s"] == pytest.approx(3 * plain["step_time_s"], rel=1e-12)
    code, _, err = run_cli("evaluate", str(point), "--cost-model", skewed, "--cost-option", "crash_tp=2")
    assert code == 2 and "skewed exited with code 134 (no kernel for tp=2)" in err


def test_check_says_what_a_study_refines(tmp_path):
    code, out, _ = run_cli("check", str(study_file(tmp_path, refine={**EXACT, "every": 4})))
    assert code == 0
    assert (
        "refines the feasible Pareto members and the top 3 per objective with cost model 'analytical' with options "
        "{'exact': True}, after the search and every 4 evaluations" in out
    )


def test_a_resume_with_other_screening_options_is_refused(tmp_path):
    out = tmp_path / "out"
    assert run_cli("run", str(study_file(tmp_path, trials=2)), "--out", str(out), "--inline")[0] == 0
    path = study_file(tmp_path, trials=2, cost_model_options={"exact": True})
    code, _, err = run_cli("run", str(path), "--out", str(out), "--inline")
    assert code == 2 and err.startswith(f"error: {path}: field 'cost_model_options.exact': "), err
    assert "whose results this one's would mix with" in err and "--force" in err


class TwoSpeeds:
    """A search evaluation of a millisecond and a refinement of 20 ms, as ASTRA-sim refines an analytical search."""

    def __call__(self, point):
        return {"metrics": {"step_time_s": 1.0}, "violations": {}, "timings": {}, "speed": "screen"}

    def refine(self, point):
        time.sleep(0.02)
        return {**self(point), "speed": "refine"}


def test_slow_refinements_after_a_drained_search_move_to_the_pool(monkeypatch):
    """The search alone never paid for a pool and drained the executor; 200 refinements of 20 ms (4 s) pay for a
    0.5 s start with 2 workers once a few are timed, and the rest go to the pool."""
    from dse.search.decoding import decode
    from dse.search.space import load_study

    point = decode(
        load_study(ROOT / "studies" / "small.yaml"),
        {"parallel.tp": 2, "parallel.pp": 1, "workload.micro_batch": 1, "system.accelerator.hbm_GiB": 80},
    )
    monkeypatch.setattr(inline_first, "RAY_START_S", 0.5)
    pools: list[InlineExecutor] = []

    def start_pool():
        pools.append(InlineExecutor(TwoSpeeds()))
        return pools[-1]

    executor = InlineFirstExecutor(TwoSpeeds(), 10, 2, start_pool)
    for tag in range(10):
        executor.submit(tag, point)
        assert executor.wait().result["speed"] == "screen"
    executor.drain()
    executor.expect(200)
    for tag in range(TIMED_OUTCOMES + 3):
        executor.submit(tag, point, refine=True)
        assert executor.wait().result["speed"] == "refine"
    assert len(pools) == 1 and not pools[0]._queue, "the refinements after the timed ones ran on the pool"
    executor.close()
