"""A study file: what to search (space, derived values), how (sampler, objectives), and decoding trial params.

Decoding is the only bridge from Optuna's flat params to a DesignPoint: start from the expanded base point,
assign every sampled parameter, then every derived value, then validate. A point that cannot run is returned
as its reason (a string) so the study can tell Optuna at once, without spending an evaluation on it.
"""

import ast
import operator
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import optuna
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, PrivateAttr, ValidationError, model_validator

from dse import plugins
from dse.errors import SpecError
from dse.feasibility import infeasibility
from dse.objective import Constraint, Direction, Objective
from dse.points import assign, build_point, expand
from dse.spec import DesignPoint, SystemSpec
from dse.yamlio import describe_validation_error, load_mapping

Value = bool | int | float | str

SUMMARY_FIELDS = (
    "parallel.tp",
    "parallel.pp",
    "parallel.dp",
    "parallel.cp",
    "parallel.zero",
    "parallel.sp",
    "parallel.recompute",
    "workload.micro_batch",
    "system.accelerator.hbm_GiB",
)
"""Recorded for every decoded trial, searched or not: reports show a point's shape from the table alone."""


class Param(BaseModel):
    """One searched field: `{choices: [...]}`, or `{low, high, step?, log?}` (an int range if low and high are
    ints, else a float range)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    choices: list[Value] | None = Field(None, min_length=1)
    low: int | float | None = None
    high: int | float | None = None
    step: int | float | None = None
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> "Param":
        ranged = self.low is not None or self.high is not None or self.step is not None or self.log
        if self.choices is not None:
            if ranged:
                raise ValueError("give either 'choices' or 'low'/'high' (with 'step' or 'log'), not both")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give 'choices: [...]' or both 'low' and 'high'")
        if self.low > self.high:
            raise ValueError(f"low={self.low} is above high={self.high}")
        if self.log and self.step is not None:
            raise ValueError("a range is either log-scaled or stepped, not both; drop 'step' or 'log'")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low}")
        return self

    @property
    def first(self) -> Value:
        return self.choices[0] if self.choices is not None else self.low  # type: ignore[return-value]

    @property
    def is_int(self) -> bool:
        return all(isinstance(v, int) for v in (self.low, self.high, self.step) if v is not None)


class TrackingSpec(BaseModel):
    """How much of a study goes to MLflow. The Parquet table always has every trial; MLflow child runs cost
    ~50 ms each on sqlite and ~260 ms through a server, which a study of 100k trials cannot afford."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    child_runs: Literal["all", "pareto", "none"] = Field(
        "all", description="a child run per trial, only for the Pareto front (written at the end), or none"
    )
    timelines: Literal["none", "pareto"] = Field(
        "none",
        description="pareto: at the end, simulate each Pareto point again with its timeline kept and attach the "
        "Perfetto trace to its child run (seconds per point); none: `dse timeline OUT_DIR` writes them on demand",
    )


class StudySpec(BaseModel):
    """What a study file holds. Load it with `load_study`, which also checks the names and the space."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="also the output folder's name")
    seed: int = 0
    generator: str = "symbolic"
    cost_model: str = "analytical"
    objectives: dict[str, Direction | None] = Field(
        min_length=1, description="objective name -> minimize | maximize (empty: the objective's default)"
    )
    constraints: list[str] = Field(default_factory=lambda: ["fits_memory"])
    sampler: Literal["nsga2", "tpe", "random", "grid"] = "nsga2"
    trials: PositiveInt
    workers: PositiveInt | None = Field(None, description="evaluations in flight; default: the Ray cluster's CPUs")
    storage: str | None = Field(
        None, description="Optuna storage URL (postgresql://, redis://, sqlite:///) or journal file path"
    )
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    base: dict[str, Any] = Field(description="a partial design point, as in studies/points/*.yaml")
    space: dict[str, Param] = Field(min_length=1, description="dotted path -> choices or range")
    derived: dict[str, str] = Field(default_factory=dict, description="dotted path -> arithmetic expression")

    _source: str = PrivateAttr("<study>")

    @property
    def source(self) -> str:
        """The file the spec came from, for error messages."""
        return self._source

    @cached_property
    def expanded_base(self) -> dict[str, Any]:
        return expand(self.base)

    @cached_property
    def expressions(self) -> dict[str, "Expression"]:
        known = set(self.space)
        out = {}
        for path, text in self.derived.items():
            try:
                expr = parse_expression(text)
            except ValueError as exc:
                raise SpecError(f"{self.source}: field 'derived.{path}': {exc}") from None
            unknown = sorted(expr.names - known - {"world"})
            if unknown:
                raise SpecError(
                    f"{self.source}: field 'derived.{path}': '{unknown[0]}' is neither a space parameter "
                    f"nor an earlier derived value nor 'world'; known: {', '.join(sorted(known)) or 'none'}"
                )
            for name in sorted(expr.names & set(self.space)):
                param = self.space[name]
                if param.choices is not None and not all(_is_number(c) for c in param.choices):
                    raise SpecError(
                        f"{self.source}: field 'derived.{path}': parameter '{name}' has non-numeric choices "
                        f"{param.choices}; an expression can only use numeric parameters"
                    )
            out[path] = expr
            known.add(path)
        return out

    @cached_property
    def objective_list(self) -> list[tuple[Objective, Direction]]:
        """Objectives in file order with their directions (an empty direction: the objective's own)."""
        out = []
        for name, direction in self.objectives.items():
            item = _plugin(self.source, f"objectives.{name}", name)
            if not isinstance(item, Objective):
                raise SpecError(
                    f"{self.source}: field 'objectives.{name}': '{name}' is a constraint; list it under 'constraints'"
                )
            out.append((item, direction or item.direction))
        return out

    @cached_property
    def constraint_list(self) -> list[Constraint]:
        out = []
        for index, name in enumerate(self.constraints):
            item = _plugin(self.source, f"constraints.{index}", name)
            if not isinstance(item, Constraint):
                raise SpecError(
                    f"{self.source}: field 'constraints.{index}': '{name}' is an objective; list it under 'objectives'"
                )
            out.append(item)
        return out

    @property
    def directions(self) -> list[Direction]:
        return [direction for _, direction in self.objective_list]

    @property
    def metrics(self) -> list[str]:
        """The evaluation metric of each objective, in the order Optuna's values are told."""
        return [objective.metric for objective, _ in self.objective_list]


def _plugin(source: str, field: str, name: str) -> Objective | Constraint:
    installed = plugins.available("objective")
    if name not in installed:
        raise SpecError(
            f"{source}: field '{field}': unknown objective or constraint '{name}'; installed: {', '.join(installed)}"
        )
    return plugins.objective(name)


def load_study(path: str | Path, **overrides: Any) -> StudySpec:
    """Read and check a study file; every error names the file and the dotted field.

    overrides (e.g. trials=, workers= from the command line) replace file values before validation. The base
    is decoded once with the first value of every parameter so that unknown paths and names fail here, not
    mid-study.
    """
    raw = load_mapping(path)
    raw.update({key: value for key, value in overrides.items() if value is not None})
    try:
        spec = StudySpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(describe_validation_error(exc, str(path))) from None
    spec._source = str(path)
    for field in ("generator", "cost_model"):
        kind = field.replace("_", " ")
        installed = plugins.available(kind)
        if getattr(spec, field) not in installed:
            raise SpecError(
                f"{path}: field '{field}': unknown {kind} '{getattr(spec, field)}'; installed: "
                f"{', '.join(installed) or 'none'}"
            )
    _ = spec.objective_list, spec.constraint_list, spec.expressions  # resolved now so errors surface at load
    for key, value in spec.base.items():
        try:
            expand({key: value})
        except SpecError as exc:
            raise SpecError(f"{path}: field 'base.{key}': {exc}") from None
    if spec.sampler == "grid":
        ranged = [name for name, param in spec.space.items() if param.choices is None]
        if ranged:
            raise SpecError(
                f"{path}: field 'space.{ranged[0]}': the grid sampler needs 'choices' for every "
                f"parameter; list the values or use sampler nsga2, tpe or random"
            )
    decode(spec, {name: param.first for name, param in spec.space.items()})
    return spec


def optuna_distributions(spec: StudySpec) -> dict[str, optuna.distributions.BaseDistribution]:
    out: dict[str, optuna.distributions.BaseDistribution] = {}
    for name, param in spec.space.items():
        if param.choices is not None:
            out[name] = optuna.distributions.CategoricalDistribution(param.choices)
            continue
        low, high = param.low, param.high
        assert low is not None and high is not None  # Param's validator: a range has both
        if param.is_int:
            out[name] = optuna.distributions.IntDistribution(
                int(low), int(high), log=param.log, step=int(param.step or 1)
            )
        else:
            out[name] = optuna.distributions.FloatDistribution(low, high, log=param.log, step=param.step)
    return out


def grid(spec: StudySpec) -> dict[str, list[Value]]:
    """The grid sampler's search space; load_study guarantees every parameter has choices."""
    return {name: list(param.choices or ()) for name, param in spec.space.items()}


def decode(spec: StudySpec, params: Mapping[str, Any]) -> DesignPoint | str:
    """The design point of a trial's params, or the reason it cannot run.

    Params may name catalog entries (`model: {choices: [llama3-8b, llama3-70b]}`): the point is expanded again
    after assignment. A malformed combination raises SpecError naming the study file and the field.
    """
    raw = dict(spec.expanded_base)  # copied on write along each assigned path
    owned = {id(raw)}
    for name, value in params.items():
        try:
            assign(raw, name, value, owned)
        except SpecError as exc:
            raise SpecError(f"{spec.source}: field 'space.{name}': {exc}") from None
    raw = expand(raw)
    env: dict[str, float] = dict(params)
    if any("world" in expr.names for expr in spec.expressions.values()):
        env["world"] = _world(raw, spec.source)
    for path, expr in spec.expressions.items():
        value = expr.evaluate(env)
        if isinstance(value, str):
            return f"derived {path} = {expr.text}: {value}"
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, float) and _is_integer_field(path):
            shown = ", ".join(f"{name}={env[name]}" for name in sorted(expr.names))
            return f"derived {path} = {expr.text} = {value:.3g} ({shown}) is not a whole number"
        env[path] = value
        try:
            assign(raw, path, value, owned)
        except SpecError as exc:
            raise SpecError(f"{spec.source}: field 'derived.{path}': {exc}") from None
    point = build_point(raw, f"{spec.source} (base with space and derived applied)")
    return infeasibility(point) or point


def point_fields(point: DesignPoint, paths: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """The values at dotted paths of a point, e.g. {'parallel.tp': 8}; a path the point lacks is left out."""
    data = point.model_dump(mode="json")
    out = {}
    for path in paths:
        node: Any = data
        for part in path.split("."):
            node = node[int(part)] if isinstance(node, list) else node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if node is not None:
            out[path] = node
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _world(raw: dict[str, Any], source: str) -> int:
    """NPUs of the system as the space left it; a malformed system is reported as build_point reports it."""
    try:
        return SystemSpec.model_validate(raw.get("system")).npus
    except ValidationError:
        build_point(raw, f"{source} (base with space applied)")
        raise


def _unwrap(annotation: Any) -> Any:
    """Strip Annotated[...] constraints and an Optional's None from a field's annotation."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def _is_integer_field(path: str) -> bool:
    """Whether DesignPoint's field at a dotted path holds integers (PositiveInt, Literal[0, 1, 2, 3], ...)."""
    node: Any = DesignPoint
    for part in path.split("."):
        node = _unwrap(node)
        if isinstance(node, type) and issubclass(node, BaseModel):
            if part not in node.model_fields:
                return False
            node = node.model_fields[part].annotation
        elif get_origin(node) in (list, dict):
            node = get_args(node)[-1]
        else:
            return False
    node = _unwrap(node)
    if get_origin(node) is Literal:
        return all(isinstance(a, int) and not isinstance(a, bool) for a in get_args(node))
    return node is int


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = "numbers, parameter names, world, + - * / // % and parentheses"


@dataclass(frozen=True)
class Expression:
    """Arithmetic over dotted names, checked node by node when parsed and then walked, never eval'd."""

    text: str
    tree: ast.expr
    names: frozenset[str]

    def evaluate(self, env: Mapping[str, float]) -> float | str:
        """The value, or why there is none (division by zero) as a string."""
        try:
            return _walk(self.tree, env)
        except ZeroDivisionError:
            return "division by zero"


def parse_expression(text: str) -> Expression:
    """Parse `world / (parallel.tp * parallel.pp)`; anything beyond arithmetic raises ValueError saying so."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {text!r} ({exc.msg}); use {_ALLOWED}") from None
    names: set[str] = set()
    _check(tree, names)
    return Expression(text, tree, frozenset(names))


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _check(node: ast.expr, names: set[str]) -> None:
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check(node.left, names)
        _check(node.right, names)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        _check(node.operand, names)
    elif isinstance(node, ast.Constant):
        if not _is_number(node.value):
            raise ValueError(f"{node.value!r} is not a number; use {_ALLOWED}")
    elif isinstance(node, ast.Name | ast.Attribute) and (name := _dotted(node)) is not None:
        names.add(name)
    else:
        raise ValueError(f"'{ast.unparse(node)}' is not allowed; use {_ALLOWED}")


def _walk(node: ast.expr, env: Mapping[str, float]) -> float:
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_walk(node.left, env), _walk(node.right, env))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_walk(node.operand, env))
    if isinstance(node, ast.Constant):
        return node.value
    return env[_dotted(node)]  # type: ignore[index]
