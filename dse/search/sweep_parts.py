"""A sweep's results on disk while it runs: Parquet parts, each a whole file, and the manifest that says which study
they belong to.

A part is written under a temporary name and renamed into place, so a part on disk is always a valid Parquet file,
whatever stopped the sweep (a single file written as results arrive has no footer until it is closed, and a kill
would lose all of it). The grid numbers a part's rows hold are what a resumed sweep skips (numbers, not task ids, so
that parts written under another cut of the grid into tasks still count). The manifest (`sweep.json`) keeps what
decides the rows (base, space, derived, plugins, objectives), so that a rerun of another grid into the same folder
is refused rather than mixed in, and the MLflow parent run's id.
"""

import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dse.errors import SpecError
from dse.search.space import StudySpec

PARTS_DIR = "sweep-parts"
MANIFEST = "sweep.json"
IDENTITY_EXCLUDED = {"name", "seed", "workers", "tracking", "sampler", "sweep", "trials", "population_size"}
"""Study fields that do not change a sweep's rows: a rerun may change them and still resume."""
OPTUNA_JOURNAL = "optuna-journal.log"


class PartStore:
    """The parts of a sweep's output folder."""

    def __init__(self, out_dir: Path) -> None:
        self.folder = out_dir / PARTS_DIR

    def paths(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.parquet")) if self.folder.is_dir() else []

    def numbers(self) -> np.ndarray:
        """The grid numbers of the rows on disk, each once, sorted."""
        columns = [pq.read_table(path, columns=["number"])["number"].to_numpy() for path in self.paths()]
        return np.unique(np.concatenate(columns)) if columns else np.empty(0, dtype=np.int64)

    def rows(self) -> int:
        return sum(pq.read_metadata(path).num_rows for path in self.paths())

    def write(self, tables: list[pa.Table]) -> None:
        """The tasks' tables as one part (nothing for none)."""
        if not tables:
            return
        joined = pa.concat_tables(tables, promote_options="permissive")
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"part-{uuid.uuid4().hex[:12]}.parquet"
        temporary = self.folder / f".{name}.tmp"
        pq.write_table(joined, temporary)
        os.replace(temporary, self.folder / name)

    def read(self) -> pa.Table | None:
        """Every row on disk, one row per grid number (a task written twice by two drivers counts once)."""
        tables = [pq.read_table(path) for path in self.paths()]
        if not tables:
            return None
        table = pa.concat_tables(tables, promote_options="permissive").sort_by("number")
        numbers = table["number"].to_numpy()
        if len(numbers) > 1 and (numbers[1:] == numbers[:-1]).any():
            first = [0, *(i for i in range(1, len(numbers)) if numbers[i] != numbers[i - 1])]
            table = table.take(first)
        return table


def identity(spec: StudySpec) -> dict[str, Any]:
    """What decides a sweep's rows."""
    return spec.model_dump(mode="json", exclude=IDENTITY_EXCLUDED)


def open_manifest(spec: StudySpec, out_dir: Path) -> dict[str, Any]:
    """The folder's manifest, created for this sweep, or checked against it on a resume (SpecError naming the
    study field that differs)."""
    if (out_dir / OPTUNA_JOURNAL).exists():
        raise SpecError(
            f"{spec.source}: field 'sweep': {out_dir} holds an Optuna study ({OPTUNA_JOURNAL}), whose trials table a "
            "sweep would overwrite; run the sweep with another --out, or --force to replace the study"
        )
    path = out_dir / MANIFEST
    mine = identity(spec)
    if not path.is_file():
        manifest = {"study": mine, "uid": uuid.uuid4().hex}
        save_manifest(out_dir, manifest)
        return manifest
    manifest = json.loads(path.read_text())
    stored = manifest["study"]
    if stored != mine:
        field = next(key for key in sorted({*stored, *mine}) if stored.get(key) != mine.get(key))
        raise SpecError(
            f"{spec.source}: field '{field}': {out_dir} holds a sweep with another {field}, whose rows would mix "
            f"with this one's; use another --out, or restore {field} to resume it"
        )
    return manifest


def save_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    temporary = out_dir / f".{MANIFEST}.tmp"
    temporary.write_text(json.dumps(manifest, indent=1))
    os.replace(temporary, out_dir / MANIFEST)
