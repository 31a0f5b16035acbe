"""Timeline traces of single design points, for `dse evaluate --trace` and `dse timeline` (open them in
ui.perfetto.dev).

A cost model offers traces through the TimelineCostModel capability (dse.interfaces); simulators.analytical has
it. Traces are gzipped: a Llama-3-8B step on 64 GPUs is ~50k events, 8 MB of JSON, well under 1 MB compressed.
"""

import gzip
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dse import plugins
from dse.interfaces import TimelineCostModel
from dse.spec import DesignPoint


def timeline_model(cost_model: str, options: Mapping[str, Any] | None = None) -> TimelineCostModel | None:
    """The registered cost model (with its options) as one that keeps its timeline, or None if it cannot
    (TimelineCostModel)."""
    model = plugins.cost_model(cost_model, options)
    return model if isinstance(model, TimelineCostModel) else None


def write_trace(
    point: DesignPoint, generator: str, cost_model: str, path: Path, options: Mapping[str, Any] | None = None
) -> bool:
    """Simulate the point again with the timeline kept and write the gzipped Chrome trace to path; False if the
    cost model keeps no timeline.

    The JSON is encoded whole (json.dumps runs in C; json.dump streams through Python, 5x slower on these 50k
    events) and compressed at level 6 in one call: ~8 MB of JSON, well under 1 MB written."""
    model = timeline_model(cost_model, options)
    if model is None:
        return False
    workload = plugins.generator(generator).generate(point)
    trace = model.chrome_trace(model.with_timeline().simulate(workload, point.system))
    path.write_bytes(gzip.compress(json.dumps(trace, separators=(",", ":")).encode(), compresslevel=6))
    return True
