"""Chrome / Perfetto trace JSON from a simulated timeline (open it at ui.perfetto.dev or chrome://tracing).

dse.point.traces and `dse evaluate --trace` find it here by convention: a cost model package exports to_chrome_trace.
"""

from typing import Any

from dse.interfaces import SimResult


def to_chrome_trace(result: SimResult) -> dict[str, Any]:
    """One process per rank class, one thread per stream, one complete ("X") event per op; times in µs.

    Thread ids are numbers, as the trace format asks, and name metadata events carry the stream names.
    """
    events: list[dict[str, Any]] = []
    for pid, cls in enumerate(result.classes):
        label = f"{cls.name} ({cls.ranks} ranks)"
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
    threads: dict[tuple[int, str], int] = {}
    for event in result.timeline:
        key = (event.rank_class, event.stream)
        tid = threads.get(key)
        if tid is None:
            tid = threads[key] = len(threads)
            label = {"name": event.stream}
            events.append({"name": "thread_name", "ph": "M", "pid": event.rank_class, "tid": tid, "args": label})
        record = {
            "name": event.name,
            "cat": event.category,
            "ph": "X",
            "ts": event.start_s * 1e6,
            "dur": (event.end_s - event.start_s) * 1e6,
            "pid": event.rank_class,
            "tid": tid,
        }
        if event.source:
            record["args"] = {"priced_by": event.source}
        events.append(record)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
