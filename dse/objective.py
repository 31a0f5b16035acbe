"""Objectives and constraints: small named functions of a point, its workload and its simulation."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dse.interfaces import SimResult
from dse.spec import DesignPoint
from dse.workload import Workload

Direction = Literal["minimize", "maximize"]
MetricFn = Callable[[DesignPoint, Workload, SimResult], float | None]
"""None: the metric does not apply to the point (a serving metric of a training step), which has no value for it."""
NeedsFn = Callable[[DesignPoint], str | None]
"""Why a point cannot have a metric, naming the field to set and how (its accelerator has no price_usd), or None."""


@dataclass(frozen=True)
class Objective:
    """A metric a study can optimise. `metric` is its key in evaluation results and `dse evaluate --json`."""

    name: str
    metric: str
    direction: Direction
    unit: str
    fn: MetricFn
    serving: bool = False
    """A metric of serving points only (workload.mode serve): a study of other points cannot optimise it."""
    needs: NeedsFn | None = None
    """What a point must set to have the metric at all: a study that optimises it on a point without is refused."""


@dataclass(frozen=True)
class Constraint:
    """A feasibility condition; `fn` returns a violation amount that is <= 0 when the point is feasible."""

    name: str
    metric: str
    unit: str
    fn: MetricFn
    serving: bool = False
    """A condition on serving points only (workload.mode serve)."""
    needs: NeedsFn | None = None
    """What a point must set to be judged by it at all: a study constrained by it on a point without is refused."""


def in_seconds(metric: str) -> bool:
    """Whether a metric is a time in seconds by its name (step_time_s, ttft_p99_s), not a rate (tokens_per_s)."""
    return metric.endswith("_s") and not metric.endswith("per_s")
