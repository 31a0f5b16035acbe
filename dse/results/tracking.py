"""Results out of the Optuna storage: the output folder (trials table, Pareto table and plots, best points) and
MLflow runs.

Everything is rebuilt from the Optuna storage alone, so any of it can be lost and written again: that is what
`dse sync` does after an MLflow outage. MLflow gets one parent run per study and child runs per trial
(`tracking.child_runs`), written by a process of its own (`dse.results.mlflow_runs`), never on the trials' critical
path: a child run costs 15-50 ms on local sqlite and ~260 ms through a server. When MLflow fails the study goes on
without it and says how to catch up.

Timelines (a Pareto member's simulated step as a Perfetto trace) are not written at the end of a study unless the
study asks (`tracking.timelines: pareto`): simulating and encoding them took longer than the quickstart's whole
search. `dse timeline OUT_DIR` writes them when someone wants to look.
"""

import json
import os
import queue
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, replace
from datetime import datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import optuna
import pandas as pd
import yaml
from optuna.trial import FrozenTrial, TrialState

from dse.errors import DseError
from dse.results import browse, mlflow_runs, pareto, refinement, report, serving_plots, sqlite_store, study_plots
from dse.results.folders import BEST_DIR, PARETO_CSV, PARQUET, SPEC_FILE
from dse.results.folders import read_parquet as read_parquet  # the trials table's reader, where tests look for it
from dse.search import refine
from dse.search.decoding import decode
from dse.search.executor import NODE
from dse.search.space import StudySpec
from dse.search.study import (
    DUPLICATE_OF,
    FIELDS,
    FINISHED,
    METRICS,
    POINT_KEY,
    REASON,
    RESOLVED_FROM,
    RETRY_OF,
    TIMINGS,
    is_evaluation,
)
from dse.spec import without_ignored_settings

PARENT_RUN_ATTR = "mlflow_parent_run_id"
TRACKING_URI_ATTR = "mlflow_tracking_uri"
LOCAL_STORE_ATTR = "mlflow_local_store"
"""True when the study logs to its output folder's own store (OUT/mlflow.db): a copied or moved folder's `dse sync`
then writes to the store beside it, not to the one at the path it was run in."""
STUDY_UID_ATTR = mlflow_runs.STUDY_UID_TAG
"""A random id the study keeps and its MLflow parent run carries as a tag: the writer process creates the parent
run, and a driver killed before it could store the run's id in the study finds the run again by this tag."""


TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")
"""Tracking URI schemes MLflow logs runs to (its folder store, a path or file:, is read-only since MLflow 3)."""


def default_tracking_uri(out_dir: Path) -> str:
    return f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"


def save_spec(spec: StudySpec, out_dir: Path) -> Path:
    path = out_dir / SPEC_FILE
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False))
    return path


def saved_tracking_uri(study: optuna.Study, out_dir: Path, given: str | None) -> str:
    """The tracking URI of a study run before: the one given, else the one the study ran with, else its local
    store."""
    if given:
        return checked_uri(given, "--tracking-uri")
    if study.user_attrs.get(LOCAL_STORE_ATTR):  # the folder's own store, wherever the folder has moved since
        return checked_uri(default_tracking_uri(out_dir))
    return checked_uri(study.user_attrs.get(TRACKING_URI_ATTR) or default_tracking_uri(out_dir))


def tracking_uri(given: str | None, out_dir: Path) -> str:
    """The tracking URI a run logs to: --tracking-uri, else $MLFLOW_TRACKING_URI, else OUT_DIR's local store."""
    if given:
        return checked_uri(given, "--tracking-uri")
    if from_env := os.environ.get("MLFLOW_TRACKING_URI"):
        return checked_uri(from_env, "MLFLOW_TRACKING_URI")
    return checked_uri(default_tracking_uri(out_dir))


def checked_uri(uri: str, source: str = "") -> str:
    """`uri` when MLflow can log to it; a path or a file: URI (MLflow 3 no longer writes its folder store) or an
    unknown scheme is refused, naming where it came from, rather than found by the MLflow writer later."""
    scheme = urlsplit(uri).scheme.split("+")[0].lower()
    if scheme not in TRACKING_SCHEMES:
        raise DseError(
            f"{source} {uri}: not a tracking URI MLflow can log to (a folder or an unknown scheme); give "
            "http(s)://HOST:PORT, sqlite:///PATH/mlflow.db or postgresql://..."
        )
    if scheme == "sqlite":
        sqlite_store.check(Path(uri.removeprefix("sqlite:///")), source)
    return uri


def _feasible(trial: FrozenTrial) -> bool | None:
    """Whether a completed trial meets every constraint (None for a trial that did not complete)."""
    return all(v <= 0 for v in trial.constraints.values()) if trial.state == TrialState.COMPLETE else None


SCREEN, REFINED = "screen", "refined"
"""The `fidelity` of a trial's row and child run: its figures are the screening cost model's only, or a refinement
of its point succeeded (its figures are then also in the refined.* columns, refined_* metrics)."""


def refined_columns(record: dict[str, Any] | None) -> dict[str, Any]:
    """A point's refinement as table columns: fidelity, refined.cost_model, refined.feasible, refined.reason and
    refined.<metric> for each refined metric."""
    if record is None:
        return {"fidelity": SCREEN}
    row = {
        "fidelity": REFINED if "metrics" in record else SCREEN,
        "refined.cost_model": record.get("cost_model"),
        "refined.feasible": record.get("feasible"),
        "refined.reason": record.get("reason"),
    }
    row.update({f"refined.{name}": value for name, value in record.get("metrics", {}).items()})
    return row


EVALUATION = "evaluation"
"""Trials table column: whether the trial spent an evaluation, what the study's budget counts (study.evaluations)."""


def _row(trial: FrozenTrial, retried_as: dict[int, int], refined: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One trial flattened: identity, state and reason, params (searched, derived, summary), metrics, times, and
    its point's refinement (`refined_columns`)."""
    attrs = trial.user_attrs
    reason = attrs.get(REASON)
    if trial.number in retried_as:
        reason = f"interrupted: the driver stopped; retried as trial {retried_as[trial.number]}"
    row: dict[str, Any] = {
        "number": trial.number,
        "state": trial.state.name,
        "reason": reason,
        "feasible": _feasible(trial),
        POINT_KEY: attrs.get(POINT_KEY),
        DUPLICATE_OF: attrs.get(DUPLICATE_OF),
        RESOLVED_FROM: attrs.get(RESOLVED_FROM),
        EVALUATION: is_evaluation(trial) and (trial.number not in retried_as or METRICS in attrs),
        NODE: attrs.get(NODE),
    }
    row.update(trial.params)
    row.update({k: v for k, v in attrs.get(FIELDS, {}).items() if k not in trial.params})
    row.update(attrs.get(METRICS, {}))
    row.update(attrs.get(TIMINGS, {}))
    row["datetime_start"] = trial.datetime_start
    row["datetime_complete"] = trial.datetime_complete
    row["duration_s"] = trial.duration.total_seconds() if trial.duration else None
    row.update(refined_columns(refined.get(attrs.get(POINT_KEY, ""))))
    return row


def trials_frame(spec: StudySpec, study: optuna.Study) -> pd.DataFrame:
    """Every finished trial as a row; attrs carry the objectives ({metric: direction}) for reports."""
    trials = [t for t in study.get_trials(deepcopy=False) if t.state in FINISHED]
    retried_as = {
        t.user_attrs[RETRY_OF]: t.number for t in study.get_trials(deepcopy=False) if RETRY_OF in t.user_attrs
    }
    refined = refine.records(study)
    rows = [_row(t, retried_as, refined) for t in trials]
    frame = pd.DataFrame(rows) if rows else pd.DataFrame(columns=["number", "state", "reason", "feasible", POINT_KEY])
    frame.attrs["study"] = spec.name
    frame.attrs["objectives"] = dict(zip(spec.metrics, spec.directions, strict=True))
    frame.attrs["constraints"] = list(spec.constraints)
    return frame


def write_parquet(frame: pd.DataFrame, path: Path) -> None:
    """Write the table; object columns holding mixed types (e.g. choices [1, "auto"]) become strings first."""
    out = frame.copy()
    for column in [c for c in out.columns if pd.api.types.is_object_dtype(out[c])]:
        kinds = {type(v) for v in out[column].dropna()}
        if len(kinds) > 1 or kinds & {dict, list}:
            out[column] = out[column].astype("str")
    out.to_parquet(path, index=False)


@dataclass
class Results:
    """What a study's output folder holds after a run, and the files the parent run carries."""

    frame: pd.DataFrame
    front: pd.DataFrame
    artifacts: list[Path]


def write_results(spec: StudySpec, study: optuna.Study, out_dir: Path) -> Results:
    """Everything of write_tables and write_plots."""
    results = write_tables(spec, study, out_dir)
    write_plots(spec, results, out_dir)
    return results


def write_tables(spec: StudySpec, study: optuna.Study, out_dir: Path) -> Results:
    """Trials table, Pareto table and the front's points as point files, from the storage: a tenth of a second,
    so that `dse run` prints the front before the plots (most of a second: matplotlib and plotly) are drawn."""
    frame = trials_frame(spec, study)
    best = pareto.front(frame)
    frame["pareto"] = frame["number"].isin(best["number"])
    frame["refined_pareto"] = frame["number"].isin(refinement.front(frame)["number"])
    write_parquet(frame, out_dir / PARQUET)
    best.to_csv(out_dir / PARETO_CSV, index=False)
    members = set(best["number"])
    trials = study.get_trials(deepcopy=False)
    points = write_best_points(spec, {t.number: t.params for t in trials if t.number in members}, out_dir)
    return Results(frame, best, [out_dir / SPEC_FILE, out_dir / PARQUET, out_dir / PARETO_CSV, points])


def write_best_points(spec: StudySpec, params: dict[int, dict[str, Any]], out_dir: Path) -> Path:
    """OUT/best/trial-N.yaml for each front member's params (by trial or sweep row number), a point file that
    `dse evaluate` takes; those of an earlier front are removed."""
    points = out_dir / BEST_DIR
    points.mkdir(exist_ok=True)
    for stale in points.glob("trial-*.yaml"):
        stale.unlink()
    for number, values in params.items():
        point = decode(spec, values)
        if not isinstance(point, str):
            point = without_ignored_settings(point)
            header = f"# trial {number} of study {spec.name}: `dse evaluate` this file\n"
            body = yaml.safe_dump(point.model_dump(mode="json", exclude_none=True), sort_keys=False)
            (points / f"trial-{number}.yaml").write_text(header + body)
    return points


def write_plots(spec: StudySpec, results: Results, out_dir: Path) -> None:
    """The Pareto plots (PNG and interactive HTML), for a serving study the latency CDFs of front members, and the
    study's own report plots (its `report:` section), added to the results' artifacts."""
    title = f"study {spec.name}"
    results.artifacts.extend(report.pareto_plots(results.frame, results.front, out_dir, title))
    if pareto.is_serving(results.frame):
        results.artifacts.extend(serving_plots.latency_cdfs(spec, results.front, out_dir, title))
    if study_plots.draw(spec, results.frame, out_dir):
        results.artifacts.append(out_dir / study_plots.PLOTS_DIR)


def attach_saved_timelines(uri: str, study: optuna.Study, paths: dict[int, Path]) -> int:
    """Attach trace files to a finished study's child runs, found through the parent run id the study keeps (none:
    nothing to do); returns how many were attached."""
    parent = study.user_attrs.get(PARENT_RUN_ATTR)
    if not parent or not paths:
        return 0
    mlflow = mlflow_runs.client(uri)
    experiment = mlflow.get_run(parent).info.experiment_id
    return mlflow_runs.attach_timelines(mlflow, mlflow_runs.child_runs(mlflow, experiment, parent), paths)


def _ms(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp() * 1000)


def trial_record(trial: FrozenTrial, refined: dict[str, Any] | None = None) -> mlflow_runs.TrialRecord:
    """A finished trial as its child run shows it, with its point's refinement record if it has one: a `fidelity`
    tag (screen or refined), refined_<metric> metrics, the refining cost model and a failed refinement's reason
    (`refine_reason`) as tags."""
    attrs = trial.user_attrs
    tags = {name: str(attrs[name])[:5000] for name in (REASON, POINT_KEY, NODE) if attrs.get(name)}
    metrics = {k: float(v) for k, v in (attrs.get(METRICS, {}) | attrs.get(TIMINGS, {})).items()}
    tags["fidelity"] = refined_columns(refined)["fidelity"]
    if refined is not None:
        tags[mlflow_runs.REFINED_WITH_TAG] = json.dumps(refine.fidelity_of(refined), sort_keys=True)[:5000]
        tags["refined_cost_model"] = str(refined.get("cost_model"))
        if "reason" in refined:
            tags["refine_reason"] = str(refined["reason"])[:5000]
        if "feasible" in refined:
            tags["refined_feasible"] = str(refined["feasible"]).lower()
        metrics.update({f"refined_{k}": float(v) for k, v in refined.get("metrics", {}).items()})
    return mlflow_runs.TrialRecord(
        number=trial.number,
        state=trial.state.name,
        feasible=_feasible(trial),
        tags=tags,
        params={k: str(v) for k, v in {**attrs.get(FIELDS, {}), **trial.params}.items()},
        metrics=metrics,
        start_ms=_ms(trial.datetime_start),
        end_ms=_ms(trial.datetime_complete),
    )


def parent_tags(spec: StudySpec) -> dict[str, str]:
    """The study's settings as its parent run's tags."""
    return {
        "study": spec.name,
        "sampler": spec.sampler,
        "seed": str(spec.seed),
        "generator": spec.generator,
        "cost_model": spec.cost_model,
        "objectives": ", ".join(f"{m} {d}" for m, d in zip(spec.metrics, spec.directions, strict=True)),
        "constraints": ", ".join(spec.constraints),
        "child_runs": spec.tracking.child_runs,
    }


def logged_trials(frame: pd.DataFrame) -> set[int]:
    """The trials that get a child run with `child_runs: all`: every one but a repeat of an evaluated point, whose
    figures are its original's (the trials table keeps it, marked `duplicate_of`; MLflow would show the row twice)."""
    kept = frame[frame[DUPLICATE_OF].isna()] if DUPLICATE_OF in frame else frame
    return {int(n) for n in kept["number"]}


class Tracker:
    """MLflow writes for one study: start, record each finished trial, finish. Only `finish` waits for MLflow.

    The writing is done by a process of its own (`dse.results.mlflow_runs`); this side hands it the trials through a
    pipe fed by a thread, so that neither MLflow nor a full pipe ever holds up the trial loop. Any MLflow failure
    takes the writer offline for the rest of the run: `error` says what happened, and `dse sync` writes the rest
    later.
    """

    def __init__(self, uri: str, spec: StudySpec, out_dir: Path) -> None:
        self.uri = uri
        self.spec = spec
        self.out_dir = out_dir
        self.mode = spec.tracking.child_runs
        self.experiment_id = ""
        self.parent_id = ""
        self.written = 0
        """Child runs the writer wrote."""
        self.write_seconds = 0.0
        """Time the writer spent writing them (the benchmark's runs per second)."""
        self.error: str | None = None
        self._orders: queue.Queue[Any] = queue.Queue()
        self._sender = threading.Thread(target=self._send, name="mlflow-orders", daemon=True)
        self._process: subprocess.Popen[bytes] | None = None
        self._pipe: Connection | None = None
        self._reports: Connection | None = None
        self._writer_ended = False
        """The writer closed its end of the reports pipe before reporting a parent run."""
        self._recorded: set[int] = set()
        """Trials handed to the writer."""
        self._study: optuna.Study | None = None
        self._stored_parent: str | None = None
        """The parent run id the study holds."""

    def start(self, study: optuna.Study) -> None:
        """Start the writer process, which connects, finds or creates the experiment and the parent run, finds the
        child runs already written and (child_runs: all) writes the finished trials without one."""
        study.set_user_attr(TRACKING_URI_ATTR, self.uri)
        local = self.uri == default_tracking_uri(self.out_dir)
        if study.user_attrs.get(LOCAL_STORE_ATTR, False) != local:
            study.set_user_attr(LOCAL_STORE_ATTR, local)
        uid = study.user_attrs.get(STUDY_UID_ATTR)
        if uid is None:
            uid = uuid.uuid4().hex
            study.set_user_attr(STUDY_UID_ATTR, uid)
        self._study = study
        self._stored_parent = study.user_attrs.get(PARENT_RUN_ATTR)
        finished = study.get_trials(deepcopy=False, states=FINISHED) if self.mode == "all" else []
        earlier = [trial for trial in finished if DUPLICATE_OF not in trial.user_attrs]
        self._recorded.update(trial.number for trial in earlier)
        try:
            self._spawn()
        except OSError as exc:
            self._offline(f"cannot start the MLflow writer process ({exc})")
            return
        columns, tags = browse.StudyColumns.of(self.spec), parent_tags(self.spec)
        records = [trial_record(trial) for trial in earlier]
        connect = mlflow_runs.Connect(self.uri, columns, tags, self.out_dir, self._stored_parent, uid, records)
        self._orders.put(connect)

    def _spawn(self) -> None:
        """The writer in a new session (Ctrl-C in the terminal is the driver's to handle; the driver closes the
        pipe), with the read end of the orders pipe and the write end of the reports pipe."""
        orders_read, orders_write = os.pipe()
        reports_read, reports_write = os.pipe()
        command = [sys.executable, "-m", "dse.results.mlflow_runs", str(orders_read), str(reports_write)]
        try:
            self._process = subprocess.Popen(
                command,
                pass_fds=(orders_read, reports_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(orders_read)
            os.close(reports_write)
        self._pipe = Connection(orders_write, readable=False)
        self._reports = Connection(reports_read, writable=False)
        self._sender.start()

    def _send(self) -> None:
        assert self._pipe is not None
        while (order := self._orders.get()) is not None:
            try:
                self._pipe.send(order)
            except OSError:  # the writer died; finish() tells
                return
        self._pipe.close()

    def record(self, trial: FrozenTrial) -> None:
        self._hear()
        if self.mode == "all" and self._process is not None and DUPLICATE_OF not in trial.user_attrs:
            self._recorded.add(trial.number)
            self._orders.put(trial_record(trial))

    def _hear(self) -> None:
        """Take the writer's report that it connected, if it came, and keep the parent run's id in the study (in
        the driver's thread: the storage is the driver's): a resume and `dse sync` find the run by it."""
        if self._reports is not None and not self.parent_id and not self._writer_ended and self._reports.poll():
            try:
                self._take(self._reports.recv())
            except EOFError:  # the writer ended without a parent run (an MLflow it could not reach); finish() tells
                self._writer_ended = True
        if self.parent_id and self.parent_id != self._stored_parent and self._study is not None:
            self._study.set_user_attr(PARENT_RUN_ATTR, self.parent_id)
            self._stored_parent = self.parent_id

    def _take(self, report: Any) -> None:
        self.experiment_id, self.parent_id = report.experiment_id, report.parent_id

    def finish(self, study: optuna.Study, results: Results, completed: bool) -> int:
        """Hand over what is still missing (trials an interrupt failed; the front with child_runs: pareto), and wait
        while the writer writes it, marks the front's child runs pareto=true, attaches the artifacts and closes
        the parent run.

        Returns how many child runs MLflow still lacks (0 unless it failed; `error` then says why)."""
        front = {int(n) for n in results.front["number"]}
        wanted = {"all": logged_trials(results.frame), "pareto": front, "none": set()}[self.mode]
        if self._process is None or self._reports is None:
            return len(wanted)
        trials = study.get_trials(deepcopy=False)
        refined = refine.records(study)

        def record(n: int) -> mlflow_runs.TrialRecord:
            return trial_record(trials[n], refined.get(trials[n].user_attrs.get(POINT_KEY, "")))

        candidates = [record(n) for n in sorted(wanted - self._recorded) if trials[n].state in FINISHED]
        # Runs written before their point was refined get its figures now; the writer skips those that have them.
        updates = [record(n) for n in sorted(wanted & self._recorded) if trials[n].user_attrs.get(POINT_KEY) in refined]
        refined_front = {int(n) for n in results.frame.loc[results.frame["refined_pareto"], "number"]}
        finish = mlflow_runs.Finish(
            candidates, front, wanted, results.artifacts, completed, refined=updates, refined_front=refined_front
        )
        if self.spec.tracking.timelines == "pareto":
            params = {n: trials[n].params for n in front}
            finish = replace(finish, timelines_spec=self.spec.model_dump(mode="json"), front_params=params)
        self._orders.put(finish)
        self._orders.put(None)
        while True:
            try:
                report = self._reports.recv()
            except EOFError:
                self._process.wait()
                self._offline(f"the MLflow writer process ended with exit code {self._process.returncode}")
                return len(wanted)
            self._take(report)
            if isinstance(report, mlflow_runs.Finished):
                break
        self._process.wait()
        self._hear()
        self.written, self.write_seconds = report.written, report.write_seconds
        if report.error:
            self._offline(report.error)
        return report.missing

    def _offline(self, error: str) -> None:
        if self.error is None:
            self.error = error.splitlines()[0][:300]
