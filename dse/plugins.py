"""Finding generators, cost models and objectives by name through entry points.

A user's own plugin is any installed package that declares the entry-point groups below; nothing is imported
by string from a study file beyond a registered name.
"""

from functools import cache
from importlib.metadata import entry_points
from typing import Any

from dse.errors import PluginError
from dse.interfaces import CostModel, WorkloadGenerator
from dse.objective import Constraint, Objective

GROUPS = {"generator": "dse.generators", "cost model": "dse.simulators", "objective": "dse.objectives"}


@cache
def _registry(kind: str) -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=GROUPS[kind])}


def available(kind: str) -> list[str]:
    return sorted(_registry(kind))


def _load(kind: str, name: str) -> Any:
    registry = _registry(kind)
    if name not in registry:
        raise PluginError(f"unknown {kind} '{name}'; installed: {', '.join(sorted(registry)) or 'none'}")
    return registry[name].load()


def generator(name: str) -> WorkloadGenerator:
    return _load("generator", name)()


def cost_model(name: str) -> CostModel:
    return _load("cost model", name)()


def objective(name: str) -> Objective | Constraint:
    return _load("objective", name)


def objectives() -> list[Objective | Constraint]:
    """Every installed objective and constraint, in name order."""
    return [objective(name) for name in available("objective")]
