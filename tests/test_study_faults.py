"""Faults a cluster has, done for real: a worker process killed mid-trial, the driver SIGKILLed mid-study, an
evaluation that raises. Nothing may be lost, evaluated twice or recorded twice.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pandas as pd
import ray.cloudpickle
import yaml
from conftest import ROOT, patience, wait_until
from mlflow import MlflowClient
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from dse.results.tracking import PARENT_RUN_ATTR, logged_trials
from dse.search.executor import NODE, RayExecutor
from dse.search.space import load_study
from dse.search.storage import JOURNAL
from dse.search.study import POINT_KEY, REASON, TIMINGS, evaluations, open_study, run
from dse.spec import DesignPoint

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
optuna.logging.set_verbosity(optuna.logging.WARNING)
SMALL = ROOT / "studies" / "small.yaml"


def slow_fake(point: DesignPoint, pids: str) -> dict:
    """A fake evaluation that takes 0.3 s and leaves a note `<pid> <point key>` when it starts."""
    Path(pids, f"{os.getpid()}-{time.monotonic_ns()}").write_text(f"{os.getpid()} {point.key}")
    time.sleep(0.3)
    if point.parallel.tp == 4:
        raise ValueError("no kernel for tp=4")
    p = point.parallel
    return {
        "metrics": {"step_time_s": float(p.tp + p.pp), "peak_memory_bytes": 400.0 / (p.tp * p.pp)},
        "violations": {"fits_memory": -1.0},
        "timings": {"evaluate_s": 0.3},
    }


def test_a_worker_killed_mid_trial_is_retried_and_the_study_ends_with_exactly_the_budget(ray_address, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    spec = load_study(SMALL, trials=14, workers=2)
    study = open_study(spec, tmp_path / "out")
    executor = RayExecutor(lambda point: slow_fake(point, str(pids)), workers=2)
    killed: list[str] = []

    def kill_first_worker_mid_trial() -> None:
        wait_until(lambda: any(pids.iterdir()), "a first evaluation")
        pid, key = next(pids.iterdir()).read_text().split()
        os.kill(int(pid), signal.SIGKILL)
        killed.append(key)

    killer = threading.Thread(target=kill_first_worker_mid_trial)
    killer.start()
    try:
        run(spec, study, executor, spec.trials)
    finally:
        killer.join()
        executor.close()

    trials = study.trials
    assert len(evaluations(trials)) == 14, "no evaluation lost or added by the crash"
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    victim = [t for t in trials if t.user_attrs.get(POINT_KEY) == killed[0] and TIMINGS in t.user_attrs]
    assert len(victim) == 1 and victim[0].state in (TrialState.COMPLETE, TrialState.FAIL)
    notes = [note.read_text().split() for note in pids.iterdir()]
    assert [key for _, key in notes].count(killed[0]) == 2, "evaluated again after the kill, on a fresh process"
    assert len({pid for pid, key in notes if key == killed[0]}) == 2
    # The evaluation that raises fails its trials with the error; the study goes on around them.
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert failed and {t.user_attrs[REASON] for t in failed} == {"ValueError: no kernel for tp=4"}
    assert {t.params["parallel.tp"] for t in failed} == {4}
    assert all(t.user_attrs[NODE] == ray.get_runtime_context().get_node_id() for t in trials if NODE in t.user_attrs)
    assert sum(t.state == TrialState.COMPLETE for t in trials) >= 5


def journal_study(out: Path) -> optuna.Study:
    storage = JournalStorage(JournalFileBackend(str(out / JOURNAL)))
    return optuna.load_study(study_name="sigkill", storage=storage)


def journal_trials(out: Path) -> list[optuna.trial.FrozenTrial]:
    return journal_study(out).get_trials(deepcopy=False)


TRIALS = 150
"""The SIGKILL study's: the kill landed at its 20th to 68th finished trial in five runs (at its 17th and 21st in
two more). Its 60 trials of before had all finished by the time the poll saw the 15th once the driver and
evaluations got faster; 300 had the resume write twice the child runs this needs, and the resume waits for its
MLflow writer."""


def mlflow_writers(parent: int) -> list[int]:
    """The pids of the `python -m dse.results.mlflow_runs` children of a process."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            command = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"dse.results.mlflow_runs" in command:
            found.append(int(proc.name))
    return found


def test_a_driver_killed_with_sigkill_resumes_without_losing_or_repeating_a_trial_or_a_run(ray_address, tmp_path):
    """The quickstart's space, with enough trials (about 3 ms each with two workers) that the kill lands mid-study
    and mid-MLflow-writing: the journal is polled every 0.2 s for the 15th finished trial."""
    spec = yaml.safe_load((ROOT / "studies" / "quickstart.yaml").read_text())
    spec.update(name="sigkill", sampler="random", trials=TRIALS, workers=2)
    study_file = tmp_path / "sigkill.yaml"
    study_file.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "dse.cli", "run", str(study_file), "--address", ray_address, "--out", str(out)]

    driver = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def some_finished() -> bool:
        try:
            return (out / JOURNAL).exists() and len(evaluations(journal_trials(out))) >= 15
        except (KeyError, ValueError):  # the study or a line is still being written
            return False

    wait_until(some_finished, "15 finished trials", timeout=120)
    writers = mlflow_writers(driver.pid)
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=patience(30))
    assert len(writers) == 1, "the driver's MLflow writer process"
    wait_until(lambda: not Path(f"/proc/{writers[0]}").exists(), "the orphaned writer to exit", timeout=60)
    before = journal_trials(out)
    assert 15 <= len(evaluations(before)) < TRIALS, "killed mid-study"

    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=patience(300))
    assert resumed.returncode == 0, resumed.stderr

    trials = journal_trials(out)
    assert len(evaluations(trials)) == TRIALS
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert [t.params for t in trials[: len(before)]] == [t.params for t in before], "finished trials kept"
    evaluated = [t.user_attrs[POINT_KEY] for t in trials if TIMINGS in t.user_attrs]
    assert len(evaluated) == len(set(evaluated)), "no point evaluated twice"

    frame = pd.read_parquet(out / "trials.parquet")
    assert sorted(frame["number"]) == [t.number for t in trials]
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sigkill")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [int(r.data.tags["trial_number"]) for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert [r.info.run_id for r in parent] == [journal_study(out).user_attrs[PARENT_RUN_ATTR]]
    assert sorted(children) == sorted(logged_trials(frame)), "one child run per trial but repeats, none twice"
