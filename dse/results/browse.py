"""Where a person looks at a study in the MLflow UI: the runs table as a study is read, and the links to it.

MLflow 3.17's UI decides what an experiment opens on from its GenAI / Model training switch (the `workflowType`
URL parameter, else the browser's last choice, GenAI by default), not from the `mlflow.experimentKind` tag, so
a plain experiment link lands on an empty GenAI overview. A fresh browser also shows the runs table with no
metric columns and the trials folded under their study's parent run. So each study run (parent run) has a saved
view of the experiment's runs table (an experiment tag; the UI lists it under Views), and the links `dse run`
and `dse ui` print open that view in Model training mode. A view per study run, not per experiment, because a
shared tracking server gathers several runs of a study in one experiment (every night of `dse nightly`, each
re-run into another folder), and a link should show the trials its run evaluated.
"""

import json
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dse.search.space import StudySpec

VIEW_TAG_PREFIX = "mlflow.sharedViewState."
"""The MLflow UI's experiment-tag prefix for saved views; the rest of the key is the view's id."""
VIEW_ID_PREFIX = "dse-"
LOCAL_UI = "http://127.0.0.1:5000"
"""Where `dse ui` (and `make ui`) serve a study's local store by default."""
MODEL_TRAINING = "workflowType=machine_learning"
"""The URL parameter that puts the UI in Model training mode for the page it opens."""
MAX_PARAM_COLUMNS = 40
"""Searched and derived parameters shown as columns; more are a click away (Columns)."""
METRIC_WIDTH = 190
"""Pixels for a metric column: MLflow prints full float precision (0.0011985117712199447)."""


def view_id(parent_id: str) -> str:
    """The saved view of a study run: the `viewStateShareKey` of its links."""
    return f"{VIEW_ID_PREFIX}{parent_id}"


def view_key(parent_id: str) -> str:
    """The experiment tag that holds the view."""
    return f"{VIEW_TAG_PREFIX}{view_id(parent_id)}"


def _column(kind: str, key: str) -> str:
    """A runs-table column id as the UI spells it: metrics.`step_time_s`."""
    return f"{kind}.`{key}`"


@dataclass(frozen=True)
class StudyColumns:
    """What a study's runs table shows, as plain data (the MLflow writer process does not load study files):
    the objectives' metrics and directions, and the searched and derived parameters."""

    name: str
    metrics: list[str]
    minimize: list[bool]
    params: list[str]
    refined: bool = False
    """Whether the study refines its best points (`refine`): the table then shows their refined figures too."""

    @classmethod
    def of(cls, spec: "StudySpec") -> "StudyColumns":
        minimize = [direction == "minimize" for direction in spec.directions]
        refined = spec.refine is not None
        return cls(spec.name, list(spec.metrics), minimize, [*spec.space, *spec.derived], refined)


def trials_view(study: StudyColumns, parent_id: str) -> dict[str, Any]:
    """The runs table of a study run: its trials, best first by the first objective, with the objectives,
    feasibility, Pareto membership and state, then the searched and derived parameters, as columns.

    Ordered by a metric, the UI lists child runs flat instead of folding them under their parent run (it nests
    them only when ordered by creation time); a saved view could not unfold them, as MLflow leaves expanded rows
    out of shared views. The parent run is not a row: it is the filter (its page is linked separately)."""
    metrics = [_column("metrics", metric) for metric in study.metrics]
    tags = [_column("tags", tag) for tag in ("feasible", "pareto", "state")]
    params = [_column("params", path) for path in study.params[:MAX_PARAM_COLUMNS]]
    refined_metrics: list[str] = []
    refined_tags: list[str] = []
    if study.refined:  # a refined study: each objective's refined figure, and which points were refined
        refined_metrics = [_column("metrics", f"refined_{metric}") for metric in study.metrics]
        refined_tags = [_column("tags", tag) for tag in ("fidelity", "refined_pareto")]
    columns = [*metrics, *refined_metrics, *refined_tags, *tags, *params]
    return {
        "searchFilter": f"tags.mlflow.parentRunId = '{parent_id}'",
        "orderByKey": metrics[0],
        "orderByAsc": study.minimize[0],
        "selectedColumns": columns,
        "columnOrder": columns,
        "columnWidths": dict.fromkeys([*metrics, *refined_metrics], METRIC_WIDTH),
        "runsHiddenMode": "SHOW_ALL",  # charts plot every trial, not the first 10 rows
    }


def view_tag(study: StudyColumns, parent_id: str, started_ms: int) -> str:
    """The experiment tag's value: the UI's saved-view envelope around the view's state (a JSON string), named
    after the study and when its run started."""
    name = f"{study.name} trials, {datetime.fromtimestamp(started_ms / 1000):%Y-%m-%d %H:%M}"
    state = json.dumps(trials_view(study, parent_id))
    return json.dumps({"name": name, "createdAt": started_ms, "updatedAt": int(time.time() * 1000), "state": state})


def latest_view(tags: dict[str, str]) -> str | None:
    """The id of the most recently written dse view among an experiment's tags, if any."""
    written: dict[str, int] = {}
    for key, value in tags.items():
        if key.startswith(VIEW_TAG_PREFIX + VIEW_ID_PREFIX):
            try:
                written[key.removeprefix(VIEW_TAG_PREFIX)] = int(json.loads(value)["updatedAt"])
            except (ValueError, KeyError, TypeError):
                continue
    return max(written, key=written.__getitem__) if written else None


def experiment_url(base: str, experiment_id: str, view: str) -> str:
    """A saved view of an experiment's runs table, from the UI's base address (the tracking server's URI)."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{MODEL_TRAINING}&viewStateShareKey={view}"


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    """A run's page (a study's parent run holds the Pareto plots and tables under Artifacts)."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING}"
