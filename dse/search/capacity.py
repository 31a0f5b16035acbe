"""Feasibility-only dimensions: one evaluation per configuration, whatever HBM capacity the point has.

A study that searches HBM sizes beside the parallel layout evaluates the same step once per size, though the size
changes nothing of the step: no generator or cost model reads it, and peak memory is what the step needs, not what
the device holds (the issue measured 60 of 324 random trials on the quickstart as the same configuration at another
HBM size). A dimension declared `feasibility_only: true` in the study's space is evaluated at its largest value (a
cost model that refused points over capacity would refuse none there), and the result at any other value is that
evaluation's with the capacity-dependent figures recomputed: `hbm_bytes`, the memory constraint's excess (peak
memory minus the capacity, as objectives/metrics.py's fits_memory defines it) and `fits_memory`. The study file is
checked at load (space.py) for the conditions that make this exact: the field is one no plugin reads, no derived
value uses it, and the memory constraint is the study's only one.
"""

from typing import Any

from dse.search.executor import Result
from dse.search.space import MEMORY_CONSTRAINT, StudySpec, feasibility_only
from dse.spec import DesignPoint


def canonical(spec: StudySpec, params: dict[str, Any]) -> dict[str, Any]:
    """The params evaluated for `params`: each feasibility-only dimension at its largest value."""
    return {**params, **{name: param.largest for name, param in feasibility_only(spec).items()}}


def at_capacity(spec: StudySpec, result: Result, point: DesignPoint) -> Result:
    """An evaluation's result (of any point of the same configuration) as it is for `point`'s HBM capacity."""
    metrics = dict(result["metrics"])
    violations = dict(result["violations"])
    metrics["hbm_bytes"] = point.system.accelerator.hbm_bytes
    for constraint in spec.constraint_list:
        if constraint.name == MEMORY_CONSTRAINT:  # against every memory tier, as fits_memory counts them
            excess = metrics["peak_memory_bytes"] - point.system.accelerator.memory_bytes
            metrics[constraint.metric] = violations[constraint.name] = excess
    metrics["fits_memory"] = all(v <= 0 for v in violations.values())
    return {**result, "metrics": metrics, "violations": violations}
