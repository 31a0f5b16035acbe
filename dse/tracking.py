"""Results out of the Optuna storage: the output folder (trials table, Pareto table and plots, best points) and
MLflow runs.

Everything is rebuilt from the Optuna storage alone, so any of it can be lost and written again: that is what
`dse sync` does after an MLflow outage. MLflow gets one parent run per study (its id kept in the study's user
attributes, so a resume reuses it) and child runs per trial (`tracking.child_runs`), written by a background
thread: a child run costs ~50 ms on local sqlite and ~260 ms through a server, too much for the trial loop. When
MLflow fails the study goes on without it and says how to catch up.
"""

import contextlib
import logging
import os
import queue
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import pandas as pd
import yaml
from optuna.trial import FrozenTrial, TrialState

from dse import browse, pareto, plots, traces
from dse.errors import DseError, SpecError
from dse.executor import NODE
from dse.space import StudySpec, decode, load_study
from dse.study import DUPLICATE_OF, FIELDS, FINISHED, METRICS, POINT_KEY, REASON, RETRY_OF, TIMINGS

if TYPE_CHECKING:
    from mlflow.entities import Run

PARQUET = "trials.parquet"
PARETO_CSV = "pareto.csv"
SPEC_FILE = "study.yaml"
"""The study file as run (with command-line overrides), so `dse sync` and `dse nightly` can reopen the study."""
BEST_DIR = "best"
PARENT_RUN_ATTR = "mlflow_parent_run_id"
TRACKING_URI_ATTR = "mlflow_tracking_uri"
_BATCH = 100
"""MLflow's limit of params + tags per log_batch call."""
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
"""MLflow's own defaults retry a refused connection for minutes; a study should notice an outage in seconds. And
over HTTP MLflow prints a 'View run' line per ended run, hundreds of them through the progress bar; the parent
run's address is printed once at the end instead. The user's environment wins."""


def default_tracking_uri(out_dir: Path) -> str:
    return f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"


def save_spec(spec: StudySpec, out_dir: Path) -> Path:
    path = out_dir / SPEC_FILE
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False))
    return path


def load_saved_spec(out_dir: Path) -> StudySpec:
    if not (out_dir / SPEC_FILE).is_file():
        raise SpecError(f"{out_dir / SPEC_FILE}: no study was run into {out_dir}; give the folder `dse run --out` used")
    return load_study(out_dir / SPEC_FILE)


def _row(trial: FrozenTrial, retried_as: dict[int, int]) -> dict[str, Any]:
    """One trial flattened: identity, state and reason, params (searched, derived, summary), metrics, times."""
    attrs = trial.user_attrs
    reason = attrs.get(REASON)
    if trial.number in retried_as:
        reason = f"interrupted: the driver stopped; retried as trial {retried_as[trial.number]}"
    row: dict[str, Any] = {
        "number": trial.number,
        "state": trial.state.name,
        "reason": reason,
        "feasible": all(v <= 0 for v in trial.constraints.values()) if trial.state == TrialState.COMPLETE else None,
        POINT_KEY: attrs.get(POINT_KEY),
        DUPLICATE_OF: attrs.get(DUPLICATE_OF),
        NODE: attrs.get(NODE),
    }
    row.update(trial.params)
    row.update({k: v for k, v in attrs.get(FIELDS, {}).items() if k not in trial.params})
    row.update(attrs.get(METRICS, {}))
    row.update(attrs.get(TIMINGS, {}))
    row["datetime_start"] = trial.datetime_start
    row["datetime_complete"] = trial.datetime_complete
    row["duration_s"] = trial.duration.total_seconds() if trial.duration else None
    return row


def trials_frame(spec: StudySpec, study: optuna.Study) -> pd.DataFrame:
    """Every finished trial as a row; attrs carry the objectives ({metric: direction}) for reports."""
    trials = [t for t in study.get_trials(deepcopy=False) if t.state in FINISHED]
    retried_as = {
        t.user_attrs[RETRY_OF]: t.number for t in study.get_trials(deepcopy=False) if RETRY_OF in t.user_attrs
    }
    rows = [_row(t, retried_as) for t in trials]
    frame = pd.DataFrame(rows) if rows else pd.DataFrame(columns=["number", "state", "reason", "feasible", POINT_KEY])
    frame.attrs["study"] = spec.name
    frame.attrs["objectives"] = dict(zip(spec.metrics, spec.directions, strict=True))
    return frame


def write_parquet(frame: pd.DataFrame, path: Path) -> None:
    """Write the table; object columns holding mixed types (e.g. choices [1, "auto"]) become strings first."""
    out = frame.copy()
    for column in [c for c in out.columns if pd.api.types.is_object_dtype(out[c])]:
        kinds = {type(v) for v in out[column].dropna()}
        if len(kinds) > 1 or kinds & {dict, list}:
            out[column] = out[column].astype("str")
    out.to_parquet(path, index=False)


def read_parquet(out_dir: Path) -> pd.DataFrame:
    path = out_dir / PARQUET
    if not path.is_file():
        raise DseError(f"{path}: no trials table here; run `dse run STUDY.yaml --out {out_dir}` first")
    return pd.read_parquet(path)


def _ms(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp() * 1000)


@dataclass
class Results:
    """What a study's output folder holds after a run, and the files the parent run carries."""

    frame: pd.DataFrame
    front: pd.DataFrame
    artifacts: list[Path]


def write_results(spec: StudySpec, study: optuna.Study, out_dir: Path) -> Results:
    """Trials table, Pareto table, Pareto plots and the front's points as point files, from the storage."""
    frame = trials_frame(spec, study)
    best = pareto.front(frame)
    write_parquet(frame, out_dir / PARQUET)
    best.to_csv(out_dir / PARETO_CSV, index=False)
    title = f"study {spec.name}"
    artifacts = [
        out_dir / SPEC_FILE,
        out_dir / PARQUET,
        out_dir / PARETO_CSV,
        plots.pareto_png(frame, best, out_dir / plots.PNG, title),
        plots.pareto_html(frame, best, out_dir / plots.HTML, title),
    ]
    points = out_dir / BEST_DIR
    points.mkdir(exist_ok=True)
    for stale in points.glob("trial-*.yaml"):
        stale.unlink()
    members = set(best["number"])
    for trial in study.get_trials(deepcopy=False):
        if trial.number in members:
            point = decode(spec, trial.params)
            if not isinstance(point, str):
                header = f"# trial {trial.number} of study {spec.name}: `dse evaluate` this file\n"
                body = yaml.safe_dump(point.model_dump(mode="json", exclude_none=True), sort_keys=False)
                (points / f"trial-{trial.number}.yaml").write_text(header + body)
    artifacts.append(points)
    return Results(frame, best, artifacts)


class Tracker:
    """MLflow writes for one study: start, record each finished trial, finish. Only `finish` waits for MLflow.

    Any MLflow failure takes the tracker offline for the rest of the run: nothing more is tried (each attempt
    would wait for retries), `error` says what happened, and `dse sync` writes the rest later.
    """

    def __init__(self, uri: str, spec: StudySpec, out_dir: Path) -> None:
        from mlflow import MlflowClient  # here: importing MLflow costs ~1 s that `dse evaluate` need not pay

        # MLflow and its database migrations log at INFO on every new sqlite file; the CLI has its own output.
        for name in ("mlflow", "alembic", "urllib3.connectionpool"):
            logging.getLogger(name).setLevel(logging.ERROR)
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.uri = uri
        self.spec = spec
        self.out_dir = out_dir
        self.mode = spec.tracking.child_runs
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment_id = ""
        self.parent_id = ""
        self.children: dict[int, str] = {}
        """Trial number -> child run id, for every child run written, in this run or earlier."""
        self.written = 0
        """Child runs this tracker wrote."""
        self.write_seconds = 0.0
        """Time the writer spent writing them (the benchmark's runs per second)."""
        self.error: str | None = None
        self._queue: queue.Queue[FrozenTrial | None] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="mlflow-writer", daemon=True)
        self._recorded: set[int] = set()
        """Trials queued for writing by this tracker."""

    def start(self, study: optuna.Study) -> None:
        """Find or create the experiment and parent run, find the child runs already written, and (child_runs:
        all) queue the finished trials without one."""
        study.set_user_attr(TRACKING_URI_ATTR, self.uri)
        try:
            self.experiment_id = self._experiment()
            self.parent_id = self._parent(study)
            self.children = self._existing_children()
        except Exception as exc:
            self._offline(exc)
            return
        self._thread.start()
        if self.mode == "all":
            self._record_missing(study, None)

    def record(self, trial: FrozenTrial) -> None:
        if self.mode == "all" and self.error is None:
            self._recorded.add(trial.number)
            self._queue.put(trial)

    def finish(self, study: optuna.Study, results: Results, completed: bool) -> int:
        """Write what is still missing (trials an interrupt failed; the front with child_runs: pareto), wait for
        the writer, mark the front's child runs pareto=true, attach the artifacts and close the parent run.

        Returns how many child runs MLflow still lacks (0 unless it failed; `error` then says why)."""
        front = set(int(n) for n in results.front["number"])
        if self.error is None:
            self._record_missing(study, None if self.mode == "all" else front if self.mode == "pareto" else set())
            self._queue.put(None)
            self._thread.join()
        if self.error is None:
            try:
                self._mark_front(front)
                self._attach_traces(study, front)
                for path in results.artifacts:
                    if path.is_dir():
                        self.client.log_artifacts(self.parent_id, str(path), artifact_path=path.name)
                    else:
                        self.client.log_artifact(self.parent_id, str(path))
                self.client.set_terminated(self.parent_id, "FINISHED" if completed else "KILLED")
            except Exception as exc:
                self._offline(exc)
        wanted = {int(n) for n in results.frame["number"]} if self.mode == "all" else front
        return 0 if self.mode == "none" else len(wanted - set(self.children))

    def _offline(self, exc: Exception) -> None:
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]

    def _record_missing(self, study: optuna.Study, only: set[int] | None) -> None:
        for trial in study.get_trials(deepcopy=False, states=FINISHED):
            if only is not None and trial.number not in only:
                continue
            if trial.number not in self.children and trial.number not in self._recorded:
                self._recorded.add(trial.number)
                self._queue.put(trial)

    def _experiment(self) -> str:
        experiment = self.client.get_experiment_by_name(self.spec.name)
        if experiment:
            return experiment.experiment_id
        # A local sqlite store keeps artifacts beside itself; a server decides where its artifacts go.
        location = None
        if self.uri.startswith("sqlite:///"):
            location = (Path(self.uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
        # The kind is for MLflow clients that read it; 3.17's UI goes by its mode switch instead (see dse.browse).
        tags = {"mlflow.experimentKind": "custom_model_development", "dse.study": self.spec.name}
        return self.client.create_experiment(self.spec.name, artifact_location=location, tags=tags)

    def _parent(self, study: optuna.Study) -> str:
        """Reuse the study's parent run (a resume) or create it, and (re)write its saved view of the runs table,
        which follows the study file's objectives and space."""
        from mlflow.exceptions import MlflowException

        run = None
        if run_id := study.user_attrs.get(PARENT_RUN_ATTR):
            with contextlib.suppress(MlflowException):
                run = self.client.get_run(run_id)
        if run is not None and run.info.experiment_id == self.experiment_id:
            self.client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = self._new_parent(study)
        view = browse.view_tag(self.spec, run.info.run_id, run.info.start_time)
        self.client.set_experiment_tag(self.experiment_id, browse.view_key(run.info.run_id), view)
        return run.info.run_id

    def _new_parent(self, study: optuna.Study) -> "Run":
        spec = self.spec
        tags = {
            "study": spec.name,
            "sampler": spec.sampler,
            "seed": str(spec.seed),
            "generator": spec.generator,
            "cost_model": spec.cost_model,
            "objectives": ", ".join(f"{m} {d}" for m, d in zip(spec.metrics, spec.directions, strict=True)),
            "constraints": ", ".join(spec.constraints),
            "child_runs": spec.tracking.child_runs,
        }
        run = self.client.create_run(self.experiment_id, tags=tags, run_name=spec.name)
        study.set_user_attr(PARENT_RUN_ATTR, run.info.run_id)
        return run

    def _children(self, extra_filter: str = "") -> list[Any]:
        runs: list[Any] = []
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'{extra_filter}",
                max_results=1000,
                page_token=token,
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def _existing_children(self) -> dict[int, str]:
        """Child runs already written; one left RUNNING by a crash mid-write is deleted to be written again."""
        out: dict[int, str] = {}
        for run in self._children():
            if run.info.status == "RUNNING":
                self.client.delete_run(run.info.run_id)
            else:
                out[int(run.data.tags["trial_number"])] = run.info.run_id
        return out

    def _mark_front(self, front: set[int]) -> None:
        """Children are written pareto=false; flip only those whose membership changed (one query, few writes)."""
        marked = {int(r.data.tags["trial_number"]) for r in self._children(" and tags.pareto = 'true'")}
        for number in marked - front:
            self.client.set_tag(self.children[number], "pareto", "false")
        for number in front - marked:
            if number in self.children:
                self.client.set_tag(self.children[number], "pareto", "true")

    def _attach_traces(self, study: optuna.Study, front: set[int]) -> None:
        """The timeline trace of each Pareto member whose child run lacks one (tag timeline=true once done)."""
        with_trace = {int(r.data.tags["trial_number"]) for r in self._children(" and tags.timeline = 'true'")}
        trials = study.get_trials(deepcopy=False)
        for number in sorted(front & set(self.children) - with_trace):
            point = decode(self.spec, trials[number].params)
            if isinstance(point, str):
                continue
            with tempfile.TemporaryDirectory() as folder:
                path = traces.write_trace(point, self.spec.generator, self.spec.cost_model, Path(folder))
                if path is None:
                    return
                self.client.log_artifact(self.children[number], str(path))
            self.client.set_tag(self.children[number], "timeline", "true")

    def _drain(self) -> None:
        while (trial := self._queue.get()) is not None:
            if self.error is None:
                try:
                    start = time.perf_counter()
                    self.children[trial.number] = self._write(trial)
                    self.write_seconds += time.perf_counter() - start
                    self.written += 1
                except Exception as exc:  # the study itself goes on; finish() reports what is missing
                    self._offline(exc)

    def _write(self, trial: FrozenTrial) -> str:
        from mlflow.entities import Metric, Param

        attrs = trial.user_attrs
        tags = {
            "mlflow.parentRunId": self.parent_id,
            "trial_number": str(trial.number),
            "state": trial.state.name,
            "pareto": "false",
        }
        if trial.state == TrialState.COMPLETE:
            tags["feasible"] = str(all(v <= 0 for v in trial.constraints.values())).lower()
        for name in (REASON, POINT_KEY, NODE):
            if attrs.get(name):
                tags[name] = str(attrs[name])[:5000]
        run_id = self.client.create_run(
            self.experiment_id, start_time=_ms(trial.datetime_start), tags=tags, run_name=f"trial-{trial.number}"
        ).info.run_id
        params = [Param(k, str(v)) for k, v in {**attrs.get(FIELDS, {}), **trial.params}.items()]
        timestamp = _ms(trial.datetime_complete) or 0
        values = attrs.get(METRICS, {}) | attrs.get(TIMINGS, {})
        metrics = [Metric(k, float(v), timestamp, 0) for k, v in values.items()]
        for start in range(0, max(len(params), len(metrics), 1), _BATCH):
            self.client.log_batch(
                run_id, metrics=metrics[start : start + _BATCH], params=params[start : start + _BATCH]
            )
        status = "FAILED" if trial.state == TrialState.FAIL else "FINISHED"
        self.client.set_terminated(run_id, status, end_time=_ms(trial.datetime_complete))
        return run_id
