"""Timeline traces of single design points, for the Pareto members' MLflow runs (open them in ui.perfetto.dev).

A cost model offers traces by convention, without dse importing it: its constructor takes `timeline=True` and
its package exports `to_chrome_trace(SimResult) -> dict` (simulators.analytical does both). Traces are
gzipped: a Llama-3-8B step on 64 GPUs is ~50k events, 8 MB of JSON, well under 1 MB compressed.
"""

import gzip
import importlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dse import plugins
from dse.spec import DesignPoint

TRACE_FILE = "timeline.json.gz"


def exporter(cost_model: str) -> tuple[type, Callable[[Any], dict[str, Any]]] | None:
    """The cost model's class and its package's to_chrome_trace, or None if it offers no trace."""
    cls = type(plugins.cost_model(cost_model))
    package = importlib.import_module(cls.__module__.rpartition(".")[0] or cls.__module__)
    export = getattr(package, "to_chrome_trace", None)
    if export is None or "timeline" not in inspect.signature(cls).parameters:
        return None
    return cls, export


def write_trace(point: DesignPoint, generator: str, cost_model: str, folder: Path) -> Path | None:
    """Simulate the point again with the timeline kept and write the gzipped Chrome trace into folder."""
    found = exporter(cost_model)
    if found is None:
        return None
    cls, export = found
    workload = plugins.generator(generator).generate(point)
    trace = export(cls(timeline=True).simulate(workload, point.system))
    path = folder / TRACE_FILE
    with gzip.open(path, "wt") as out:
        json.dump(trace, out)
    return path
