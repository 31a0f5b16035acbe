"""A study's output folder: what the commands that read one find there, and whose it is.

Reading (`dse report`, `compare`, `timeline`, `sync`, `ui`): a path that is missing, a file (often the study file
given where its output folder belongs) or a folder without results is named with what to give instead, and a
trials table or a saved study file that cannot be read is named with the reason and how to rebuild it.

Claiming (`dse run`, `dse nightly`): a folder carries the identity of the study run into it, its `study.yaml`.
Running another study into it (another name, or a study file changed in what decides its trials) would replace
that study's tables, plots and best points, so it is refused, naming both; `--force` removes the folder's results
first. What a resume may change (its budget, workers, sampler, seed, tracking, refine) keeps the identity, so
resuming, `--trials N` for more and a nightly rerun go on as before. Nothing is deleted without `--force`.
"""

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from dse.errors import DseError, SpecError
from dse.results.plots import HTML, PNG
from dse.results.serving_plots import CDF_HTML, CDF_PNG
from dse.results.timelines import TIMELINES_DIR
from dse.search.space import StudySpec, load_study
from dse.search.storage import JOURNAL
from dse.search.sweep_parts import MANIFEST, PARTS_DIR

PARQUET = "trials.parquet"
PARETO_CSV = "pareto.csv"
SPEC_FILE = "study.yaml"
"""The study file as run (with command-line overrides), so `dse sync` and `dse nightly` can reopen the study."""
BEST_DIR = "best"
RESULTS = (JOURNAL, PARQUET, MANIFEST, PARTS_DIR)
"""What makes a folder hold a study's results (a study file alone is not yet any)."""
WRITTEN = (
    *RESULTS,
    SPEC_FILE,
    PARETO_CSV,
    BEST_DIR,
    PNG,
    HTML,
    CDF_PNG,
    CDF_HTML,
    TIMELINES_DIR,
    "plots",
    "mlflow.db",
    "mlflow.db-wal",
    "mlflow.db-shm",
    "mlartifacts",
    f".{PARQUET}.tmp",
    f".{MANIFEST}.tmp",
)
"""Everything `dse run` writes into an output folder: what `--force` removes (and nothing else)."""
SAME_STUDY_FREE = frozenset(
    {"seed", "workers", "tracking", "sampler", "sweep", "trials", "population_size", "refine", "report"}
)
"""Study fields a resume may change: how the search goes on or is drawn, not what its trials are (README: "Output
folders")."""
TABLE_COLUMNS = ("number", "state", "reason", "feasible", "point_key")
"""Columns every trials table has, whatever its trials' states (a study's and a sweep's alike)."""
STATES = {"COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING"}


def output_folder(path: Path) -> Path:
    """`path` when it is a folder; else a DseError that says what it is and what to give instead."""
    if path.is_dir():
        return path
    if not path.exists():
        raise DseError(
            f"{path}: no such folder; give a study's output folder (`dse run --out`, by default runs/<study name>)"
        )
    if name := _study_name(path):
        raise DseError(
            f"{path}: a study file, not a study's output folder; `dse run {path}` writes one (runs/{name} "
            "unless --out says otherwise): give that folder"
        )
    raise DseError(f"{path}: a file, not a study's output folder; give the folder `dse run --out` wrote")


def _study_name(path: Path) -> str | None:
    """The study's name when the file reads as a study file (a mapping with a name and a space), else None."""
    if path.suffix not in (".yaml", ".yml"):
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except Exception:  # any file at all may be given here: whether it is a study file only shapes the message
        return None
    name = data.get("name") if isinstance(data, dict) and "space" in data else None
    return name if isinstance(name, str) and name else None


def rebuild_hint(out_dir: Path) -> str:
    """How the folder's tables are written again from what the study keeps."""
    if (out_dir / MANIFEST).is_file():
        return f"run the sweep again with `dse run STUDY.yaml --out {out_dir}`: it rebuilds the table from {PARTS_DIR}"
    if (out_dir / JOURNAL).is_file():
        return f"`dse sync {out_dir}` writes it again from the study's journal"
    return f"run the study again with `dse run STUDY.yaml --out {out_dir}`"


def read_parquet(out_dir: Path) -> pd.DataFrame:
    """The folder's trials table, checked to be one: a file pyarrow cannot read, or a Parquet table of something
    else, is a DseError naming the file, the reason and how to write it again."""
    path = output_folder(out_dir) / PARQUET
    if not path.is_file():
        raise DseError(f"{path}: no trials table here; run `dse run STUDY.yaml --out {out_dir}` first")
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises its own hierarchy, or OSError, or ValueError, for a damaged file
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        raise DseError(
            f"{path}: not a readable Parquet file ({path.stat().st_size:,} bytes; {reason}); {rebuild_hint(out_dir)}"
        ) from None
    if problem := _not_a_trials_table(frame):
        raise DseError(f"{path}: not a dse trials table ({problem}); {rebuild_hint(out_dir)}")
    return frame


def _not_a_trials_table(frame: pd.DataFrame) -> str | None:
    """What keeps a Parquet table from being a trials table (None when it is one)."""
    if missing := [column for column in TABLE_COLUMNS if column not in frame]:
        return f"no column '{missing[0]}'"
    objectives = frame.attrs.get("objectives")
    if not isinstance(objectives, dict) or not objectives:
        return "no objectives in its metadata"
    if not all(isinstance(d, str) and d in ("minimize", "maximize") for d in objectives.values()):
        return f"objectives {objectives} are not minimize or maximize"
    if not pd.api.types.is_numeric_dtype(frame["number"]) or frame["number"].isna().any():
        return "column 'number' is not whole numbers"
    if unknown := set(frame["state"].astype(str)) - STATES:
        return f"unknown state '{sorted(unknown)[0]}'"
    completed = frame["state"] == "COMPLETE"
    for metric in objectives:
        if metric not in frame and completed.any():
            return f"no column '{metric}' for its objective, though trials completed"
        if metric in frame and not pd.api.types.is_numeric_dtype(frame[metric]):
            return f"objective column '{metric}' is not numeric"
        if metric in frame and not np.isfinite(frame.loc[completed, metric].to_numpy(dtype=float)).all():
            return f"a completed trial's '{metric}' is not a finite number"
    return None


def load_saved_spec(out_dir: Path) -> StudySpec:
    """The study as it was run into the folder (its saved study.yaml)."""
    path = output_folder(out_dir) / SPEC_FILE
    if not path.is_file():
        raise SpecError(f"{path}: no study was run into {out_dir}; give the folder `dse run --out` used")
    try:
        return load_study(path)
    except SpecError as exc:
        raise SpecError(
            f"{exc}; {path} is the copy `dse run` saved of the study it ran: restore it, or copy the study file "
            "you ran there"
        ) from None


def claim(spec: StudySpec, out_dir: Path, force: bool) -> None:
    """Make `out_dir` this study's: refuse (SpecError naming both studies) when it holds another study's results,
    remove them first with `force`. A folder without results, or with this study's, is taken as it is."""
    held = [name for name in RESULTS if (out_dir / name).exists()]
    if force:
        clear(out_dir)
        return
    if not held:
        return
    saved = out_dir / SPEC_FILE
    replace = f"give another --out, or --force to replace it (its results in {out_dir} are deleted)"
    if not saved.is_file():
        raise SpecError(
            f"--out {out_dir}: the folder holds results ({held[0]}) but no {SPEC_FILE} saying which study they "
            f"are of; {replace}"
        )
    try:
        other = load_study(saved)
    except SpecError as exc:
        raise SpecError(f"--out {out_dir}: the study it holds cannot be read ({exc}); {replace}") from None
    if other.name != spec.name:
        raise SpecError(
            f"--out {out_dir}: holds study '{other.name}' ({saved}), not '{spec.name}' ({spec.source}); {replace}"
        )
    if field := _first_difference(identity(spec), identity(other)):
        raise SpecError(
            f"{spec.source}: field '{field}': --out {out_dir} holds study '{spec.name}' run with another {field} "
            f"({saved}), whose results this one's would mix with; restore {field} to resume it, or {replace}"
        )


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The dotted path of the first field in which two dumped studies differ (None: they do not)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted({*a, *b}, key=str):
            if (found := _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))) is not None:
                return found
        return None
    return None if a == b else path


def identity(spec: StudySpec) -> dict[str, Any]:
    """What decides a study's trials: two study files with the same identity are one study, resumed."""
    return spec.model_dump(mode="json", exclude=set(SAME_STUDY_FREE))


def clear(out_dir: Path) -> None:
    """Remove what `dse run` wrote into the folder (WRITTEN), nothing else."""
    for name in WRITTEN:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
