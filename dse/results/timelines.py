"""A study's timelines: the simulated steps of chosen trials as Perfetto traces, OUT_DIR/timelines/trial-N.json.gz
(`dse timeline`, or `tracking: {timelines: pareto}` at the end of a run)."""

from pathlib import Path
from typing import Any

from dse.point.traces import write_trace
from dse.search.decoding import decode
from dse.search.space import StudySpec

TIMELINES_DIR = "timelines"


def write_timelines(spec: StudySpec, params: dict[int, dict[str, Any]], folder: Path) -> dict[int, Path]:
    """folder/trial-N.json.gz, the simulated step of each trial N in `params` (its Optuna params; a file already
    there is kept), for the trials whose point decodes; empty when the study's cost model keeps no timeline."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[int, Path] = {}
    for number, values in sorted(params.items()):
        path = folder / f"trial-{number}.json.gz"
        if not path.is_file():
            point = decode(spec, values)
            if isinstance(point, str) or not write_trace(
                point, spec.generator, spec.cost_model, path, spec.cost_model_options
            ):
                continue
        paths[number] = path
    return paths
