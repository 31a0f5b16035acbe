"""Timeline traces of single design points, for `dse evaluate --trace` and `dse timeline` (open them in
ui.perfetto.dev).

A cost model offers traces through the TimelineCostModel capability (dse.interfaces); simulators.analytical has
it. Traces are gzipped: a Llama-3-8B step on 64 GPUs is ~50k events, 8 MB of JSON, well under 1 MB compressed.
"""

import gzip
import json
from pathlib import Path
from typing import Any

from dse import plugins
from dse.interfaces import TimelineCostModel
from dse.space import StudySpec, decode
from dse.spec import DesignPoint

TIMELINES_DIR = "timelines"
"""A study's traces: OUT_DIR/timelines/trial-N.json.gz."""


def timeline_model(cost_model: str) -> TimelineCostModel | None:
    """The registered cost model as one that keeps its timeline, or None if it cannot (TimelineCostModel)."""
    model = plugins.cost_model(cost_model)
    return model if isinstance(model, TimelineCostModel) else None


def write_trace(point: DesignPoint, generator: str, cost_model: str, path: Path) -> bool:
    """Simulate the point again with the timeline kept and write the gzipped Chrome trace to path; False if the
    cost model keeps no timeline.

    The JSON is encoded whole (json.dumps runs in C; json.dump streams through Python, 5x slower on these 50k
    events) and compressed at level 6 in one call: ~8 MB of JSON, well under 1 MB written."""
    model = timeline_model(cost_model)
    if model is None:
        return False
    workload = plugins.generator(generator).generate(point)
    trace = model.chrome_trace(model.with_timeline().simulate(workload, point.system))
    path.write_bytes(gzip.compress(json.dumps(trace, separators=(",", ":")).encode(), compresslevel=6))
    return True


def write_timelines(spec: StudySpec, params: dict[int, dict[str, Any]], folder: Path) -> dict[int, Path]:
    """folder/trial-N.json.gz, the simulated step of each trial N in `params` (its Optuna params; a file already
    there is kept), for the trials whose point decodes; empty when the study's cost model keeps no timeline."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[int, Path] = {}
    for number, values in sorted(params.items()):
        path = folder / f"trial-{number}.json.gz"
        if not path.is_file():
            point = decode(spec, values)
            if isinstance(point, str) or not write_trace(point, spec.generator, spec.cost_model, path):
                continue
        paths[number] = path
    return paths
