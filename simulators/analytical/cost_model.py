"""The analytical cost model: roofline kernels, closed-form collectives, stream-level scheduling."""

import numpy as np

from dse.errors import InfeasibleError
from dse.interfaces import ClassResult, SimResult
from dse.spec import SystemSpec
from dse.workload import Workload
from simulators.analytical.engine import schedule
from simulators.analytical.memory import peak_memory


class AnalyticalCostModel:
    """Prices a workload in CPU milliseconds (about 0.13 µs per op of the expanded step), cheap enough for a
    study to sweep thousands of points.

    timeline: also keep every op's interval for `to_chrome_trace`. It is off by default because a large step has
    a hundred thousand ops, and because it turns off the fusion of kernel runs that the figures do not need.
    """

    name = "analytical"

    def __init__(self, timeline: bool = False) -> None:
        self.timeline = timeline

    def simulate(self, workload: Workload, system: SystemSpec) -> SimResult:
        if workload.layout.world > system.npus:
            raise InfeasibleError(
                f"the workload has {workload.layout.world} ranks but system '{system.name}' has "
                f"{system.npus} NPUs; enlarge system.network or lower the parallel degrees"
            )
        schedules = schedule(workload, system, timeline=self.timeline)
        ranks = np.bincount(workload.class_of, minlength=len(workload.programs))
        classes = []
        for index, (program, sched) in enumerate(zip(workload.programs, schedules, strict=True)):
            peak, at_peak = peak_memory(program, workload.blocks, sched.call_start, sched.call_end)
            classes.append(
                ClassResult(
                    name=program.name,
                    ranks=int(ranks[index]),
                    end_s=sched.end_s,
                    compute_s=sched.compute_s,
                    comm_s=sched.comm_s,
                    exposed_comm_s=sched.exposed_comm_s,
                    peak_memory_bytes=peak,
                    memory_at_peak=at_peak,
                    time_by_category=sched.time_by_category,
                )
            )
        return SimResult(
            step_time_s=max((c.end_s for c in classes), default=0.0),
            classes=classes,
            timeline=[event for sched in schedules for event in sched.events],
        )
