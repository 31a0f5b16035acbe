"""Serving objectives and the SLO constraint: what a serving point's result (`dse.serving.deployment.ServingResult`)
reports, by the metric names `dse evaluate --json` gives them. A training or single-step point has none of them."""

from dse.interfaces import SimResult
from dse.objective import Constraint, Direction, Objective
from dse.serving.deployment import ServingResult
from dse.spec import DesignPoint
from dse.workload import Workload


def _reader(metric: str):
    def read(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
        return result.serving.get(metric) if isinstance(result, ServingResult) else None

    return read


def _serving(metric: str, direction: Direction, unit: str) -> Objective:
    return Objective(metric, metric, direction, unit, _reader(metric), serving=True)


ttft_mean_s = _serving("ttft_mean_s", "minimize", "s")
ttft_p50_s = _serving("ttft_p50_s", "minimize", "s")
ttft_p90_s = _serving("ttft_p90_s", "minimize", "s")
ttft_p99_s = _serving("ttft_p99_s", "minimize", "s")
tpot_mean_s = _serving("tpot_mean_s", "minimize", "s")
tpot_p50_s = _serving("tpot_p50_s", "minimize", "s")
tpot_p90_s = _serving("tpot_p90_s", "minimize", "s")
tpot_p99_s = _serving("tpot_p99_s", "minimize", "s")
e2e_mean_s = _serving("e2e_mean_s", "minimize", "s")
e2e_p50_s = _serving("e2e_p50_s", "minimize", "s")
e2e_p90_s = _serving("e2e_p90_s", "minimize", "s")
e2e_p99_s = _serving("e2e_p99_s", "minimize", "s")
tokens_per_s = _serving("tokens_per_s", "maximize", "tokens/s")
tokens_per_s_per_user = _serving("tokens_per_s_per_user", "maximize", "tokens/s")
requests_per_s = _serving("requests_per_s", "maximize", "requests/s")
goodput_requests_per_s = _serving("goodput_requests_per_s", "maximize", "requests/s")
max_rate_per_s = _serving("max_rate_per_s", "maximize", "requests/s")
"""Only of points that set serving.max_rate."""


def _slo_excess(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    """The largest share by which a latency exceeds its bound in serving.slo (<= 0: every bound met)."""
    if not isinstance(result, ServingResult):
        return None
    slo = point.workload.serving.slo if point.workload.serving else {}
    return max((result.serving[name] / bound - 1.0 for name, bound in slo.items()), default=0.0)


meets_slo = Constraint("meets_slo", "slo_excess", "", _slo_excess, serving=True)
