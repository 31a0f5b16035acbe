"""Finding generators, cost models and objectives by name through entry points.

A user's own plugin is any installed package that declares the entry-point groups below; nothing is imported
by string from a study file beyond a registered name.
"""

import argparse
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from dse.errors import PluginError
from dse.interfaces import CostModel, WorkloadGenerator
from dse.objective import Constraint, Objective

GROUPS = {"generator": "dse.generators", "cost model": "dse.simulators", "objective": "dse.objectives"}
DEFAULT_GENERATOR = "symbolic"
DEFAULT_COST_MODEL = "analytical"


def add_arguments(parser: argparse.ArgumentParser, cost_model: bool = True) -> None:
    """A command's --generator (and --cost-model) options, with the defaults studies use."""
    parser.add_argument(
        "--generator", default=DEFAULT_GENERATOR, help=f"workload generator plugin (default: {DEFAULT_GENERATOR})"
    )
    if cost_model:
        parser.add_argument(
            "--cost-model", default=DEFAULT_COST_MODEL, help=f"cost model plugin (default: {DEFAULT_COST_MODEL})"
        )


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
