"""Objectives and constraints: small named functions of a point, its workload and its simulation."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dse.interfaces import SimResult
from dse.spec import DesignPoint
from dse.workload import Workload

Direction = Literal["minimize", "maximize"]
MetricFn = Callable[[DesignPoint, Workload, SimResult], float]


@dataclass(frozen=True)
class Objective:
    """A metric a study can optimise. `metric` is its key in evaluation results and `dse evaluate --json`."""

    name: str
    metric: str
    direction: Direction
    unit: str
    fn: MetricFn


@dataclass(frozen=True)
class Constraint:
    """A feasibility condition; `fn` returns a violation amount that is <= 0 when the point is feasible."""

    name: str
    metric: str
    unit: str
    fn: MetricFn
