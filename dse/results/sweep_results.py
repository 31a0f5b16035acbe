"""A sweep's results as a study's: the trials table with the Pareto front marked, the front's table and point
files, the plots, and one MLflow parent run with the artifacts and the sweep's figures (no child run per point:
a million runs would take MLflow days).

The table is the study's `trials.parquet` (one row per grid point, `number` its place in the grid, the same
columns for state, reason, feasibility, point key, parameters and metrics), so `dse report`, `dse compare` and
pandas read a sweep as they read a study. The front is `pareto.front` of the table, as for a study.
"""

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dse.results import browse, mlflow_runs, pareto, tracking
from dse.search.space import StudySpec
from dse.search.study import POINT_KEY
from dse.search.sweep_grid import SweepGrid
from dse.search.sweep_parts import PartStore, save_manifest

ROW_GROUP_ROWS = 65_536
PANDAS_ATTRS = b"PANDAS_ATTRS"
"""Where pandas keeps a frame's attrs in Parquet metadata: the objectives that `dse report` reads back."""
TABLE_COLUMNS = ("number", "state", "feasible", POINT_KEY)


def attrs(spec: StudySpec) -> dict[str, Any]:
    """The table's attrs, as `tracking.trials_frame` sets them for a study."""
    return {
        "study": spec.name,
        "objectives": dict(zip(spec.metrics, spec.directions, strict=True)),
        "constraints": list(spec.constraints),
    }


def write_tables(spec: StudySpec, out_dir: Path) -> tracking.Results | None:
    """trials.parquet (every row on disk, in grid order, with `pareto`), pareto.csv and OUT/best from the parts;
    None when no part is written yet."""
    table = PartStore(out_dir).read()
    if table is None:
        return None
    meta = attrs(spec)
    objectives = meta["objectives"]
    columns = [name for name in (*TABLE_COLUMNS, *objectives) if name in table.column_names]
    compact = table.select(columns).to_pandas()
    best_numbers = set(pareto.front(compact, objectives)["number"]) if set(objectives) <= set(columns) else set()
    table = table.append_column("pareto", pa.array(compact["number"].isin(best_numbers).to_numpy()))
    table = table.replace_schema_metadata({PANDAS_ATTRS: json.dumps(meta).encode()})
    temporary = out_dir / f".{tracking.PARQUET}.tmp"
    pq.write_table(table, temporary, row_group_size=ROW_GROUP_ROWS)
    os.replace(temporary, out_dir / tracking.PARQUET)
    frame = table.to_pandas()
    frame.attrs.update(meta)
    best = pareto.front(frame) if best_numbers else frame.iloc[:0]
    best.to_csv(out_dir / tracking.PARETO_CSV, index=False)
    grid = SweepGrid(spec)
    params = {int(n): grid.params_of(int(n)) for n in best["number"]}
    points = tracking.write_best_points(spec, params, out_dir)
    files = [out_dir / tracking.SPEC_FILE, out_dir / tracking.PARQUET, out_dir / tracking.PARETO_CSV, points]
    return tracking.Results(frame, best, files)


def figures(frame: pd.DataFrame, front: pd.DataFrame, seconds: float, priced: int) -> dict[str, float]:
    """The sweep's summary, as the parent run's metrics: points by state, feasible points, the front's size, the
    best value of each objective, and this run's wall time and rate."""
    state = frame["state"]
    out = {
        "points": float(len(frame)),
        "complete_points": float((state == "COMPLETE").sum()),
        "pruned_points": float((state == "PRUNED").sum()),
        "failed_points": float((state == "FAIL").sum()),
        "feasible_points": float(((state == "COMPLETE") & (frame["feasible"] == True)).sum()),  # noqa: E712
        "pareto_size": float(len(front)),
        "sweep_seconds": seconds,
        "points_per_s": priced / seconds if seconds > 0 else 0.0,
    }
    for metric, direction in frame.attrs["objectives"].items():
        if not front.empty and metric in front:
            out[f"best_{metric}"] = float(front[metric].min() if direction == "minimize" else front[metric].max())
    return out


def log_to_mlflow(
    uri: str, spec: StudySpec, out_dir: Path, manifest: dict[str, Any], results: tracking.Results, summary: dict
) -> tuple[str | None, str, str]:
    """The sweep's parent run (found again by the manifest's id or uid on a rerun): its tags, the summary as
    metrics, the artifacts; returns the error that stopped MLflow (None when all was written), the experiment id
    and the parent run's id. A sweep that is stopped short leaves its run KILLED, and a rerun finishes it."""
    from mlflow.entities import Metric

    tags = {**tracking.parent_tags(spec), "child_runs": "none", "sweep": "true"}
    connect = mlflow_runs.Connect(
        uri, browse.StudyColumns.of(spec), tags, out_dir, manifest.get("parent_run"), manifest["uid"], []
    )
    writer = mlflow_runs.Writer(connect)
    writer.attempt(lambda: writer.connect(connect))
    if writer.parent_id and manifest.get("parent_run") != writer.parent_id:
        manifest.update(parent_run=writer.parent_id, tracking_uri=uri)
        save_manifest(out_dir, manifest)
    metrics = [Metric(name, value, 0, 0) for name, value in summary.items()]
    writer.attempt(lambda: writer.mlflow.log_batch(writer.parent_id, metrics=metrics))
    complete = summary["points"] == SweepGrid(spec).size
    finish = mlflow_runs.Finish([], set(), set(), results.artifacts, complete)
    writer.attempt(lambda: writer.finish(finish))
    return writer.error, writer.experiment_id, writer.parent_id
