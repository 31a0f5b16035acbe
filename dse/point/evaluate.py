"""One design point through a generator, a cost model and every installed objective."""

import time
from dataclasses import dataclass

from dse import plugins
from dse.interfaces import CostModel, SimResult, WorkloadGenerator
from dse.objective import Constraint
from dse.point.feasibility import check_feasible
from dse.serving.deployment import ServingResult
from dse.serving.serve import serve
from dse.spec import DesignPoint
from dse.workload import Workload


@dataclass
class Evaluation:
    """metrics is the stable contract of `dse evaluate --json`: the keys below plus every objective's metric."""

    metrics: dict[str, float | bool]
    violations: dict[str, float]
    """Per constraint: the violation amount, <= 0 when satisfied."""
    generate_s: float
    simulate_s: float
    workload: Workload
    result: SimResult


def evaluate(point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel) -> Evaluation:
    """A serving point's workload is its typical decode step, and its generate time is in its simulate time (the
    serving model generates its steps as it prices them)."""
    check_feasible(point)
    return evaluate_feasible(point, generator, cost_model)


def evaluate_feasible(point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel) -> Evaluation:
    """`evaluate` of a point its caller has found feasible already (a sweep checks every point before pricing)."""
    t0 = time.perf_counter()
    if point.workload.mode == "serve":
        result = serve(point, generator, cost_model)
        assert result.workload is not None
        workload = result.workload
        t1 = t0
    else:
        workload = generator.generate(point)
        t1 = time.perf_counter()
        result = cost_model.simulate(workload, point.system)
    t2 = time.perf_counter()
    metrics, violations = metrics_of(point, workload, result)
    return Evaluation(metrics, violations, t1 - t0, t2 - t1, workload, result)


def metrics_of(
    point: DesignPoint, workload: Workload, result: SimResult
) -> tuple[dict[str, float | bool], dict[str, float]]:
    """The metrics (the contract above) and constraint violations of a priced point: what `evaluate` reports, for a
    caller that prices many points at once (a sweep)."""
    metrics: dict[str, float | bool] = {
        "step_time_s": result.step_time_s,
        "compute_time_s": result.compute_time_s,
        "comm_time_s": result.comm_time_s,
        "exposed_comm_time_s": result.exposed_comm_time_s,
        "overlap_ratio": result.overlap_ratio,
        "peak_memory_bytes": result.peak_memory_bytes,
        "hbm_bytes": point.system.accelerator.hbm_bytes,
        "model_flops": workload.model_flops,
    }
    if isinstance(result, ServingResult):
        metrics |= result.serving
    violations: dict[str, float] = {}
    for item in plugins.objectives():
        value = item.fn(point, workload, result)
        if value is None:
            continue
        metrics[item.metric] = value
        if isinstance(item, Constraint):
            violations[item.name] = value
    metrics["fits_memory"] = violations.get("fits_memory", 0.0) <= 0
    return metrics, violations
