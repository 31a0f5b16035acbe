"""Decoding trial params into a DesignPoint: the only bridge from Optuna's flat params to a point.

Start from the study's expanded base point, assign every sampled parameter, then every derived value, then
validate. A point that cannot run is returned as its reason (a string), so the study can tell Optuna at once without
spending an evaluation on it; a malformed value raises SpecError naming the study file and the field. `vary`, the
check `load_study` runs on a study's first point and each value beside it, decodes the same way.
"""

import copy
import math
import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Protocol, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from dse.errors import SpecError
from dse.point.described import complete_model
from dse.point.feasibility import infeasibility
from dse.point.points import assign, build_point, expand, validated_system
from dse.search.expressions import Expression
from dse.spec import DesignPoint, without_ignored_settings
from dse.system import SystemSpec
from dse.yamlio import describe_validation_error, error_field, error_message

Value = bool | int | float | str


class Searched(Protocol):
    """A searched parameter as decoding reads it (params.Param)."""

    @property
    def first(self) -> Value: ...
    @property
    def choices(self) -> list[Value] | None: ...
    @property
    def values(self) -> list[Value]: ...


class StudySpec(Protocol):
    """What decoding reads of a study (space.StudySpec), named here so that the study file's module can use
    decoding without an import circle."""

    @property
    def source(self) -> str: ...
    @property
    def space(self) -> Mapping[str, Searched]: ...
    @property
    def expanded_base(self) -> dict[str, Any]: ...
    @property
    def expressions(self) -> Mapping[str, Expression]: ...
    @property
    def generator(self) -> str: ...


def vary(spec: StudySpec) -> list[tuple[str, Value, DesignPoint | str]]:
    """The points that vary one parameter at a time from the first point (every choice, both ends of every
    range), each with the parameter and value it varies, as a point or the reason it cannot run.

    A value that its field rejects on its own (`parallel.zero: 7`, an unknown catalog name, a degree of 0)
    raises SpecError naming the file, the parameter and the value; a value that only fails beside the others
    (a tp that does not divide these heads) is a reason, as it would be mid-study."""
    firsts = {name: param.first for name, param in spec.space.items()}
    out: list[tuple[str, Value, DesignPoint | str]] = []
    for name, param in spec.space.items():
        labels = ["choice"] * len(param.choices) if param.choices is not None else ["low", "high"]
        for label, value in zip(labels, param.values, strict=True):
            where = f"{spec.source}: field 'space.{name}': {label} {value!r}"
            params = {**firsts, name: value}
            try:  # the value alone first: a derived value it breaks (a division by 0) must not hide it
                own = _own_errors(_assemble(spec, params, derive=False), name)
                raw = _assemble(spec, params)
            except SpecError as exc:
                raise located(exc, spec.source, where) from None
            if own:
                field = error_field(own[0])
                raise SpecError(f"{where}{f' ({field})' if field != name else ''}: {error_message(own[0])}")
            if isinstance(raw, str):
                out.append((name, value, raw))
                continue
            try:
                point = DesignPoint.model_validate(raw)
            except ValidationError as exc:
                out.append((name, value, describe_validation_error(exc, "with the first value of the others")))
                continue
            out.append((name, value, infeasibility(point) or point))
    return out


def _own_errors(raw: Any, path: str) -> list[ErrorDetails]:
    """The validation errors of the point data's field at a dotted path, or of a field within it."""
    try:
        DesignPoint.model_validate(raw)
    except ValidationError as exc:
        return [e for e in exc.errors() if f"{error_field(e)}.".startswith(f"{path}.")]
    return []


def located(exc: SpecError, source: str, where: str) -> SpecError:
    """exc, its message led by `where` unless it already names the source file."""
    message = str(exc)
    return exc if message.startswith(source) else SpecError(f"{where}: {message}")


def decode(spec: StudySpec, params: Mapping[str, Any]) -> DesignPoint | str:
    """The design point of a trial's params, or the reason it cannot run.

    Params may name catalog entries (`model: {choices: [llama3-8b, llama3-70b]}`): the point is expanded again
    after assignment. A malformed combination raises SpecError naming the study file and the field.
    """
    point = decode_point(spec, params)
    return point if isinstance(point, str) else infeasibility(point) or point


def decode_point(spec: StudySpec, params: Mapping[str, Any], system: SystemSpec | None = None) -> DesignPoint | str:
    """`decode` before the feasibility rules: the valid point of a trial's params, or why a derived value has none;
    raises SpecError as decode does. A field the point would ignore (a decode pool's degrees on an aggregated
    point, set because the study searches them for its disaggregated points) is left at what gives the same step,
    so that trials of one point have one key and are priced and shown once. `system`, where the caller has decoded
    the params' system already (`decode_system`: a sweep's), is used as it is (no derived value sets a system
    field) instead of being validated again."""
    try:
        raw = _assemble(spec, params, world=system.npus if system is not None else None)
    except SpecError as exc:  # a catalog name among the params that the catalog lacks
        raise located(exc, spec.source, spec.source) from None
    if isinstance(raw, str):
        return raw
    if system is not None:
        raw["system"] = system
    return without_ignored_settings(build_point(raw, f"{spec.source} (base with space and derived applied)"))


def decode_system(spec: StudySpec, params: Mapping[str, Any]) -> SystemSpec:
    """The system of the base with `params` (system fields only) applied: what every point with those values runs
    on, decoded once for all of them by a sweep. Raises SpecError naming the field, as decode does."""
    try:
        raw = _assemble(spec, params, derive=False)
    except SpecError as exc:
        raise located(exc, spec.source, spec.source) from None
    try:
        return SystemSpec.model_validate(raw.get("system"))
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(["system", *(str(part) for part in error["loc"])])
        raise SpecError(f"{spec.source} (base with space applied): field '{field}': {error_message(error)}") from None


def _assemble(
    spec: StudySpec, params: Mapping[str, Any], derive: bool = True, world: int | None = None
) -> dict[str, Any] | str:
    """The point data of a trial's params (base, params, and derived values unless derive is false), not yet
    validated, or the reason a derived value has none; `world` is the system's NPUs where the caller knows them."""
    raw = _base_for(spec, params)  # copied on write along each assigned path
    owned = {id(raw)}
    for name, value in params.items():
        try:
            assign(raw, name, value, owned)
        except SpecError as exc:
            raise SpecError(f"{spec.source}: field 'space.{name}': {exc}") from None
    raw = expand(raw)
    if not derive:
        return raw
    env: dict[str, float] = dict(params)
    for path, expr in spec.expressions.items():
        if "world" in expr.names and "world" not in env:  # the system as the params and earlier derived values left it
            env["world"] = world if world is not None else _world(raw, spec.source)
        value = derived_value(path, expr, env)
        if isinstance(value, str):
            return value
        env[path] = value
        try:
            assign(raw, path, value, owned)
        except SpecError as exc:
            raise SpecError(f"{spec.source}: field 'derived.{path}': {exc}") from None
    return complete_model(raw, spec.generator)  # the model's code fills and checks its fields (generator fx)


def _base_for(spec: StudySpec, params: Mapping[str, Any]) -> dict[str, Any]:
    """The base point the params are assigned onto: expanded, but for a section whose catalog entry is searched
    (`system.base`, `system.accelerator.base`, `model.base`) the base file's own overrides of it, unexpanded, so
    that they override the searched entry (the expanded section would carry every field of the base's entry, and
    they would override it instead: a searched `system.base` with `system: {base: dgx-1}` in base stayed DGX-1)."""
    raw = dict(spec.expanded_base)
    for section in {name.split(".")[0] for name in params if name.endswith(".base") and "." in name}:
        own = spec.base.get(section)
        raw[section] = {"base": own} if isinstance(own, str) else copy.deepcopy(own or {})
    return raw


def derived_value(path: str, expr: Expression, env: Mapping[str, Any]) -> int | float | str:
    """The value of the derived value at `path` given the parameters (and earlier derived values, and `world`) in
    `env`, or the reason it has none: a division by zero, a non-finite result, a fraction for a field of whole
    numbers. A whole float is returned as an int."""
    value = expr.evaluate(env)
    if isinstance(value, str):
        return f"derived {path} = {expr.text}: {value}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"derived {path} = {expr.text} is {value}, not a finite number"
    if isinstance(value, float) and is_integer_field(path):
        shown = ", ".join(f"{name}={env[name]}" for name in sorted(expr.names))
        return f"derived {path} = {expr.text} = {value:.3g} ({shown}) is not a whole number"
    return value


def point_fields(point: DesignPoint, paths: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """The values at dotted paths of a point, e.g. {'parallel.tp': 8}; a path the point lacks is left out. Only the
    sections the paths name are dumped (a system's measured tables are thousands of rows)."""
    sections = {path.split(".")[0] for path in paths}
    return fields_at(point.model_dump(mode="json", include=sections), paths)


def fields_at(data: dict[str, Any], paths: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """The values at dotted paths of a point's (or part of a point's) JSON data; a path it lacks is left out."""
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


def _world(raw: dict[str, Any], source: str) -> int:
    """NPUs of the system as the space and the derived values so far left it (a derived node count before
    `parallel.dp: world / ...` counts); a malformed system is reported as build_point reports it."""
    try:
        return validated_system(raw.get("system")).npus
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


def is_integer_field(path: str) -> bool:
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
