"""Checks that keep a study's space what its file says, run when the study loads (`space.load_study`).

Optuna takes a range whose step does not fit it by shrinking the range (a step of 8 on 1..4 leaves the single value
1) with a warning of its own as the only notice, and a derived value that sets a searched field replaces every value
the search picks while the trials record the picked ones (16 GPUs shown for a point that has 8). Each of these is
refused here in one line naming the file, the field and the numbers; a derived value that no combination of the
parameters it uses can give a usable value (`world / 0`, a fraction for a degree) is refused too, rather than
pruning every trial of the study.
"""

from collections.abc import Mapping
from decimal import Decimal
from itertools import product
from math import prod
from typing import Any, Protocol

from pydantic import ValidationError

from dse.errors import SpecError
from dse.limits import MAX_GRID_SEARCH, MAX_LOCAL_VALUES, MAX_RANGE_VALUES, MAX_TRIALS
from dse.search import decoding
from dse.search.decoding import Value, derived_value, is_integer_field
from dse.system import SystemSpec


class Param(decoding.Searched, Protocol):
    """A searched parameter as these checks read it (params.Param), named here so that the study file's module can
    use them without an import circle."""

    @property
    def low(self) -> int | float | None: ...
    @property
    def high(self) -> int | float | None: ...
    @property
    def step(self) -> int | float | None: ...
    @property
    def is_int(self) -> bool: ...
    @property
    def size(self) -> int | None: ...
    @property
    def repeated(self) -> list[Value]: ...


class StudySpec(decoding.StudySpec, Protocol):
    """What these checks read of a study (space.StudySpec): what decoding reads, and the rest of the space."""

    @property
    def sampler(self) -> str: ...
    @property
    def sweep(self) -> bool: ...
    @property
    def space(self) -> Mapping[str, Param]: ...
    @property
    def derived(self) -> Mapping[str, str]: ...


DERIVED_EVALUATIONS = 100_000
"""Derived values computed at most when the study loads to find one that no point can use (parameter combinations
times derived values, tens of milliseconds); a larger space is left to its trials, which are pruned with the reason."""


def check_ranges(spec: StudySpec) -> None:
    """Every range holds the values its file states: whole ends and step for a field of whole numbers, a step no
    larger than the range that divides it exactly, and at most MAX_RANGE_VALUES steps of a float range."""
    for name, param in spec.space.items():
        if param.choices is not None:
            continue
        where = f"{spec.source}: field 'space.{name}'"
        low, high, step = param.low, param.high, param.step
        assert low is not None and high is not None  # Param's validator: a range has both
        if not param.is_int and is_integer_field(name):
            fractional = [f"{label} {value!r}" for label, value in _ends(param) if not isinstance(value, int)]
            raise SpecError(
                f"{where}: {name} holds whole numbers, so a range of it needs whole low and high (and step), not "
                f"{' and '.join(fractional)}; write them whole (2, not 2.0), or list the values as choices"
            )
        if step is None:
            continue
        if high == low:
            raise SpecError(
                f"{where}: the range {low!r}..{high!r} holds one value, so it takes no step; remove step (or list "
                "the value as choices)"
            )
        span = _difference(param)
        if step > span:
            raise SpecError(
                f"{where}: step {step!r} is larger than the range {low!r}..{high!r}, which would hold its low end "
                f"alone; use a step of at most {span!r}, or list the values as choices"
            )
        if not param.is_int and span / step > MAX_RANGE_VALUES:
            raise SpecError(
                f"{where}: step {step!r} cuts the range {low!r}..{high!r} into {span / step:.3g} values, over "
                f"the limit of {MAX_RANGE_VALUES:,} (README: Limits); leave step out for a continuous range, or use "
                "a larger step"
            )
        last = _last_step(param)
        if last != high:
            raise SpecError(
                f"{where}: the range {low!r}..{high!r} is not a whole number of steps of {step!r}, so its values "
                f"would stop at {last!r}; end it at {last!r} or {_next_step(param, last)!r}, or use a step that "
                f"divides {span!r}"
            )


def _ends(param: Param) -> list[tuple[str, Any]]:
    return [
        (label, value)
        for label, value in (("low", param.low), ("high", param.high), ("step", param.step))
        if value is not None
    ]


def _difference(param: Param) -> int | float:
    """high - low, computed as Optuna computes it (in decimal, from the numbers as written)."""
    if param.is_int:
        return int(param.high) - int(param.low)  # type: ignore[arg-type]
    return float(Decimal(str(param.high)) - Decimal(str(param.low)))


def _last_step(param: Param) -> int | float:
    """The largest value low + k * step not above high: where Optuna ends the range (its own decimal arithmetic)."""
    low, high, step = param.low, param.high, param.step
    assert low is not None and high is not None and step is not None
    if param.is_int:
        return int(low) + (int(high) - int(low)) // int(step) * int(step)
    d_low, d_step = Decimal(str(low)), Decimal(str(step))
    d_range = Decimal(str(high)) - d_low
    return high if d_range % d_step == 0 else float((d_range // d_step) * d_step + d_low)


def _next_step(param: Param, last: int | float) -> int | float:
    assert param.step is not None
    if param.is_int:
        return int(last) + int(param.step)
    return float(Decimal(str(last)) + Decimal(str(param.step)))


def check_sampler_sizes(spec: StudySpec, size: int | None) -> None:
    """A grid searched trial by trial has at most MAX_GRID_SEARCH points (Optuna's grid sampler lists them all);
    the local sampler's neighbourhood, all values of all parameters, at most MAX_LOCAL_VALUES."""
    where = f"{spec.source}: field"
    if spec.sampler == "grid" and not spec.sweep and (size or 0) > MAX_GRID_SEARCH:
        fix = (
            "price it whole with sweep: true (and no trials), or drop choices"
            if (size or 0) <= MAX_TRIALS
            else f"it is over the sweep limit of {MAX_TRIALS:,} too: drop choices, or search it with sampler nsga2, "
            "tpe or random and a budget"
        )
        raise SpecError(
            f"{where} 'space': the grid has {size:,} points, over the limit of {MAX_GRID_SEARCH:,} for a grid searched "
            f"trial by trial (README: Limits), whose sampler lists every point; {fix}"
        )
    if spec.sampler == "local":
        sizes = {name: param.size or 0 for name, param in spec.space.items()}
        if (values := sum(sizes.values())) > MAX_LOCAL_VALUES:
            longest = max(sizes, key=sizes.__getitem__)
            raise SpecError(
                f"{where} 'space.{longest}': the local sampler walks every neighbour of each front point (one field "
                f"changed), and the space's {values:,} values ({sizes[longest]:,} of them here) are over its limit of "
                f"{MAX_LOCAL_VALUES:,} (README: Limits); give the range a step, or use sampler tpe or nsga2"
            )


def check_overlaps(spec: StudySpec) -> None:
    """Each field is set by one thing: a derived value may not set a searched field (it would replace every value
    the search picks, and the trials would record values their points do not have), and a searched field may not
    lie within another (a catalog name chosen whole replaces it, or it cannot be reached)."""
    for path in spec.derived:
        if path in spec.space:
            raise SpecError(
                f"{spec.source}: field 'derived.{path}': {path} is also searched (space.{path}); the derived value "
                "would replace every value the search picks, and the trials would record values their points do not "
                "have: remove it from space or from derived"
            )
    for name in spec.space:
        outer = [other for other in spec.space if name.startswith(f"{other}.")]
        if outer:
            raise SpecError(
                f"{spec.source}: field 'space.{name}': it lies within space.{outer[0]}, which the search sets whole, "
                f"so a point cannot have both; search one of them (set the other in base, or as a derived value)"
            )


def check_derived_values(spec: StudySpec) -> None:
    """Refuse a derived value that no point of the study can use: computed for every combination of the values of
    the parameters the derived values use (when those are few enough to list and `world` is the base's), it is
    a division by zero, not finite, or a fraction for a field of whole numbers in all of them. Where some
    combination works, the others are pruned trial by trial, with the reason, as points that cannot run."""
    if not spec.expressions:
        return
    used = sorted({name for expr in spec.expressions.values() for name in expr.names} & set(spec.space))
    values = [_listed(spec.space[name]) for name in used]
    listed = [v for v in values if v is not None]
    if len(listed) < len(values) or prod(map(len, listed)) * len(spec.expressions) > DERIVED_EVALUATIONS:
        return
    env: dict[str, Any] = {}
    if any("world" in expr.names for expr in spec.expressions.values()):
        world = _base_world(spec)
        if world is None:
            return
        env["world"] = world
    usable: set[str] = set()
    reasons: dict[str, str] = {}
    for combination in product(*listed):
        point_env = {**env, **dict(zip(used, combination, strict=True))}
        for path, expr in spec.expressions.items():
            value = derived_value(path, expr, point_env)
            if isinstance(value, str):
                reasons.setdefault(path, value)
                break
            usable.add(path)
            point_env[path] = value
    depends: dict[str, set[str]] = {}
    for path, expr in spec.expressions.items():
        depends[path] = {n for name in expr.names for n in depends.get(name, {name})} & set(spec.space)
        if path not in usable:
            where = f"{spec.source}: field 'derived.{path}'"
            if not depends[path]:
                raise SpecError(f"{where}: {reasons[path]} at every point of the study; change the expression")
            raise SpecError(
                f"{where}: no point of the study can use it ({reasons[path]}, and likewise for every value of "
                f"{', '.join(sorted(depends[path]))}); change the expression or those values"
            )


def _listed(param: Param) -> list[Any] | None:
    """The values of a parameter when they can be listed (choices, an integer range), else None."""
    if param.choices is not None:
        return list(param.choices)
    size = param.size
    if size is None or size > DERIVED_EVALUATIONS:
        return None
    return list(range(int(param.low), int(param.high) + 1, int(param.step or 1)))  # type: ignore[arg-type]


def _base_world(spec: StudySpec) -> int | None:
    """NPUs of the base's system when no searched or derived field can change it, else None."""
    if any(is_system_field(path) for path in [*spec.space, *spec.derived]):
        return None
    try:
        return SystemSpec.model_validate(spec.expanded_base.get("system")).npus
    except ValidationError:  # decoding the first point reports it, naming the field
        return None


def is_system_field(path: str) -> bool:
    """Whether a dotted path is the point's system or within it: what a sweep prices in batches per structure."""
    return path == "system" or path.startswith("system.")


def repeated_choices(spec: StudySpec) -> list[str]:
    """A warning line for each parameter whose choices repeat one (kept once, in its first place)."""
    out = []
    for name, param in spec.space.items():
        if param.repeated:
            shown = ", ".join(map(repr, param.repeated))
            verb = "repeats an earlier choice" if len(param.repeated) == 1 else "repeat earlier choices"
            out.append(
                f"warning: {spec.source}: field 'space.{name}': {shown} {verb}; each is searched once: {param.choices}"
            )
    return out
