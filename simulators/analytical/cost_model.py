"""The analytical cost model: roofline kernels, closed-form collectives, stream-level scheduling."""

from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dse.errors import InfeasibleError
from dse.interfaces import ClassResult, SimResult
from dse.system import SystemSpec
from dse.tables.nccl import MeasuredCollectives
from dse.workload import Collective, Workload
from simulators.analytical import network
from simulators.analytical.batch import price_many, too_small
from simulators.analytical.compiled_engine import schedule_compiled
from simulators.analytical.engine import schedule
from simulators.analytical.memory import peak_memory, with_runtime_reserve, working_bytes
from simulators.analytical.steady import schedule_steady
from simulators.analytical.trace import to_chrome_trace
from simulators.result_cache import ResultCache

_RESULTS = ResultCache()
BATCH_FROM = 24
"""Systems from which `simulate_many` records the workload's tape and evaluates it for all of them (`batch`) rather
than pricing them one by one: on GPT-3 175B's configurations (benchmarks/vs_calculon.py, 6 structures, the tape
recorded afresh for each) a batch cost 31-39 ms for 8 systems, 31-34 ms for 12 to 16, 53-66 ms for 24, 56-61 ms for
32 and 62-71 ms for 48, against 19-25, 25-35, 48-54, 65-71 and 106-117 ms point by point (2026-11-30, on a shared
2-core machine): the two break even at about 16 to 32."""


_last_system: tuple[SystemSpec, str] | None = None


def _system_key(system: SystemSpec) -> str:
    """The system's JSON, which keys its results: kept for the last system object priced, as a study's points
    share theirs and dumping it again costs about 30 µs a point (a SystemSpec is frozen)."""
    global _last_system
    if _last_system is None or _last_system[0] is not system:
        _last_system = (system, system.model_dump_json())
    return _last_system[1]


class AnalyticalCostModel:
    """Prices a workload in CPU milliseconds, cheap enough for a study to sweep thousands of points: Llama-3-70B on
    1,024 GPUs with 64 micro-batches, priced from its steady form of 12 (`steady`), costs 5.8-6.0 ms at the median with
    its generation, and 65-67 ms of simulation on average over 18 points, most of it the process's first point
    (1,207-1,220 ms: its workload's first shape, and the imports `import dse` leaves to the first point: numba's first
    kernel load imports scipy.linalg for its BLAS check, and the first table read pyarrow); a revisit of the same points
    runs at 187-205 per second, a sweep of one configuration over 18 systems at 158-165, and a study-like sample (216
    points, 18 configurations on 12 systems, shuffled, its fresh process's first point included) at 104-109
    (benchmarks/evaluate_rate.py, two runs on a shared 2-core machine, 2026-12-01, about 4x slower than the one that
    printed 1.4 ms, 1,022-1,035, 609-620 and 341-353 on 2026-11-30).

    By default a step is scheduled by the reference rules compiled (`compiled_engine`, the same schedules to the
    bit as `engine`'s), over the workload's steady form when it has one (`steady`: the shorter step simulated and
    its verified period added on).
    options (`Options`, a study's cost_model_options): `exact` schedules every call of the whole step by the
    interpreted reference rules (`engine`) instead; the two agree to rounding (tests pin 1e-9), so a study can
    screen on the default path and refine its best points exactly.
    timeline (for code, not files: `with_timeline`): also keep every op's interval for `to_chrome_trace`. It is
    off by default because a large step has a hundred thousand ops, and because it turns off the fusion of kernel
    runs that the figures do not need. `exact=True` without options is `Options(exact=True)`, for code.

    Compute that runs while communication does is slowed by the accelerator's `overlap_slowdown` (Charon's
    ratio model: NCCL kernels take SMs and HBM bandwidth from the GEMMs beside them); the slowed share of the
    overlapped time is added to the class's compute and, because the compute stream is what the overlapped
    stretch waits on, to its end. It is applied after scheduling, so a timeline shows the schedule before it.
    Peak memory adds the accelerator's runtime reserve and fragmentation (`memory.with_runtime_reserve`).
    """

    name = "analytical"

    class Options(BaseModel):
        """What a study file or `--cost-option` may set (see the class docstring)."""

        model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

        exact: bool = Field(False, description="schedule the whole step by the reference rules, not its steady form")

    def __init__(self, options: Options | None = None, *, timeline: bool = False, exact: bool = False) -> None:
        self.options = options or self.Options(exact=exact)
        self.timeline = timeline
        self.exact = self.options.exact

    def with_timeline(self) -> "AnalyticalCostModel":
        return AnalyticalCostModel(self.options, timeline=True)

    def chrome_trace(self, result: SimResult) -> dict[str, Any]:
        return to_chrome_trace(result)

    def simulate(self, workload: Workload, system: SystemSpec) -> SimResult:
        """The step's result; a point priced before in this process with the same settings is read back."""
        if self.timeline:  # a timeline is large and wanted once
            return self._simulate(workload, system)
        key = (workload.point_key, _system_key(system), self.exact)
        return _RESULTS.priced(key, workload, lambda: self._simulate(workload, system))

    def simulate_many(self, workload: Workload, systems: Sequence[SystemSpec]) -> list[SimResult | InfeasibleError]:
        """The step on each system (dse.interfaces.BatchCostModel): the reference schedule over the workload's
        steady form, whichever way this model is set, as the default path prices one point; from BATCH_FROM systems
        on, evaluated for all of them at once (`batch.price_many`), below that one by one. With a timeline, every
        system is simulated by itself, as this model prices it."""
        if not self.timeline and len(systems) >= BATCH_FROM:
            return price_many(workload, systems)
        model = self if self.timeline else AnalyticalCostModel()
        out: list[SimResult | InfeasibleError] = []
        for system in systems:
            try:
                out.append(model.simulate(workload, system))
            except InfeasibleError as error:
                out.append(error)
        return out

    def collective_time(self, kind: Collective, size: float, ranks: Sequence[int], system: SystemSpec) -> float:
        """The closed form, or within a node the NCCL tables, the simulation prices the collective with
        (dse.interfaces.CollectiveCostModel)."""
        node = network.within_node(
            MeasuredCollectives.of(system.accelerator), network.spanned_dims(ranks, system.network)
        )
        return network.collective_time(kind, size, network.group_span(ranks, system.network), node)

    def p2p_time(self, size: float, src: int, dst: int, system: SystemSpec) -> float:
        """The time the simulation gives a pipeline send (dse.interfaces.CollectiveCostModel)."""
        return network.p2p_time(size, src, dst, system.network)

    def _simulate(self, workload: Workload, system: SystemSpec) -> SimResult:
        if (error := too_small(workload, system)) is not None:
            raise error
        programs = workload.programs
        if self.timeline or self.exact:
            schedules = schedule(workload, system, timeline=self.timeline)
        elif (steady := schedule_steady(workload, system)) is not None:
            schedules, programs = steady.schedules, steady.programs
        else:
            schedules = schedule_compiled(workload, system)
        ranks = np.bincount(workload.class_of, minlength=len(workload.programs))
        classes = []
        accelerator = system.accelerator
        block_temp = working_bytes(workload.blocks)
        for index, (program, sched) in enumerate(zip(programs, schedules, strict=True)):
            peak, at_peak = peak_memory(program, workload.blocks, sched.call_start, sched.call_end, block_temp)
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
