"""A study's MLflow runs, written by a process of their own: `python -m dse.results.mlflow_runs ORDERS_FD REPORTS_FD`.

The driver (`tracking.Tracker`) sends orders down one pipe (connect, a finished trial, finish) and hears back on
another (the parent run once it exists, what the finish did). A process rather than a thread, because MLflow's
cost is mostly Python: importing it (1-2 s), migrating a new sqlite store (~1 s) and 15-50 ms per child run, which
in a thread took the interpreter lock from the study's own loop (the quickstart's first child run was written
after its search had ended); in a process it runs on the other core. It imports MLflow and nothing of the study's
(no Optuna, no study files): the orders carry plain data. The writer exits when the driver closes the orders
pipe, or dies: a SIGKILLed driver leaves no writer behind.

One parent run per study (its id kept in the study's user attributes, so a resume reuses it, and the study's uid
as a tag, so a driver killed before it stored the id finds it too) and child runs per trial, each with the trial's
parameters, metrics, state and reason. Any failure takes the writer offline for the rest of the run: nothing more
is tried (each attempt would wait for retries), and the finish report says what failed and what is missing.
"""

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from dse.results import browse, sqlite_store

STUDY_UID_TAG = "dse_study_uid"
REFINED_WITH_TAG = "refined_with"
"""On a child run whose point was refined: the refining cost model and options (JSON), so that a finish updates
only the runs that lack this refinement."""
_BATCH = 100
"""MLflow's limit of params + tags per log_batch call."""
REFINEMENT_TAGS = frozenset({"fidelity", REFINED_WITH_TAG, "refined_cost_model", "refine_reason", "refined_feasible"})
"""The tags of a child run that its point's refinement sets (tracking.trial_record)."""
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
"""MLflow's own defaults retry a refused connection for minutes; a study should notice an outage in seconds. And
over HTTP MLflow prints a 'View run' line per ended run, hundreds of them through the progress bar; the parent
run's address is printed once at the end instead. The user's environment wins."""


@dataclass(frozen=True)
class TrialRecord:
    """What a trial's child run holds: its tags (state, feasibility, reason, point key, node), parameters (the
    point's fields and the searched values) and metrics (objectives and timings), in MLflow's terms."""

    number: int
    state: str
    feasible: bool | None
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, float]
    start_ms: int | None
    end_ms: int | None


@dataclass(frozen=True)
class Connect:
    """The first order: where to write, for which study, and the earlier trials to write if they lack a run."""

    uri: str
    columns: browse.StudyColumns
    parent_tags: dict[str, str]
    """The study's settings, as the parent run's tags."""
    out_dir: Path
    parent_hint: str | None
    uid: str
    earlier: list[TrialRecord]


@dataclass(frozen=True)
class Finish:
    """The last order: write what is missing of `candidates`, mark the front, attach the artifacts (and the
    front's timelines, when the study asks for them: its spec and each member's params), close the parent run."""

    candidates: list[TrialRecord]
    front: set[int]
    wanted: set[int]
    """The trials that should have a child run by now."""
    artifacts: list[Path]
    completed: bool
    timelines_spec: dict[str, Any] | None = None
    """StudySpec.model_dump(mode="json") when the study writes its front's timelines."""
    front_params: dict[int, dict[str, Any]] = field(default_factory=dict)
    refined: list[TrialRecord] = field(default_factory=list)
    """Trials whose child run may have been written before their point was refined: their records as they are now
    (refined_* metrics, fidelity tags), logged onto the runs whose REFINED_WITH_TAG differs."""
    refined_front: set[int] = field(default_factory=set)
    """Trials on the Pareto front of the refined figures (tag refined_pareto)."""


@dataclass(frozen=True)
class Connected:
    experiment_id: str
    parent_id: str


@dataclass(frozen=True)
class Finished:
    experiment_id: str
    parent_id: str
    error: str | None
    missing: int
    """Child runs MLflow still lacks."""
    written: int
    write_seconds: float


def client(uri: str) -> Any:
    """An MlflowClient with the study's HTTP defaults and MLflow's INFO logging (migrations of every new sqlite
    store) silenced; a local sqlite store is switched to WAL (`sqlite_store`)."""
    from mlflow import MlflowClient

    for name in ("mlflow", "alembic", "urllib3.connectionpool"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if uri.startswith("sqlite:///"):
        sqlite_store.speed_up(Path(uri.removeprefix("sqlite:///")))
    return MlflowClient(tracking_uri=uri)


def child_runs(mlflow: Any, experiment_id: str, parent_id: str, extra_filter: str = "") -> list[Any]:
    """Every child run of the parent (all pages), narrowed by an MLflow filter clause such as " and tags.x = 'y'"."""
    runs: list[Any] = []
    token = None
    while True:
        page = mlflow.search_runs(
            [experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{parent_id}'{extra_filter}",
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def attach_timelines(mlflow: Any, children: list[Any], paths: dict[int, Path]) -> int:
    """Log each trial's trace file to its child run where the run lacks one (tag timeline=true once done); returns
    how many were attached. Trials without a child run (child_runs: pareto or none) keep only the file."""
    by_number = {int(run.data.tags["trial_number"]): run for run in children}
    attached = 0
    for number, path in paths.items():
        run = by_number.get(number)
        if run is not None and run.data.tags.get("timeline") != "true":
            mlflow.log_artifact(run.info.run_id, str(path))
            mlflow.set_tag(run.info.run_id, "timeline", "true")
            attached += 1
    return attached


class Writer:
    """The writer process's state: the client, the experiment and parent run, the child runs written."""

    def __init__(self, order: Connect) -> None:
        self.columns = order.columns
        self.parent_tags = order.parent_tags
        self.uri = order.uri
        self.out_dir = order.out_dir
        self.mlflow: Any = None
        self.experiment_id = ""
        self.parent_id = ""
        self.children: dict[int, str] = {}
        """Trial number -> child run id, for every child run written, in this run or earlier."""
        self.refined_with: dict[int, str] = {}
        """Trial number -> its child run's REFINED_WITH_TAG, where it has one."""
        self.written = 0
        self.write_seconds = 0.0
        self.error: str | None = None

    def attempt(self, step: Callable[[], None]) -> None:
        """Carry out one step unless offline; any failure takes the writer offline, with its first line kept."""
        if self.error is None:
            try:
                step()
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]

    def connect(self, order: Connect) -> None:
        """The experiment, the parent run and the child runs already written."""
        self.mlflow = client(self.uri)
        self.experiment_id = self._experiment()
        self.parent_id = self._parent(order.parent_hint, order.uid)
        self.children = self._existing_children()

    def _experiment(self) -> str:
        experiment = self.mlflow.get_experiment_by_name(self.columns.name)
        if experiment:
            return experiment.experiment_id
        # A local sqlite store keeps artifacts beside itself; a server decides where its artifacts go.
        location = None
        if self.uri.startswith("sqlite:///"):
            location = (Path(self.uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
        # The kind is for MLflow clients that read it; 3.17's UI goes by its mode switch instead (results.browse).
        tags = {"mlflow.experimentKind": "custom_model_development", "dse.study": self.columns.name}
        return self.mlflow.create_experiment(self.columns.name, artifact_location=location, tags=tags)

    def _parent(self, hint: str | None, uid: str) -> str:
        """The study's parent run: the one the study names, else the one tagged with its uid (a resume), else a new
        one; and its saved view of the runs table (re)written, which follows the study file's objectives and space
        (dse.results.browse)."""
        run = self._earlier_parent(hint, uid)
        if run is not None:
            self.mlflow.update_run(run.info.run_id, status="RUNNING")
        else:
            run = self._new_parent(uid)
        view = browse.view_tag(self.columns, run.info.run_id, run.info.start_time)
        self.mlflow.set_experiment_tag(self.experiment_id, browse.view_key(run.info.run_id), view)
        return run.info.run_id

    def _earlier_parent(self, hint: str | None, uid: str) -> Any:
        from mlflow.exceptions import MlflowException

        if hint:
            with contextlib.suppress(MlflowException):
                run = self.mlflow.get_run(hint)
                if run.info.experiment_id == self.experiment_id:
                    return run
        tagged = self.mlflow.search_runs([self.experiment_id], f"tags.`{STUDY_UID_TAG}` = '{uid}'", max_results=1)
        return tagged[0] if tagged else None

    def _new_parent(self, uid: str) -> Any:
        tags = {**self.parent_tags, STUDY_UID_TAG: uid}
        return self.mlflow.create_run(self.experiment_id, tags=tags, run_name=self.columns.name)

    def _children(self, extra_filter: str = "") -> list[Any]:
        return child_runs(self.mlflow, self.experiment_id, self.parent_id, extra_filter)

    def _existing_children(self) -> dict[int, str]:
        """Child runs already written; one left RUNNING by a crash mid-write is deleted to be written again."""
        out: dict[int, str] = {}
        for run in self._children():
            if run.info.status == "RUNNING":
                self.mlflow.delete_run(run.info.run_id)
            else:
                number = int(run.data.tags["trial_number"])
                out[number] = run.info.run_id
                if REFINED_WITH_TAG in run.data.tags:
                    self.refined_with[number] = run.data.tags[REFINED_WITH_TAG]
        return out

    def write_child(self, trial: TrialRecord) -> None:
        """The trial's child run, unless it has one (a resume sends the trials of earlier runs)."""
        if trial.number in self.children:
            return
        start = time.perf_counter()
        self.children[trial.number] = self._write(trial)
        if REFINED_WITH_TAG in trial.tags:
            self.refined_with[trial.number] = trial.tags[REFINED_WITH_TAG]
        self.write_seconds += time.perf_counter() - start
        self.written += 1

    def _write(self, trial: TrialRecord) -> str:
        from mlflow.entities import Metric, Param

        tags = {
            "mlflow.parentRunId": self.parent_id,
            "trial_number": str(trial.number),
            "state": trial.state,
            "pareto": "false",
            **trial.tags,
        }
        if trial.feasible is not None:
            tags["feasible"] = str(trial.feasible).lower()
        run_id = self.mlflow.create_run(
            self.experiment_id, start_time=trial.start_ms, tags=tags, run_name=f"trial-{trial.number}"
        ).info.run_id
        params = [Param(k, v) for k, v in trial.params.items()]
        metrics = [Metric(k, v, trial.end_ms or 0, 0) for k, v in trial.metrics.items()]
        for start in range(0, max(len(params), len(metrics), 1), _BATCH):
            self.mlflow.log_batch(
                run_id, metrics=metrics[start : start + _BATCH], params=params[start : start + _BATCH]
            )
        self.mlflow.set_terminated(run_id, "FAILED" if trial.state == "FAIL" else "FINISHED", end_time=trial.end_ms)
        return run_id

    def update_refined(self, trial: TrialRecord) -> None:
        """Log a trial's refinement (its refined_* metrics, its fidelity tags) onto its child run, unless the run
        has no such trial or already has this refinement."""
        from mlflow.entities import Metric, RunTag

        run_id = self.children.get(trial.number)
        if run_id is None or self.refined_with.get(trial.number) == trial.tags.get(REFINED_WITH_TAG):
            return
        metrics = [Metric(k, v, trial.end_ms or 0, 0) for k, v in trial.metrics.items() if k.startswith("refined_")]
        tags = [RunTag(k, v) for k, v in trial.tags.items() if k in REFINEMENT_TAGS]
        for start in range(0, max(len(metrics), len(tags), 1), _BATCH):
            self.mlflow.log_batch(run_id, metrics=metrics[start : start + _BATCH], tags=tags[start : start + _BATCH])
        self.refined_with[trial.number] = trial.tags.get(REFINED_WITH_TAG, "")

    def finish(self, order: Finish) -> None:
        for trial in order.candidates:
            self.write_child(trial)
        for trial in order.refined:
            self.update_refined(trial)
        self._mark_front(order.front)
        if order.refined_front or self.refined_with:  # a study without refinements spares the query
            self._mark_front(order.refined_front, "refined_pareto")
        if order.timelines_spec is not None:
            from dse import (
                timelines,  # only here: it loads the study's plugins, which the writer needs for nothing else
            )
            from dse.search.space import StudySpec

            spec = StudySpec.model_validate(order.timelines_spec)
            paths = timelines.write_timelines(spec, order.front_params, self.out_dir / timelines.TIMELINES_DIR)
            attach_timelines(self.mlflow, self._children(), paths)
        for path in order.artifacts:
            if path.is_dir():
                self.mlflow.log_artifacts(self.parent_id, str(path), artifact_path=path.name)
            else:
                self.mlflow.log_artifact(self.parent_id, str(path))
        self.mlflow.set_terminated(self.parent_id, "FINISHED" if order.completed else "KILLED")

    def _mark_front(self, front: set[int], tag: str = "pareto") -> None:
        """Children are written pareto=false (and without refined_pareto); flip only those whose membership changed
        (one query, few writes)."""
        marked = {int(r.data.tags["trial_number"]) for r in self._children(f" and tags.{tag} = 'true'")}
        for number in marked - front:
            self.mlflow.set_tag(self.children[number], tag, "false")
        for number in front - marked:
            if number in self.children:
                self.mlflow.set_tag(self.children[number], tag, "true")

    def finished(self, wanted: set[int]) -> Finished:
        missing = len(wanted - set(self.children))
        return Finished(self.experiment_id, self.parent_id, self.error, missing, self.written, self.write_seconds)


def serve(orders: Connection, reports: Connection) -> None:
    """Carry out orders until the driver closes the pipe (or dies); every failure is reported, never raised."""
    writer: Writer | None = None
    while True:
        try:
            order = orders.recv()
        except EOFError:
            return
        if isinstance(order, Connect):
            writer = Writer(order)
            writer.attempt(partial(_open, writer, order, reports))
        elif writer is None:
            continue
        elif isinstance(order, Finish):
            writer.attempt(partial(writer.finish, order))
            reports.send(writer.finished(order.wanted))
        else:
            writer.attempt(partial(writer.write_child, order))


def _open(writer: Writer, order: Connect, reports: Connection) -> None:
    """Connect, tell the driver the parent run (it stores the id in the study), write the earlier trials."""
    writer.connect(order)
    reports.send(Connected(writer.experiment_id, writer.parent_id))
    for trial in order.earlier:
        writer.write_child(trial)


if __name__ == "__main__":
    # The orders were pickled as dse.results.mlflow_runs' classes, which this file run as __main__ would not match.
    from dse.results.mlflow_runs import serve as serve_orders

    serve_orders(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
    # Every write is committed and reported; the interpreter's own teardown with MLflow loaded takes 0.7 s or more,
    # which the driver would wait for.
    os._exit(0)
