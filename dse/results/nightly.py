"""Nightly sweeps: run a folder of studies, compare each study's tracked figures with the last successful night,
write a markdown regression report, log it to MLflow, and say (by the exit code) whether anything moved.

A night is a folder ROOT/<night>/ holding one output folder per study and `nightly.json` once every study has
finished. Each study's parent run carries the night as the tag `dse.night` and its tracked figures as metrics
`nightly.<figure>`, so the baseline comes from MLflow; when MLflow does not have it (a new tracking server, an
outage) it comes from the last complete night's trials tables on disk. Studies use fixed seeds, so an unchanged
cost model and catalog give identical figures, and any move beyond the threshold is a change worth a look.
"""

import argparse
import json
import logging
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import pandas as pd

from dse.errors import DseError
from dse.limits import MAX_NAME_CHARS
from dse.results import folders, pareto, report
from dse.results.folders import PARQUET, load_saved_spec, read_parquet
from dse.results.tracking import PARENT_RUN_ATTR
from dse.search.space import StudySpec, load_study
from dse.search.study import open_study

NIGHT_FILE = "nightly.json"
REPORT = "report.md"
EXPERIMENT = "dse-nightly"
"""The MLflow experiment holding one run per night with its report."""
NIGHT_TAG = "dse.night"
METRIC_PREFIX = "nightly."
LOG = logging.getLogger(__name__)
NIGHT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
"""A night names a folder under the root: one plain file name, never a path ('a/b', '..')."""


class StudyFailed(DseError):
    """A study of the night did not end well; the night ends with the study's own exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def night_name(text: str) -> str:
    """`--night`'s type: a plain folder name."""
    if not NIGHT_NAME.match(text) or len(text) > MAX_NAME_CHARS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a night's name: give a plain folder name of letters, digits, '.', '_' and '-' "
            f"(up to {MAX_NAME_CHARS} characters), e.g. 2025-01-31"
        )
    return text


class StudyRunner(Protocol):
    """Runs a study file into an output folder as `dse run STUDY --out OUT --tracking-uri URI [--workers N]` does
    and returns its exit code. The CLI hands its own to `dse nightly` (dse.cli.main.run_study), so a night's studies
    take the code path of `dse run` while this module, a layer below the CLI, does not import it."""

    def __call__(self, study: Path, out: Path, tracking_uri: str, workers: int | None) -> int: ...


def default_night() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d")


def figures(frame: pd.DataFrame) -> dict[str, float]:
    """The tracked figures of one study: the best feasible value of each objective and the front's size."""
    out = {f"best.{metric}": float(row[metric]) for metric, row in report.best_per_objective(frame).items()}
    out["front_size"] = float(len(pareto.front(frame)))
    return out


@dataclass
class StudyNight:
    study: str
    now: dict[str, float]
    baseline: dict[str, float] | None
    source: str
    """Where the baseline came from: 'MLflow run <id> (night <n>)', 'trials table of night <n>', or 'none'."""
    moved: list[str] = field(default_factory=list)


def _baseline_from_mlflow(client, spec: StudySpec, night: str) -> tuple[dict[str, float], str] | None:
    experiment = client.get_experiment_by_name(spec.name)
    if experiment is None:
        return None
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{NIGHT_TAG}` != '{night}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=20,
    )
    for run in runs:
        values = {k[len(METRIC_PREFIX) :]: v for k, v in run.data.metrics.items() if k.startswith(METRIC_PREFIX)}
        if values:
            return values, f"MLflow run {run.info.run_id} (night {run.data.tags[NIGHT_TAG]})"
    return None


def _baseline_from_disk(root: Path, spec: StudySpec, night: str) -> tuple[dict[str, float], str] | None:
    """The figures of the latest other complete night whose table of this study reads (a damaged night is passed
    over with a warning: it is history, not tonight's input)."""
    finished = {}
    for marker in root.glob(f"*/{NIGHT_FILE}"):
        if marker.parent.name != night:
            try:
                finished[marker] = str(json.loads(marker.read_text())["finished"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                LOG.warning("%s is not a night's record (%s); passed over as a baseline", marker, exc)
    for marker in sorted(finished, key=finished.__getitem__, reverse=True):
        out = marker.parent / spec.name
        if (out / PARQUET).is_file():
            try:
                return figures(read_parquet(out)), f"trials table of night {marker.parent.name}"
            except DseError as exc:
                LOG.warning("%s; passed over as a baseline", exc)
    return None


def compare(now: dict[str, float], before: dict[str, float], threshold: float) -> list[str]:
    """Figures whose relative change exceeds the threshold (or that appeared or vanished)."""
    moved = []
    for name in sorted(set(now) | set(before)):
        a, b = before.get(name), now.get(name)
        if a is None or b is None or abs(b - a) > threshold * max(abs(a), 1e-12):
            moved.append(name)
    return moved


def markdown(night: str, results: list[StudyNight], threshold: float) -> str:
    changed = [r for r in results if r.moved]
    baselined = [r for r in results if r.baseline is not None]
    if changed:
        verdict = f"**{len(changed)} of {len(results)} studies changed** beyond {100 * threshold:g} %."
    elif baselined:
        verdict = f"no change: every tracked figure is within {100 * threshold:g} % of the last successful night."
    else:
        verdict = "first night: no earlier night to compare with; these figures are the baseline."
    lines = [f"# dse nightly {night}", "", verdict, ""]
    for result in results:
        lines += [f"## {result.study}", "", f"baseline: {result.source}", ""]
        lines += ["| figure | last night | tonight | change | verdict |", "|---|---:|---:|---:|---|"]
        for name in sorted(set(result.now) | set(result.baseline or {})):
            a = (result.baseline or {}).get(name)
            b = result.now.get(name)
            change = "" if a is None or b is None or a == 0 else f"{100 * (b - a) / abs(a):+.3f} %"
            verdict_cell = _verdict(name, a, b, name in result.moved)
            lines.append(f"| {name} | {_cell(name, a)} | {_cell(name, b)} | {change} | {verdict_cell} |")
        lines.append("")
    return "\n".join(lines)


def _cell(name: str, value: float | None) -> str:
    return "-" if value is None else report.fmt(name.removeprefix("best."), value)


def _verdict(name: str, before: float | None, now: float | None, moved: bool) -> str:
    if not moved:
        return "no change"
    if before is None or now is None:
        return "new" if before is None else "gone"
    if name == "front_size":
        return "changed"
    worse = now > before if not name.endswith(("mfu", "tokens_per_s_per_gpu", "overlap_ratio")) else now < before
    return "REGRESSION" if worse else "improvement"


def load_suite(suite: Path) -> list[tuple[Path, StudySpec]]:
    """Every study file of the suite, checked before anything runs (two studies of one name would share a
    folder)."""
    if suite.is_file():
        raise DseError(f"{suite}: a file, not a suite's folder; give the folder of study files (one study: dse run)")
    files = sorted(suite.glob("*.yaml"))
    if not files:
        where = "" if suite.is_dir() else " (no such folder)"
        raise DseError(f"{suite}: no study files (*.yaml) here{where}; give the folder of the nightly suite")
    loaded = [(path, load_study(path)) for path in files]
    first: dict[str, Path] = {}
    for path, spec in loaded:
        if spec.name in first:
            raise DseError(
                f"{path}: field 'name': study '{spec.name}' is also {first[spec.name]}'s, and a night runs each study "
                "into a folder of its name; give each study its own name"
            )
        first[spec.name] = path
    return loaded


@dataclass(frozen=True)
class NightRun:
    """Where and how a night runs its suite."""

    root: Path
    night: str
    uri: str
    workers: int | None
    threshold: float
    force: bool
    """Start every study afresh, replacing its results; without it, a night run again resumes its studies (a
    finished one has nothing left to run and gives the same figures)."""


def run_suite(suite: list[tuple[Path, StudySpec]], run: NightRun, run_study: StudyRunner) -> tuple[str, bool]:
    """Run every study of the suite for this night and write the report; returns it and whether anything moved.

    Ray is joined once by the caller."""
    from mlflow import MlflowClient

    root, night = run.root, run.night
    night_dir = root / night
    client = MlflowClient(run.uri)
    results = []
    for path, spec in suite:
        out = night_dir / spec.name
        if run.force and out.is_dir():
            folders.clear(out)
        code = run_study(path, out, run.uri, run.workers)
        if code != 0:
            raise StudyFailed(f"{path}: the study failed (exit code {code}); the night is incomplete, see above", code)
        now = figures(read_parquet(out))
        found = _baseline_from_mlflow_safely(client, spec, night) or _baseline_from_disk(root, spec, night)
        baseline, source = found if found else (None, "none (first night)")
        moved = compare(now, baseline, run.threshold) if baseline else []
        results.append(StudyNight(spec.name, now, baseline, source, moved))
        _tag_night(client, out, night, now)
    text = markdown(night, results, run.threshold)
    (night_dir / REPORT).write_text(text)
    moved = any(r.moved for r in results)
    (night_dir / NIGHT_FILE).write_text(
        json.dumps({"night": night, "finished": datetime.now(UTC).isoformat(), "changed": moved}, indent=1)
    )
    _log_report(client, night, night_dir / REPORT, moved)
    return text, moved


def _baseline_from_mlflow_safely(client, spec: StudySpec, night: str) -> tuple[dict[str, float], str] | None:
    try:
        return _baseline_from_mlflow(client, spec, night)
    except Exception:  # MLflow down: the trials tables on disk are the fallback, as the module says
        return None


def _tag_night(client, out: Path, night: str, now: dict[str, float]) -> None:
    spec = load_saved_spec(out)
    run_id = open_study(spec, out).user_attrs.get(PARENT_RUN_ATTR)
    if not run_id:
        return
    try:
        client.set_tag(run_id, NIGHT_TAG, night)
        for name, value in now.items():
            client.log_metric(run_id, METRIC_PREFIX + name, value)
    except Exception as exc:  # the disk fallback still has tonight's figures
        LOG.warning("MLflow did not take the night's figures: %s", exc)


def _log_report(client, night: str, path: Path, moved: bool) -> None:
    try:
        experiment = client.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(EXPERIMENT)
        run = client.create_run(experiment_id, run_name=night, tags={NIGHT_TAG: night, "changed": str(moved).lower()})
        client.log_artifact(run.info.run_id, str(path))
        client.set_terminated(run.info.run_id)
    except Exception as exc:
        LOG.warning("MLflow did not take the nightly report: %s", exc)
