"""The ask/tell loop, the Ray pool, and a whole study through Ray, the Optuna journal, MLflow and Parquet.

The loop's logic runs inline with a fake evaluation (fast, deterministic); the pool's failure handling runs on
the session's Ray with evaluation functions that crash or raise on purpose; the end-to-end test runs the real
plugins through `dse run` in this process.
"""

import gzip
import json
import os
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import optuna
import pandas as pd
import pytest
import ray.cloudpickle
from conftest import ROOT
from mlflow import MlflowClient
from optuna.trial import TrialState

from dse.cli.main import main
from dse.results.tracking import PARENT_RUN_ATTR, logged_trials
from dse.search import study as studies
from dse.search.executor import (
    FIRST_BATCH,
    MAX_BATCH,
    NODE,
    QUEUED_BATCHES,
    InlineExecutor,
    RayExecutor,
    evaluation_seconds,
)
from dse.search.space import load_study, optuna_distributions
from dse.search.study import DUPLICATE_OF, POINT_KEY, REASON, RETRY_OF, RandomSampler, evaluations, open_study, run
from dse.search.tuning import GC_THRESHOLDS
from dse.spec import DesignPoint

# The fakes below travel to Ray actors by value: actors cannot import this test module by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SMALL = ROOT / "studies" / "small.yaml"
optuna.logging.set_verbosity(optuna.logging.WARNING)


def fake_result(point: DesignPoint) -> dict:
    """Smaller parallel degrees are faster but need more memory; 100 GiB of HBM is the limit."""
    p = point.parallel
    memory = 400.0 / (p.tp * p.pp) + point.workload.micro_batch
    return {
        "metrics": {"step_time_s": p.tp + p.pp + 0.1 * point.workload.micro_batch, "peak_memory_bytes": memory},
        "violations": {"fits_memory": memory - 100.0},
        "timings": {"evaluate_s": 0.0},
    }


class Counting:
    """A fake evaluation that remembers which points it evaluated."""

    def __init__(self, fail_tp: int | None = None) -> None:
        self.keys: list[str] = []
        self.fail_tp = fail_tp

    def __call__(self, point: DesignPoint) -> dict:
        self.keys.append(point.key)
        if point.parallel.tp == self.fail_tp:
            raise ValueError(f"no kernel for tp={self.fail_tp}")
        return fake_result(point)


def inline_study(tmp_path: Path, trials: int, fn=None, **overrides):
    spec = load_study(SMALL, trials=trials, workers=1, **overrides)
    study = open_study(spec, tmp_path)
    run(spec, study, InlineExecutor(fn or Counting()), spec.trials)
    return spec, study


def test_infeasible_points_are_pruned_with_their_reason_and_never_evaluated(tmp_path):
    fn = Counting()
    _, study = inline_study(tmp_path, 30, fn)
    states = Counter(t.state for t in study.trials)
    assert len(evaluations(study.trials)) == len(fn.keys) == 30
    assert states[TrialState.PRUNED] > 0 and states[TrialState.COMPLETE] > 0
    for trial in study.trials:
        if trial.state == TrialState.PRUNED:
            assert "is not a whole number" in trial.user_attrs[REASON]
            assert POINT_KEY not in trial.user_attrs
    # Every point was evaluated once: duplicates and infeasible points cost nothing.
    assert (
        len(fn.keys)
        == len(set(fn.keys))
        == len({t.user_attrs[POINT_KEY] for t in study.trials if POINT_KEY in t.user_attrs})
    )


def test_a_duplicate_point_reuses_the_metrics_of_its_first_evaluation(tmp_path):
    _, study = inline_study(tmp_path, 30)
    duplicates = [t for t in study.trials if DUPLICATE_OF in t.user_attrs]
    assert duplicates, "30 random draws from 48 points repeat some"
    for trial in duplicates:
        first = study.trials[trial.user_attrs[DUPLICATE_OF]]
        assert first.user_attrs[POINT_KEY] == trial.user_attrs[POINT_KEY]
        assert first.values == trial.values
        assert first.constraints == trial.constraints


def test_objectives_and_constraints_are_told(tmp_path):
    _, study = inline_study(tmp_path, 12)
    trial = next(t for t in study.trials if t.state == TrialState.COMPLETE)
    tp, pp = trial.params["parallel.tp"], trial.params["parallel.pp"]
    micro_batch = trial.params["workload.micro_batch"]
    assert trial.values == [pytest.approx(tp + pp + 0.1 * micro_batch), pytest.approx(400 / (tp * pp) + micro_batch)]
    assert trial.constraints == {"fits_memory": pytest.approx(400 / (tp * pp) + micro_batch - 100)}
    assert trial.user_attrs["metrics"]["step_time_s"] == trial.values[0]
    assert trial.user_attrs["fields"]["parallel.dp"] == 8 // (tp * pp)


def test_same_study_and_seed_give_the_same_trials(tmp_path):
    _, first = inline_study(tmp_path / "a", 16, sampler="nsga2")
    _, second = inline_study(tmp_path / "b", 16, sampler="nsga2")
    _, other = inline_study(tmp_path / "c", 16, sampler="nsga2", seed=8)
    assert [t.params for t in first.trials] == [t.params for t in second.trials]
    assert [t.params for t in first.trials] != [t.params for t in other.trials]


def test_the_random_sampler_draws_what_optunas_does_for_a_seed():
    space = {
        "model": optuna.distributions.CategoricalDistribution(["a", "b", "c", "d", "e"]),
        "tp": optuna.distributions.CategoricalDistribution([1, 2, 4, 8]),
        "hbm": optuna.distributions.IntDistribution(40, 200, step=8),
        "bandwidth": optuna.distributions.FloatDistribution(10.0, 900.0, log=True),
    }

    def drawn(sampler: optuna.samplers.BaseSampler) -> list[dict]:
        study = optuna.create_study(sampler=sampler)
        return [study.ask(space).params for _ in range(200)]

    ours, optunas = drawn(RandomSampler(seed=3)), drawn(optuna.samplers.RandomSampler(seed=3))
    assert ours == optunas
    assert {p["model"] for p in ours} == {"a", "b", "c", "d", "e"}  # every choice drawn, none favoured much
    assert max(Counter(p["tp"] for p in ours).values()) < 200 / 4 * 1.5


@pytest.mark.parametrize("sampler", ["random", "nsga2", "tpe", "grid"])
def test_the_loops_own_suggestion_draws_what_optunas_trial_does(tmp_path, monkeypatch, sampler):
    """The loop suggests each parameter itself, without Trial._suggest's copy of the trial per parameter: the
    same study run with Optuna's Trial._suggest instead gives the same trials, an enqueued trial's fixed params
    and TPE's model-based ones (past its startup trials) among them."""
    fixed = {"parallel.tp": 2, "parallel.pp": 1, "workload.micro_batch": 2, "system.accelerator.hbm_GiB": 141}

    def trials(out: Path) -> list[tuple]:
        spec = load_study(SMALL, trials=24, workers=1, sampler=sampler)
        study = open_study(spec, out)
        study.enqueue_trial(fixed)
        run(spec, study, InlineExecutor(Counting()), spec.trials)
        return [(t.params, t.state, t.values) for t in study.trials]

    ours = trials(tmp_path / "ours")
    monkeypatch.setattr(studies._Loop, "_suggest", lambda self, trial, latest, name, d: trial._suggest(name, d))
    assert ours == trials(tmp_path / "optunas")
    assert ours[0][0] == fixed and len({tuple(params.values()) for params, _, _ in ours}) > 8


def test_a_full_decoding_cache_is_emptied_and_the_study_runs_the_same(tmp_path, monkeypatch):
    def trials(study: optuna.Study) -> list[tuple]:
        return [(t.params, t.state, t.values, t.user_attrs) for t in study.trials]

    _, kept = inline_study(tmp_path / "kept", 30)
    monkeypatch.setattr(studies, "DECODED_CACHE_SIZE", 2)
    _, emptied = inline_study(tmp_path / "emptied", 30)
    assert trials(emptied) == trials(kept)
    assert len({tuple(t.params.items()) for t in kept.trials}) > 2  # the small cache was emptied along the way


def test_an_evaluation_that_raises_fails_its_trial_with_the_error(tmp_path):
    _, study = inline_study(tmp_path, 16, Counting(fail_tp=2))
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert failed
    assert {t.params["parallel.tp"] for t in failed} == {2}
    assert {t.user_attrs[REASON] for t in failed} == {"ValueError: no kernel for tp=2"}


def test_a_resume_fails_and_retries_trials_a_crashed_driver_left_running(tmp_path):
    spec, study = inline_study(tmp_path, 4)
    orphan = study.ask(optuna_distributions(spec))  # asked, never told: the driver "crashed"
    study._storage.flush()  # as the next trial's end would have written its lines; then the driver died

    spec = load_study(SMALL, trials=6, workers=1)
    study = open_study(spec, tmp_path)
    run(spec, study, InlineExecutor(Counting()), spec.trials)
    trials = study.trials
    assert trials[orphan.number].state == TrialState.FAIL
    retry = next(t for t in trials if t.user_attrs.get(RETRY_OF) == orphan.number)
    assert retry.params == orphan.params and retry.state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert orphan.number not in {t.number for t in evaluations(trials)} and len(evaluations(trials)) == 6


def test_a_trial_left_with_only_some_of_its_params_is_failed_not_retried(tmp_path):
    """A journal cut while a trial's parameters were being written (a power loss) leaves a RUNNING trial with part
    of them: it is failed, and the grid study (whose sampler refuses a trial with drawn parameters) resumes."""
    spec, study = inline_study(tmp_path, 4, sampler="grid")
    orphan = study.ask()  # asked with one parameter only, then the driver "crashed"
    orphan.suggest_categorical("parallel.tp", [1, 2, 4, 8])
    study._storage.flush()

    spec = load_study(SMALL, trials=6, workers=1, sampler="grid")
    study = open_study(spec, tmp_path)
    run(spec, study, InlineExecutor(Counting()), spec.trials)
    trials = study.trials
    assert trials[orphan.number].state == TrialState.FAIL
    assert not any(t.user_attrs.get(RETRY_OF) == orphan.number for t in trials)
    assert len(evaluations(trials)) == 6


class InterruptOnThirdCall(Counting):
    def __call__(self, point: DesignPoint) -> dict:
        if len(self.keys) == 2:
            raise KeyboardInterrupt
        return super().__call__(point)


def test_an_interrupted_run_leaves_nothing_running_and_resumes_to_the_budget(tmp_path):
    spec = load_study(SMALL, trials=10, workers=1)
    study = open_study(spec, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run(spec, study, InlineExecutor(InterruptOnThirdCall()), spec.trials)
    assert not study.get_trials(states=(TrialState.RUNNING,))
    # The trial being evaluated and those asked ahead are failed and enqueued again, each exactly once.
    waiting = study.get_trials(states=(TrialState.WAITING,))
    failed = study.get_trials(states=(TrialState.FAIL,))
    assert 1 <= len(waiting) <= 3
    assert sorted(t.user_attrs[RETRY_OF] for t in waiting) == sorted(t.number for t in failed)

    resumed = open_study(spec, tmp_path)
    run(spec, resumed, InlineExecutor(Counting()), spec.trials)
    assert len(evaluations(resumed.trials)) == 10
    assert not resumed.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))


def crash_once(point: DesignPoint, markers: str) -> dict:
    """Kills its worker process the first time it sees a point (marker files persist across restarts)."""
    marker = Path(markers) / point.key
    if point.parallel.tp == 8 or not marker.exists():
        marker.touch()
        os._exit(1)
    if point.parallel.tp == 2:
        raise RuntimeError("cost model diverged")
    return fake_result(point)


def test_ray_pool_resubmits_a_dead_actors_point_once_and_records_errors(ray_address, tmp_path):
    spec = load_study(SMALL)
    points = {tp: spec_point(spec, tp) for tp in (1, 2, 8)}
    executor = RayExecutor(partial(crash_once, markers=str(tmp_path)), workers=2)
    try:
        executor.submit(1, points[1])  # crashes once, then succeeds on the restarted actor
        executor.submit(8, points[8])  # crashes every time
        outcomes = {o.tag: o for o in (executor.wait(), executor.wait())}
        executor.submit(2, points[2])  # crashes once, then raises
        outcomes[2] = executor.wait()
    finally:
        executor.close()
    assert outcomes[1].result == {**fake_result(points[1]), NODE: ray.get_runtime_context().get_node_id()}
    assert outcomes[1].error is None
    assert outcomes[8].result is None and outcomes[8].error.startswith("the evaluator process died twice")
    assert outcomes[2].error == "RuntimeError: cost model diverged"
    assert ray.is_initialized(), "the pool must not shut down a Ray it did not start"


def kill_on_tp8(point: DesignPoint) -> dict:
    """Kills its worker on every tp=8 point; a tp=4 point holds the worker for half a second."""
    import time

    if point.parallel.tp == 8:
        os._exit(1)
    if point.parallel.tp == 4:
        time.sleep(0.5)
    return {**fake_result(point), "timings": {"pid": os.getpid()}}


def test_a_point_that_kills_its_batch_fails_alone_and_its_batch_mate_completes(ray_address):
    spec = load_study(SMALL)
    executor = RayExecutor(kill_on_tp8, workers=1)
    try:
        executor.submit(4, spec_point(spec, 4))  # runs at once, alone
        executor.submit(8, spec_point(spec, 8))  # these two queue, and go out together when the first is done
        executor.submit(1, spec_point(spec, 1))
        outcomes = {o.tag: o for o in (executor.wait(), executor.wait(), executor.wait())}
    finally:
        executor.close()
    assert outcomes[8].error.startswith("the evaluator process died twice")
    assert outcomes[1].error is None and outcomes[1].result["metrics"] == fake_result(spec_point(spec, 1))["metrics"]
    assert outcomes[4].result["timings"]["pid"] != outcomes[1].result["timings"]["pid"], "no restart in between"


class CrashOnceThenSlow:
    """One affinity for every point; a tp=8 point kills its worker the first time, half a second in (time for a
    follow-up call to queue behind it), and runs on the restarted actor. Results carry the process that ran them."""

    def __init__(self, markers: str) -> None:
        self.markers = markers

    def affinity(self, point: DesignPoint) -> int:
        return 0

    def __call__(self, point: DesignPoint) -> dict:
        import time

        marker = Path(self.markers) / "crashed"
        if point.parallel.tp == 8 and not marker.exists():
            time.sleep(0.5)
            marker.touch()
            os._exit(1)
        return {**fake_result(point), "timings": {"pid": os.getpid()}}


def test_a_follow_up_call_lost_with_its_actor_runs_again_once(ray_address, tmp_path):
    spec = load_study(SMALL)
    executor = RayExecutor(CrashOnceThenSlow(str(tmp_path)), workers=1)
    try:
        executor.submit(8, spec_point(spec, 8))  # the actor's call, which kills it
        for tag, tp in enumerate((1, 2, 4, 1), start=10):  # a whole batch of its affinity: sent behind it
            executor.submit(tag, spec_point(spec, tp))
        assert executor._load == [2], "the batch must wait in the actor, behind the call that kills it"
        outcomes = [executor.wait() for _ in range(5)]
    finally:
        executor.close()
    assert sorted(o.tag for o in outcomes) == [8, 10, 11, 12, 13]
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert len({o.result["timings"]["pid"] for o in outcomes}) == 1, "all ran on the restarted actor"


def with_gc_thresholds(point: DesignPoint) -> dict:
    import gc

    return {**fake_result(point), "timings": {"gc": list(gc.get_threshold())}}


def test_evaluator_actors_collect_garbage_rarely(ray_address):
    executor = RayExecutor(with_gc_thresholds, workers=1)
    try:
        executor.submit(1, spec_point(load_study(SMALL), 1))
        assert executor.wait().result["timings"]["gc"] == list(GC_THRESHOLDS)
    finally:
        executor.close()


def sleep_on_tp8(point: DesignPoint, seconds: float) -> dict:
    """`seconds` on a tp=8 point, nothing on the others, and says so in its timings as PluginEvaluation says what
    it measured: the pool sizes its calls by that, so the sizes below do not depend on how busy the machine is."""
    import time

    taken = seconds if point.parallel.tp == 8 else 0.0
    time.sleep(taken)
    return {**fake_result(point), "timings": {"evaluate_s": taken}}


def test_a_call_is_timed_by_its_evaluations_own_times_when_every_one_reports_one():
    """Else (an error among the results, a result without timings, a time that is no time) by its wall time."""
    timed = {"timings": {"evaluate_s": 0.25}}
    assert evaluation_seconds([timed, timed], elapsed=9.0) == 0.5
    assert evaluation_seconds([timed, "ValueError: no kernel"], elapsed=9.0) == 9.0
    assert evaluation_seconds([timed, {"timings": {}}], elapsed=9.0) == 9.0
    assert evaluation_seconds([{"timings": {"evaluate_s": float("nan")}}], elapsed=9.0) == 9.0
    assert evaluation_seconds([], elapsed=9.0) == 9.0


def test_ray_pool_sizes_its_calls_by_the_evaluation_time_it_measures(ray_address):
    """Calls aim at CALL_S of evaluation: fast points go MAX_BATCH to a call, points slower than CALL_S one by
    one; the queue in front of the workers holds QUEUED_BATCHES calls' worth per worker."""
    spec = load_study(SMALL)
    executor = RayExecutor(partial(sleep_on_tp8, seconds=0.25), workers=1)
    try:
        assert (executor.batch, executor.capacity) == (FIRST_BATCH, 1 + QUEUED_BATCHES * FIRST_BATCH)
        executor.submit(0, spec_point(spec, 8))
        executor.wait()
        assert executor.batch == FIRST_BATCH, "an actor's first call (imports, cold caches) is not timed"
        for tag in range(1, 4):
            executor.submit(tag, spec_point(spec, 1))
            executor.wait()
        assert (executor.batch, executor.capacity) == (MAX_BATCH, 1 + QUEUED_BATCHES * MAX_BATCH)
        for tag in range(4, 8):
            executor.submit(tag, spec_point(spec, 8))
            executor.wait()
        assert (executor.batch, executor.capacity) == (1, 1 + QUEUED_BATCHES)
        executor.submit(8, spec_point(spec, 8))  # runs alone; the three behind it queue and go one per call
        for tag in range(9, 12):
            executor.submit(tag, spec_point(spec, 8))
        assert executor._load == [1] and len(executor._queued) == 3
        assert executor.wait().tag == 8
        assert executor._load == [1] and len(executor._queued) == 2, "the freed actor takes one point, not a batch"
    finally:
        executor.close()


def test_a_draining_ray_pool_shares_out_its_queue(ray_address):
    """Once the study has asked its last point, a freed worker takes its share of the queue, not a whole batch,
    so that the last calls end together."""
    spec = load_study(SMALL)
    executor = RayExecutor(partial(sleep_on_tp8, seconds=0.04), workers=2)
    try:
        for tag in range(4):  # each actor's first call (untimed), then a timed one: fast points, batches of 16
            executor.submit(tag, spec_point(spec, 1))
            if tag % 2:
                executor.wait(), executor.wait()
        assert executor.batch == MAX_BATCH
        for tag in range(4, 6):  # both actors busy for 40 ms, which leaves batches of about 5 (CALL_S / 20 ms)
            executor.submit(tag, spec_point(spec, 8))
        for tag in range(6, 12):
            executor.submit(tag, spec_point(spec, 1))
        assert len(executor._queued) == 6
        executor.drain()
        assert executor.batch == 3
        assert executor.wait().tag in (4, 5)
        assert len(executor._queued) == 3, "the freed actor took half the queue"
    finally:
        executor.close()


class ByTensorParallel:
    """An evaluation whose affinity is the point's tp; it reports the process that ran it."""

    def affinity(self, point: DesignPoint) -> int:
        return point.parallel.tp

    def __call__(self, point: DesignPoint) -> dict:
        import time

        time.sleep(0.1)
        return {**fake_result(point), "timings": {"pid": os.getpid()}}


def test_ray_pool_keeps_each_affinity_on_the_actor_that_ran_it_first(ray_address):
    spec = load_study(SMALL)
    executor = RayExecutor(ByTensorParallel(), workers=2)
    try:
        for tag in range(2):  # both actors up before the timed part
            executor.submit(-1 - tag, spec_point(spec, 4))
        executor.wait(), executor.wait()
        tags = {}
        for tag in range(executor.capacity):
            tags[tag] = 1 if tag % 2 else 2
            executor.submit(tag, spec_point(spec, tags[tag]))
        outcomes = [executor.wait() for _ in tags]
    finally:
        executor.close()
    pids: dict[int, set[int]] = {1: set(), 2: set()}
    for outcome in outcomes:
        pids[tags[outcome.tag]].add(outcome.result["timings"]["pid"])
    assert len(pids[1]) == len(pids[2]) == 1 and pids[1] != pids[2], pids


def spec_point(spec, tp: int) -> DesignPoint:
    from dse.search.decoding import decode

    point = decode(
        spec, {"parallel.tp": tp, "parallel.pp": 1, "workload.micro_batch": 1, "system.accelerator.hbm_GiB": 80}
    )
    assert isinstance(point, DesignPoint)
    return point


def child_runs(out: Path, study_name: str) -> list:
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(study_name)
    parent = optuna.load_study(study_name=study_name, storage=journal(out)).user_attrs[PARENT_RUN_ATTR]
    return client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent}'", max_results=1000)


def journal_study(out: Path) -> optuna.Study:
    return optuna.load_study(study_name="small", storage=journal(out))


def journal(out: Path):
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return JournalStorage(JournalFileBackend(str(out / "optuna-journal.log")))


def test_study_end_to_end_then_resume(ray_address, tmp_path, capsys):
    out = tmp_path / "small"
    assert main(["run", str(SMALL), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Pareto front of small" in printed and str(out / "trials.parquet") in printed

    frame = pd.read_parquet(out / "trials.parquet")
    runs = child_runs(out, "small")
    assert frame["evaluation"].sum() == 8, "the budget counts evaluations"
    assert sorted(int(r.data.tags["trial_number"]) for r in runs) == sorted(logged_trials(frame)), "none for a repeat"
    assert {r.data.tags["state"] for r in runs} == set(frame["state"])
    complete = frame[frame["state"] == "COMPLETE"]
    assert complete["step_time_s"].gt(0).all() and complete["peak_memory_bytes"].gt(0).all()
    front = {int(r.data.tags["trial_number"]) for r in runs if r.data.tags["pareto"] == "true"}
    assert front and front <= set(complete["number"])
    assert frame.loc[frame["pareto"], "number"].tolist() == sorted(front), "the table marks the front too"
    assert not any(r.data.tags.get("timeline") for r in runs), "timelines are written on demand"
    assert main(["timeline", str(out)]) == 0
    runs = child_runs(out, "small")
    assert {int(r.data.tags["trial_number"]) for r in runs if r.data.tags.get("timeline") == "true"} == front
    member = next(r for r in runs if r.data.tags["pareto"] == "true")
    name = f"trial-{member.data.tags['trial_number']}.json.gz"
    local = MlflowClient(f"sqlite:///{out / 'mlflow.db'}").download_artifacts(member.info.run_id, name)
    assert Path(local).read_bytes() == (out / "timelines" / name).read_bytes()
    with gzip.open(local, "rt") as trace:
        events = json.load(trace)["traceEvents"]
    assert any(e["ph"] == "X" and e["dur"] > 0 for e in events), "the Pareto member's simulated timeline"
    parent = journal_study(out).user_attrs[PARENT_RUN_ATTR]
    artifacts = {a.path for a in MlflowClient(f"sqlite:///{out / 'mlflow.db'}").list_artifacts(parent)}
    assert {"study.yaml", "trials.parquet", "pareto.csv", "pareto.png", "pareto.html", "best"} <= artifacts
    assert (out / "mlartifacts").is_dir()
    first_params = [t.params for t in optuna.load_study(study_name="small", storage=journal(out)).trials]

    assert main(["run", str(SMALL), "--out", str(out), "--trials", "12"]) == 0
    frame = pd.read_parquet(out / "trials.parquet")
    runs = child_runs(out, "small")
    assert frame["evaluation"].sum() == 12
    assert sorted(int(r.data.tags["trial_number"]) for r in runs) == sorted(logged_trials(frame)), "no duplicate runs"
    trials = optuna.load_study(study_name="small", storage=journal(out)).trials
    assert [t.params for t in trials[: len(first_params)]] == first_params
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    assert frame.attrs["objectives"] == {"step_time_s": "minimize", "peak_memory_bytes": "minimize"}
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    everything = client.search_runs([client.get_experiment_by_name("small").experiment_id], max_results=1000)
    assert len(everything) == len(logged_trials(frame)) + 1, "one parent run, reused by the resume"


def test_a_driver_killed_after_storing_a_result_but_before_telling_does_not_evaluate_it_again(tmp_path):
    """The journal takes a trial's metrics and its tell as separate lines, and another thread's write can put the
    first in the file alone; a SIGKILL then leaves a RUNNING trial whose evaluation is done. The resume fails and
    retries it, and the retry reuses the metrics."""
    from dse.search.decoding import decode
    from dse.search.study import METRICS

    spec = load_study(SMALL, trials=1, workers=1)
    study = open_study(spec, tmp_path)
    trial = study.ask(optuna_distributions(spec))
    point = decode(spec, trial.params)
    assert isinstance(point, DesignPoint)
    metrics = {**fake_result(point)["metrics"], "memory_excess_bytes": -1.0}
    trial.set_user_attr(POINT_KEY, point.key)
    trial.set_user_attr(METRICS, metrics)
    # The MLflow writer's thread set a study attribute, which writes the queued lines too; then the driver died.
    study._storage.flush()

    evaluation = Counting()
    resumed = open_study(spec, tmp_path)
    run(spec, resumed, InlineExecutor(evaluation), spec.trials)
    assert evaluation.keys == []
    trials = resumed.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert trials[1].user_attrs[DUPLICATE_OF] == trials[0].number
    assert trials[1].values == [metrics[m] for m in spec.metrics]
    assert trials[1].constraints == {"fits_memory": -1.0}
