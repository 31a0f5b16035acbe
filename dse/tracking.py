"""Results out of the Optuna storage: the trials table (Parquet) and MLflow runs.

Both are rebuilt from the journal alone, so either can be lost and written again. MLflow gets one parent run per
study (its id kept in the study's user attributes, so a resume reuses it) and one child run per finished trial,
written by a background thread: a child run costs ~50 ms on local sqlite, too much for the trial loop.
"""

import logging
import queue
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
from optuna.trial import FrozenTrial, TrialState

from dse.errors import DseError
from dse.space import StudySpec
from dse.study import DUPLICATE_OF, FIELDS, FINISHED, NOT_METRICS, POINT_KEY, REASON, RETRY_OF, TIMINGS

PARQUET = "trials.parquet"
PARETO_CSV = "pareto.csv"
PARENT_RUN_ATTR = "mlflow_parent_run_id"
_BATCH = 100
"""MLflow's limit of params + tags per log_batch call."""


def default_tracking_uri(out_dir: Path) -> str:
    return f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"


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
    }
    row.update(trial.params)
    row.update({k: v for k, v in attrs.get(FIELDS, {}).items() if k not in trial.params})
    row.update({k: v for k, v in attrs.items() if k not in NOT_METRICS})
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


class Tracker:
    """MLflow writes for one study: start, record each finished trial, finish. Only `finish` waits for MLflow."""

    def __init__(self, uri: str, spec: StudySpec, out_dir: Path) -> None:
        from mlflow import MlflowClient  # here: importing MLflow costs ~1 s that `dse evaluate` need not pay

        # MLflow and its database migrations log at INFO on every new sqlite file; the CLI has its own output.
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.uri = uri
        self.spec = spec
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(spec.name)
        self.experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(
                spec.name, artifact_location=(out_dir / "mlartifacts").resolve().as_uri()
            )
        )
        self.parent_id = ""
        self.children: dict[int, str] = {}
        """Trial number -> child run id, for every child run written, in this run or earlier."""
        self._queue: queue.Queue[FrozenTrial | None] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="mlflow-writer", daemon=True)
        self._error: Exception | None = None
        self._recorded: set[int] = set()
        """Trials queued for writing by this tracker."""

    def start(self, study: optuna.Study) -> None:
        """Find or create the parent run, find the child runs already written, queue the finished trials without."""
        self.parent_id = self._parent(study)
        self.children = self._existing_children()
        self._thread.start()
        self._record_missing(study)

    def record(self, trial: FrozenTrial) -> None:
        self._recorded.add(trial.number)
        self._queue.put(trial)

    def finish(
        self, study: optuna.Study, frame: pd.DataFrame, front: set[int], artifacts: list[Path], completed: bool
    ) -> None:
        """Write what is still missing (trials an interrupt failed), wait for the writer, tag every child run
        pareto=true/false, attach artifacts and close the parent run."""
        self._record_missing(study)
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise DseError(
                f"writing MLflow runs to {self.uri} failed ({type(self._error).__name__}: {self._error}); the "
                f"trials are safe in the Optuna journal, run the same command again to write the missing runs"
            )
        for number in frame["number"]:
            if number in self.children:
                self.client.set_tag(self.children[number], "pareto", str(number in front).lower())
        for path in artifacts:
            self.client.log_artifact(self.parent_id, str(path))
        self.client.set_terminated(self.parent_id, "FINISHED" if completed else "KILLED")

    def _record_missing(self, study: optuna.Study) -> None:
        for trial in study.get_trials(deepcopy=False, states=FINISHED):
            if trial.number not in self.children and trial.number not in self._recorded:
                self.record(trial)

    def _parent(self, study: optuna.Study) -> str:
        from mlflow.exceptions import MlflowException

        run_id = study.user_attrs.get(PARENT_RUN_ATTR)
        if run_id:
            try:
                run = self.client.get_run(run_id)
            except MlflowException:
                run = None
            if run is not None and run.info.experiment_id == self.experiment_id:
                self.client.update_run(run_id, status="RUNNING")
                return run_id
        spec = self.spec
        tags = {
            "study": spec.name,
            "sampler": spec.sampler,
            "seed": str(spec.seed),
            "generator": spec.generator,
            "cost_model": spec.cost_model,
            "objectives": ", ".join(f"{m} {d}" for m, d in zip(spec.metrics, spec.directions, strict=True)),
            "constraints": ", ".join(spec.constraints),
        }
        run_id = self.client.create_run(self.experiment_id, tags=tags, run_name=spec.name).info.run_id
        study.set_user_attr(PARENT_RUN_ATTR, run_id)
        return run_id

    def _existing_children(self) -> dict[int, str]:
        """Child runs already written; one left RUNNING by a crash mid-write is deleted to be written again."""
        out: dict[int, str] = {}
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'",
                max_results=1000,
                page_token=token,
            )
            for run in page:
                if run.info.status == "RUNNING":
                    self.client.delete_run(run.info.run_id)
                else:
                    out[int(run.data.tags["trial_number"])] = run.info.run_id
            token = page.token
            if not token:
                return out

    def _drain(self) -> None:
        while (trial := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self.children[trial.number] = self._write(trial)
                except Exception as exc:  # reported by finish(); the study itself goes on
                    self._error = exc

    def _write(self, trial: FrozenTrial) -> str:
        from mlflow.entities import Metric, Param

        attrs = trial.user_attrs
        tags = {
            "mlflow.parentRunId": self.parent_id,
            "trial_number": str(trial.number),
            "state": trial.state.name,
        }
        if attrs.get(REASON):
            tags["reason"] = str(attrs[REASON])[:5000]
        if attrs.get(POINT_KEY):
            tags["point_key"] = attrs[POINT_KEY]
        run_id = self.client.create_run(
            self.experiment_id, start_time=_ms(trial.datetime_start), tags=tags, run_name=f"trial-{trial.number}"
        ).info.run_id
        params = [Param(k, str(v)) for k, v in {**attrs.get(FIELDS, {}), **trial.params}.items()]
        timestamp = _ms(trial.datetime_complete) or 0
        values = {k: v for k, v in attrs.items() if k not in NOT_METRICS} | attrs.get(TIMINGS, {})
        metrics = [Metric(k, float(v), timestamp, 0) for k, v in values.items()]
        for start in range(0, max(len(params), len(metrics), 1), _BATCH):
            self.client.log_batch(
                run_id, metrics=metrics[start : start + _BATCH], params=params[start : start + _BATCH]
            )
        status = "FAILED" if trial.state == TrialState.FAIL else "FINISHED"
        self.client.set_terminated(run_id, status, end_time=_ms(trial.datetime_complete))
        return run_id
