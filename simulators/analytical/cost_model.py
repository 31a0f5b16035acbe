"""The analytical cost model: roofline kernels, closed-form collectives, stream-level scheduling."""

import numpy as np

from dse.errors import InfeasibleError
from dse.interfaces import ClassResult, SimResult
from dse.spec import SystemSpec
from dse.workload import Workload
from simulators.analytical.engine import schedule
from simulators.analytical.fastpath import schedule_fast
from simulators.analytical.memory import peak_memory, with_runtime_reserve


class AnalyticalCostModel:
    """Prices a workload in CPU milliseconds (about 20 ms for Llama-3-70B on 1024 GPUs, 12k calls, on the fast
    path), cheap enough for a study to sweep thousands of points.

    timeline: also keep every op's interval for `to_chrome_trace`. It is off by default because a large step has
    a hundred thousand ops, and because it turns off the fusion of kernel runs that the figures do not need.
    exact: schedule every call by the reference rules instead of the fast path (`fastpath`), which prices each
    run of calls between pipeline transfers once per entry state; the two agree within 1% (a test pins it).

    Compute that runs while communication does is slowed by the accelerator's `overlap_slowdown` (Charon's
    ratio model: NCCL kernels take SMs and HBM bandwidth from the GEMMs beside them); the slowed share of the
    overlapped time is added to the class's compute and, because the compute stream is what the overlapped
    stretch waits on, to its end. It is applied after scheduling, so a timeline shows the schedule before it.
    Peak memory adds the accelerator's runtime reserve and fragmentation (`memory.with_runtime_reserve`).
    """

    name = "analytical"

    def __init__(self, timeline: bool = False, exact: bool = False) -> None:
        self.timeline = timeline
        self.exact = exact

    def simulate(self, workload: Workload, system: SystemSpec) -> SimResult:
        if workload.layout.world > system.npus:
            raise InfeasibleError(
                f"the workload has {workload.layout.world} ranks but system '{system.name}' has "
                f"{system.npus} NPUs; enlarge system.network or lower the parallel degrees"
            )
        if self.timeline or self.exact:
            schedules = schedule(workload, system, timeline=self.timeline)
        else:
            schedules = schedule_fast(workload, system)
        ranks = np.bincount(workload.class_of, minlength=len(workload.programs))
        classes = []
        accelerator = system.accelerator
        for index, (program, sched) in enumerate(zip(workload.programs, schedules, strict=True)):
            peak, at_peak = peak_memory(program, workload.blocks, sched.call_start, sched.call_end)
            peak = with_runtime_reserve(peak, at_peak, accelerator)
            slowed = accelerator.overlap_slowdown * (sched.comm_s - sched.exposed_comm_s)
            classes.append(
                ClassResult(
                    name=program.name,
                    ranks=int(ranks[index]),
                    end_s=sched.end_s + slowed,
                    compute_s=sched.compute_s + slowed,
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
