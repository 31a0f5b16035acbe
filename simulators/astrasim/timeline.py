"""ASTRA-sim's schedule as a timeline: with `trace-enabled`, its log names every node's issue and completion tick,
and each rank class's representative rank becomes one process of a Chrome/Perfetto trace, on the same streams as
the analytical model's (simulators/analytical/recipes.stream_of), so the two models' traces compare side by side."""

import re
from collections import defaultdict

from dse.interfaces import TimelineEvent
from dse.workload import Workload, expand
from simulators.analytical.recipes import stream_of

NS = 1e-9
_EVENT = re.compile(r"(issue|callback),sys->id=(\d+), tick=(\d+), node->id=(\d+),")
SOURCE = "astrasim"


def timeline_events(log: str, workload: Workload) -> list[TimelineEvent]:
    """One event per node of each rank class's representative rank, from ASTRA-sim's trace log."""
    classes = {workload.representative(index): index for index in range(len(workload.programs))}
    ops = {index: [flat.op for flat in expand(workload, program)] for index, program in enumerate(workload.programs)}
    issued: dict[tuple[int, int], int] = {}
    events = []
    for match in _EVENT.finditer(log):
        rank, tick, node = int(match[2]), int(match[3]), int(match[4])
        if rank not in classes:
            continue
        if match[1] == "issue":
            issued[(rank, node)] = tick
            continue
        start = issued.pop((rank, node), None)
        if start is not None:
            index = classes[rank]
            op = ops[index][node]
            events.append(TimelineEvent(index, stream_of(op), op.name, op.category, start * NS, tick * NS, SOURCE))
    return events


def time_by_category(events: list[TimelineEvent], rank_class: int) -> dict[str, float]:
    """Busy seconds per op category of one rank class, summed over its ops."""
    seconds: dict[str, float] = defaultdict(float)
    for event in events:
        if event.rank_class == rank_class:
            seconds[event.category] += event.end_s - event.start_s
    return dict(seconds)
