"""Finding generators, cost models and objectives by name through entry points.

A user's own plugin is any installed package that declares the entry-point groups below; nothing is imported
by string from a study file beyond a registered name.
"""

import argparse
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel, ValidationError

from dse.errors import DseError, PluginError, SpecError
from dse.interfaces import CostModel, PreflightCostModel, PreflightGenerator, WorkloadGenerator
from dse.objective import Constraint, Objective
from dse.spec import DesignPoint, default_of
from dse.yamlio import error_field, error_message, load_scalar

GROUPS = {"generator": "dse.generators", "cost model": "dse.simulators", "objective": "dse.objectives"}
DEFAULT_GENERATOR = "symbolic"
DEFAULT_COST_MODEL = "analytical"


def add_arguments(parser: argparse.ArgumentParser, cost_model: bool = True) -> None:
    """A command's --generator (and --cost-model, --cost-option) options, with the defaults studies use; the
    command builds its cost model with `cost_model_of(args)`."""
    parser.add_argument(
        "--generator", default=DEFAULT_GENERATOR, help=f"workload generator plugin (default: {DEFAULT_GENERATOR})"
    )
    if cost_model:
        parser.add_argument(
            "--cost-model", default=DEFAULT_COST_MODEL, help=f"cost model plugin (default: {DEFAULT_COST_MODEL})"
        )
        parser.add_argument(
            "--cost-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a cost-model option, as the study file's cost_model_options (VALUE read as a YAML scalar: "
            "true, 3, 1e-3, text); repeatable",
        )


OPTIONS_FLAG = "--cost-option"


def cost_model_of(args: argparse.Namespace) -> CostModel:
    """The cost model a command's --cost-model and --cost-option ask for (see add_arguments)."""
    return cost_model(args.cost_model, parse_options(args.cost_option), source=OPTIONS_FLAG)


def parse_options(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE strings as options, each value read as a YAML scalar (`exact=true` is the boolean true)."""
    out: dict[str, Any] = {}
    for item in items:
        key, equals, text = item.partition("=")
        if not equals or not key.strip():
            raise SpecError(f"{OPTIONS_FLAG} {item!r}: give KEY=VALUE, e.g. {OPTIONS_FLAG} exact=true")
        out[key.strip()] = load_scalar(text)
    return out


@cache
def _registry(kind: str) -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=GROUPS[kind])}


def available(kind: str) -> list[str]:
    return sorted(_registry(kind))


@cache
def load(kind: str, name: str) -> Any:
    """The class or object registered as `name` in the group of `kind` (see GROUPS); loaded once (a sweep asks for
    each objective at every point)."""
    registry = _registry(kind)
    if name not in registry:
        raise PluginError(f"unknown {kind} '{name}'; installed: {', '.join(sorted(registry)) or 'none'}")
    return registry[name].load()


def generator(name: str) -> WorkloadGenerator:
    return load("generator", name)()


def cost_model(
    name: str, options: Mapping[str, Any] | None = None, source: str = "", field: str = "cost_model_options"
) -> CostModel:
    """The cost model registered as `name`, built with its options: validated by the class's `Options` (a pydantic
    model, every field defaulted) and passed as `cls(options=...)`; without options, `cls()`.

    source and field say where the options came from in the one-line error a bad option gives (the study file and
    'cost_model_options' or 'refine.cost_model_options'; the command line's --cost-option)."""
    cls = load("cost model", name)
    validated = cost_model_options(cls, name, options, source, field)
    return cls() if validated is None else cls(options=validated)


def cost_model_options(
    cls: Any, name: str, options: Mapping[str, Any] | None, source: str = "", field: str = "cost_model_options"
) -> BaseModel | None:
    """The options validated by the cost model class's `Options` (None for no options); a SpecError naming
    `field.<option>` otherwise. A class without `Options` takes none."""
    if not options:
        return None
    where = f"{source}: " if source else ""
    schema = getattr(cls, "Options", None)
    if schema is None:
        raise SpecError(
            f"{where}field '{field}.{next(iter(options))}': cost model '{name}' takes no options; remove {field}"
        )
    try:
        return schema.model_validate(dict(options))
    except ValidationError as exc:
        error = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]  # a misspelt name first
        raise SpecError(f"{where}field '{field}.{error_field(error)}': {error_message(error)}") from None


def refuse_repeated_refiner(
    cost_model: str,
    options: Mapping[str, Any] | None,
    refiner: str,
    refiner_options: Mapping[str, Any] | None,
    source: str,
) -> None:
    """A refinement that prices with the screening cost model and options (the defaults filled in) would only repeat
    the screening figures: a SpecError naming `refine` and what to change."""
    if refiner != cost_model:
        return
    cls = load("cost model", cost_model)
    schema = getattr(cls, "Options", None)
    default = None if schema is None else schema()
    screening = cost_model_options(cls, cost_model, options, source) or default
    refining = cost_model_options(cls, refiner, refiner_options, source, "refine.cost_model_options") or default
    if screening == refining:
        raise SpecError(
            f"{source}: field 'refine': it prices with cost model '{refiner}' and the same options as the screening "
            "(cost_model, cost_model_options), so it would repeat the screened figures; refine with another cost "
            "model or other options (e.g. the analytical model's exact: true), or remove refine"
        )


def unread_fields(generator_name: str) -> Mapping[str, str]:
    """The point fields the generator registered as `generator_name` never reads, each with what to do instead
    (dse.interfaces.FieldReadingGenerator; none for a generator that does not say)."""
    return getattr(load("generator", generator_name), "unread_fields", {})


def refuse_unread_fields(
    generator_name: str,
    values_at: Callable[[str], Sequence[Any] | None],
    source: str,
    field_of: Callable[[str], str] = str,
) -> None:
    """A SpecError if a point or a study sets a field its generator never reads to anything but the default: the
    setting would change nothing. values_at(path): the values the point (or the study's points) can have there, or
    None when that is not known before decoding (a derived value); field_of(path): the field as the file names it
    (e.g. 'base.model.fx_factory')."""
    for path, instead in unread_fields(generator_name).items():
        default = default_of(path)
        given = [value for value in values_at(path) or () if value != default]
        if given:
            raise SpecError(
                f"{source}: field '{field_of(path)}': generator '{generator_name}' never reads it, so {given[0]!r} "
                f"would change nothing; {instead}"
            )


def preflight(
    generator: WorkloadGenerator, cost_models: Mapping[str, CostModel], points: Sequence[DesignPoint]
) -> None:
    """Each plugin's pre-flight (dse.interfaces.PreflightCostModel, PreflightGenerator): what would fail every
    evaluation, found before the first one. cost_models: each by where it was named ('--cost-model analytical',
    'field cost_model'), which the one-line error begins with; the generator's error names its field itself."""
    for where, model in cost_models.items():
        if isinstance(model, PreflightCostModel):
            try:
                model.preflight()
            except DseError as error:
                raise type(error)(f"{where}: {error}") from None
    if isinstance(generator, PreflightGenerator):
        generator.preflight(points)


def objective(name: str) -> Objective | Constraint:
    return load("objective", name)


@cache
def objectives() -> tuple[Objective | Constraint, ...]:
    """Every installed objective and constraint, in name order; found once per process, as the entry points are
    (`_registry`): every priced point asks for them (`dse.point.evaluate.metrics_of`)."""
    return tuple(objective(name) for name in available("objective"))
