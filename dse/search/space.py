"""A study file: what to search (space, derived values), how (sampler, objectives), and decoding trial params.

Decoding is the only bridge from Optuna's flat params to a DesignPoint: start from the expanded base point,
assign every sampled parameter, then every derived value, then validate. A point that cannot run is returned
as its reason (a string) so the study can tell Optuna at once, without spending an evaluation on it.
"""

import importlib.util
from functools import cached_property, partial
from math import prod
from pathlib import Path
from typing import Annotated, Any, Literal

import optuna
from annotated_types import Ge, Le
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
)

from dse import plugins
from dse.errors import SpecError
from dse.fields import Count, Whole
from dse.limits import MAX_CHOICES, MAX_NAME_CHARS, MAX_SEARCHED, MAX_SEED, MAX_TRIALS, MAX_WORKERS
from dse.objective import Constraint, Direction, Objective
from dse.point.points import FILE_FIELDS, check_tables, expand, file_path_from, with_paths_from
from dse.search import bounds
from dse.search.bounds import is_system_field
from dse.search.decoding import Value, decode, vary
from dse.search.expressions import Expression, is_number, parse_expression
from dse.search.params import Param
from dse.search.report_spec import ReportSpec, check_report, leaf_paths
from dse.spec import IGNORED_RULES, DesignPoint, Refinement, default_of
from dse.yamlio import describe_validation_error, load_mapping

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
    "workload.serving.kind",
    *(f"workload.serving.decode.{degree}" for degree in ("dp", "tp", "pp", "ep")),
)
"""Recorded for every decoded trial, searched or not: reports show a point's shape from the table alone."""


class TrackingSpec(BaseModel):
    """How much of a study goes to MLflow. The Parquet table always has every trial; MLflow child runs cost
    ~50 ms each on sqlite and ~260 ms through a server, which a study of 100k trials cannot afford."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    child_runs: Literal["all", "pareto", "none"] = Field(
        "all", description="a child run per trial, only for the Pareto front (written at the end), or none"
    )
    timelines: Literal["none", "pareto"] = Field(
        "none",
        description="pareto: at the end, simulate each Pareto point again with its timeline kept and attach the "
        "Perfetto trace to its child run (seconds per point); none: `dse timeline OUT_DIR` writes them on demand",
    )


class RefineSpec(BaseModel):
    """A multi-fidelity study's second cost model: after the search (and every `every` evaluations), the
    Pareto members and the `top_k` best feasible points per objective are priced again with it
    (`dse.search.refine`), both results kept."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    cost_model: str = Field(description="the refining cost model's entry point in group dse.simulators")
    cost_model_options: dict[str, Any] = Field(default_factory=dict, description="its options, as cost_model_options")
    top_k: Annotated[Whole, Ge(0), Le(MAX_TRIALS)] = Field(
        10, description="best feasible points per objective refined besides the Pareto members (0: the front only)"
    )
    every: Annotated[Count, Le(MAX_TRIALS)] | None = Field(
        None, description="also refine after every N evaluations (default: only after the search)"
    )
    serving_depth: Literal["events"] | None = Field(
        None,
        description="serving points: refine at this depth (the request-level event simulation, for percentiles "
        "and queueing) as well as with the cost model, which may then be the screening one",
    )


def _expression_text(value: Any) -> Any:
    """A derived value written as a bare number (`system.network.1.bandwidth_GBps: 50`) is the expression `50`."""
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


class StudySpec(BaseModel):
    """What a study file holds. Load it with `load_study`, which also checks the names and the space."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=MAX_NAME_CHARS, description="also the output folder's name"
    )
    seed: Whole = Field(0, ge=0, le=MAX_SEED)
    generator: str = plugins.DEFAULT_GENERATOR
    cost_model: str = plugins.DEFAULT_COST_MODEL
    cost_model_options: dict[str, Any] = Field(
        default_factory=dict, description="the cost model's options (its Options class), e.g. {exact: true}"
    )
    refine: RefineSpec | None = Field(None, description="re-price the best points with a second cost model")
    objectives: dict[str, Direction | None] = Field(
        min_length=1, description="objective name -> minimize | maximize (empty: the objective's default)"
    )
    constraints: list[str] = Field(default_factory=lambda: ["fits_memory"])
    sampler: Literal["nsga2", "nsga3", "tpe", "gp", "random", "grid", "local"] = "nsga2"
    population_size: Annotated[Count, Ge(2), Le(MAX_TRIALS)] | None = Field(
        None, description="trials per generation of nsga2 and nsga3 (default: Optuna's 50)"
    )
    trials: Annotated[Count, Le(MAX_TRIALS)] | None = Field(
        None,
        description="the budget: distinct evaluations (a trial that repeats an evaluated point or is pruned before "
        "evaluation does not count); required unless `sweep`",
    )
    sweep: bool = Field(
        False,
        description="with sampler grid: price every point of the grid in batches (dse.search.sweep), without an "
        "Optuna trial per point; no `trials` budget",
    )
    workers: Annotated[Count, Le(MAX_WORKERS)] | None = Field(
        None, description="evaluations in flight; default: the Ray cluster's CPUs"
    )
    storage: str | None = Field(
        None, description="Optuna storage URL (postgresql://, redis://, sqlite:///) or journal file path"
    )
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    base: dict[str, Any] = Field(description="a partial design point, as in studies/points/*.yaml")
    space: dict[str, Param] = Field(min_length=1, description="dotted path -> choices or range")
    derived: dict[str, Annotated[str, BeforeValidator(_expression_text)]] = Field(
        default_factory=dict, description="dotted path -> arithmetic expression (a number is one too)"
    )
    report: ReportSpec | None = Field(None, description="plots `dse run` and `dse report` draw (line, heatmap, bar)")

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
            for name in sorted(expr.numeric & set(self.space)):
                param = self.space[name]
                if param.choices is not None and not all(is_number(c) for c in param.choices):
                    raise SpecError(
                        f"{self.source}: field 'derived.{path}': parameter '{name}' has non-numeric choices "
                        f"{param.choices}; an expression can only use numeric parameters, or compare one with a value "
                        f"({name} == {param.choices[0]!r})"
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
    is decoded with the first value of every parameter, then with every other value of each parameter in turn
    (`vary`), so that unknown paths and names, and values their fields reject, fail here rather than prune
    every trial that draws them.
    """
    raw = _with_absolute_paths(load_mapping(path), Path(path).parent)
    raw.update({key: value for key, value in overrides.items() if value is not None})
    try:
        spec = StudySpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(describe_validation_error(exc, str(path))) from None
    spec._source = str(path)
    for field, entries in (("space", spec.space), ("derived", spec.derived)):
        if len(entries) > MAX_SEARCHED:
            raise SpecError(
                f"{path}: field '{field}': {len(entries):,} entries is over the limit of {MAX_SEARCHED} (README: "
                "Limits); search fewer fields, and set the rest in base"
            )
    models = [("generator", spec.generator, None), ("cost_model", spec.cost_model, spec.cost_model_options)]
    if spec.refine is not None:
        models.append(("refine.cost_model", spec.refine.cost_model, spec.refine.cost_model_options))
    for field, name, options in models:
        kind = "generator" if field == "generator" else "cost model"
        installed = plugins.available(kind)
        if name not in installed:
            raise SpecError(
                f"{path}: field '{field}': unknown {kind} '{name}'; installed: {', '.join(installed) or 'none'}"
            )
        if options is not None:  # checked now, not by every evaluation (and every Ray worker) later
            plugins.cost_model_options(plugins.load("cost model", name), name, options, str(path), f"{field}_options")
    if (refine := spec.refine) is not None and refine.serving_depth is None:
        plugins.refuse_repeated_refiner(
            spec.cost_model, spec.cost_model_options, refine.cost_model, refine.cost_model_options, str(path)
        )
    _ = spec.objective_list, spec.constraint_list, spec.expressions  # resolved now so errors surface at load
    try:
        expand(spec.base, where="base.")
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    plugins.refuse_unread_fields(  # a field the generator never reads, set in base or searched in space
        spec.generator,
        partial(_possible, spec),
        str(path),
        lambda at: f"{'space' if at in spec.space else 'base'}.{at}",
    )
    bounds.check_ranges(spec)
    bounds.check_overlaps(spec)
    _check_sampler(spec)
    _check_budget(spec)
    if (values := sum(len(param.values) for param in spec.space.values())) > MAX_CHOICES:
        raise SpecError(
            f"{path}: field 'space': {values:,} choices and range ends over all parameters is over the limit of "
            f"{MAX_CHOICES:,} (README: Limits); use ranges for the long ones"
        )
    _check_feasibility_only(spec)
    bounds.check_derived_values(spec)
    first = decode(spec, {name: param.first for name, param in spec.space.items()})
    points = [first, *(outcome for _, _, outcome in vary(spec))]
    tables = {
        (
            point.system.accelerator.measured_table,
            point.system.accelerator.reads_tables
            and point.system.accelerator.model_dump_json(include={"kernel_tables"}),
            point.model.dtype,
            point.workload.attention_kernel,
        ): point
        for point in points
        if isinstance(point, DesignPoint)
    }
    for point in tables.values():  # each measured kernel table read once now, not by every trial
        check_tables(point)
    decoded = [point for point in points if isinstance(point, DesignPoint)]
    _check_serving(spec, decoded)
    _check_needs(spec, decoded)
    _check_tiered_capacity(spec, decoded)
    _check_refinements(spec)
    if spec.report is not None:
        _check_report(spec, spec.report)
    for warning in bounds.repeated_choices(spec):  # on stdout, as the commands print theirs: stderr is for errors
        print(warning)
    return spec


def _check_report(spec: StudySpec, report: ReportSpec) -> None:
    """The plots name what the trials table has (searched, derived and recorded fields, metrics) or the base sets."""
    fields = {*spec.space, *spec.derived, *SUMMARY_FIELDS, *leaf_paths(spec.expanded_base)}
    categorical = [name for name, param in spec.space.items() if not all(map(is_number, param.values))]
    check_report(report, spec.source, fields, categorical, dict(zip(spec.metrics, spec.directions, strict=True)))


GA_SAMPLERS = ("nsga2", "nsga3")
"""The evolutionary samplers: they breed generations of `population_size` trials."""


def _check_sampler(spec: StudySpec) -> None:
    """The sampler's own requirements: grid needs choices everywhere, local a discrete space, gp needs torch, and
    only the evolutionary samplers take a population size."""
    where = f"{spec.source}: field"
    if spec.sampler == "local":
        ranged = [name for name, param in spec.space.items() if param.choices is None and not param.is_int]
        if ranged:
            raise SpecError(
                f"{where} 'space.{ranged[0]}': the local sampler walks a discrete space and this is a float "
                f"range; list its values as 'choices' or make it an integer range, or use sampler tpe or nsga2"
            )
    if spec.sweep and spec.sampler != "grid":
        raise SpecError(
            f"{where} 'sweep': a sweep prices every point of a grid, and sampler is {spec.sampler}; set sampler: grid "
            "(with choices for every parameter) or remove sweep"
        )
    if spec.sampler == "grid":
        ranged = [name for name, param in spec.space.items() if param.choices is None]
        if ranged and spec.sweep:
            low, high = spec.space[ranged[0]].low, spec.space[ranged[0]].high
            raise SpecError(
                f"{where} 'space.{ranged[0]}': a sweep enumerates every value, so each parameter needs "
                f"'choices: [...]', not a range (low {low!r}, high {high!r}); list the values as choices"
            )
        if ranged:
            raise SpecError(
                f"{where} 'space.{ranged[0]}': the grid sampler needs 'choices' for every "
                f"parameter; list the values or use sampler nsga2, tpe or random"
            )
    if spec.sampler == "gp" and importlib.util.find_spec("torch") is None:
        raise SpecError(
            f"{where} 'sampler': gp (Optuna's GPSampler) needs torch, which is not installed; "
            "pip install 'dse-orchestrator[gp]', or use sampler tpe, nsga2, nsga3, local, random or grid"
        )
    bounds.check_sampler_sizes(spec, space_size(spec))
    if spec.population_size is not None and spec.sampler not in GA_SAMPLERS:
        raise SpecError(
            f"{where} 'population_size': only the evolutionary samplers ({', '.join(GA_SAMPLERS)}) breed "
            f"generations, not {spec.sampler}; remove it or use sampler nsga2"
        )


def _check_budget(spec: StudySpec) -> None:
    """A search needs its budget (`trials`); a sweep has none (the grid is its budget), no Optuna storage, no
    refinement yet, at most MAX_TRIALS points, and derived values that leave the system alone: it decodes each
    system once, apart from the rest of the point (`dse.search.sweep_grid`)."""
    where = f"{spec.source}: field"
    if not spec.sweep:
        if spec.trials is None:
            raise SpecError(
                f"{where} 'trials': missing; give the budget of evaluations (e.g. trials: 100), or price the whole "
                "grid with sampler: grid and sweep: true"
            )
        return
    size = space_size(spec) or 0
    if spec.trials is not None:
        raise SpecError(
            f"{where} 'trials': a sweep prices all {size:,} points of the grid, so it takes no budget; remove trials "
            "(or --trials), or remove sweep to search the grid trial by trial"
        )
    if size > MAX_TRIALS:
        raise SpecError(
            f"{where} 'space': the grid has {size:,} points, over the sweep limit of {MAX_TRIALS:,} (README: Limits); "
            "drop choices, or search it with sampler nsga2 and a budget"
        )
    for name, value in (("storage", spec.storage), ("refine", spec.refine)):
        if value is not None:
            raise SpecError(
                f"{where} '{name}': a sweep keeps its results in its output folder and does not refine (yet); "
                f"remove {name} or sweep"
            )
    if spec.tracking.timelines != "none":
        raise SpecError(
            f"{where} 'tracking.timelines': a sweep writes no child runs to attach timelines to; remove it and run "
            "`dse evaluate POINT --trace` on the front's point files (OUT/best)"
        )
    for path, expr in spec.expressions.items():
        used = sorted(name for name in expr.names if is_system_field(name))
        if is_system_field(path) or used:
            raise SpecError(
                f"{where} 'derived.{path}': a sweep decodes each system once, apart from the rest of the point, so "
                f"a derived value may neither set nor use a system field ({path if not used else used[0]}); search "
                "it as a parameter of its own or remove sweep"
            )


FEASIBILITY_ONLY_FIELDS = ("system.accelerator.hbm_GiB",)
"""Fields that can be feasibility-only: HBM capacity reaches an evaluation only through the memory constraint
(peak memory against it); the generators and cost models never read it."""
MEMORY_CONSTRAINT = "fits_memory"
"""The one constraint whose violation `dse.search.capacity` derives for each value of a feasibility-only dimension."""


def feasibility_only(spec: StudySpec) -> dict[str, Param]:
    """The study's feasibility-only dimensions, by parameter name."""
    return {name: param for name, param in spec.space.items() if param.feasibility_only}


def _check_serving(spec: StudySpec, points: list[DesignPoint]) -> None:
    """A serving objective or constraint needs serving points (workload.mode serve) to measure."""
    items = [(f"objectives.{o.name}", o) for o, _ in spec.objective_list]
    items += [(f"constraints.{i}", c) for i, c in enumerate(spec.constraint_list)]
    serving = next((field for field, item in items if item.serving), None)
    other = next((p for p in points if p.workload.mode != "serve"), None)
    if serving is not None and other is not None:
        raise SpecError(
            f"{spec.source}: field '{serving}': a serving metric, and the study's points include workload.mode "
            f"{other.workload.mode}; serve every point (workload.mode serve with a serving section) or drop it"
        )


def _check_needs(spec: StudySpec, points: list[DesignPoint]) -> None:
    """An objective or constraint that needs a field a point leaves unset (a cost objective, the accelerator's
    price_usd) would fail every such trial: refused now, naming the field."""
    items = [(f"objectives.{o.name}", o) for o, _ in spec.objective_list]
    items += [(f"constraints.{i}", c) for i, c in enumerate(spec.constraint_list)]
    for field, item in items:
        why = next((why for point in points if item.needs and (why := item.needs(point))), None)
        if why is not None:
            raise SpecError(f"{spec.source}: field '{field}': {why}")


def _check_feasibility_only(spec: StudySpec) -> None:
    """A dimension marked feasibility_only must be one whose other values can be derived from one evaluation: a
    field no generator or cost model reads (FEASIBILITY_ONLY_FIELDS), used by no derived value, in a study whose
    only constraint is the memory constraint, whose violation is derived for each capacity."""
    for name in feasibility_only(spec):
        where = f"{spec.source}: field 'space.{name}.feasibility_only'"
        if name not in FEASIBILITY_ONLY_FIELDS:
            raise SpecError(
                f"{where}: {name} can change what a point costs, so each value needs its own evaluation; only "
                f"{', '.join(FEASIBILITY_ONLY_FIELDS)} can be feasibility-only: remove the flag"
            )
        users = [path for path, expr in spec.expressions.items() if name in expr.names]
        if users:
            raise SpecError(
                f"{where}: derived value {users[0]} uses {name}, so the value changes more than feasibility; "
                "remove the flag or the derived value's use of it"
            )
        if (spec.base.get("workload") or {}).get("mode") == "serve" or "workload.mode" in spec.space:
            raise SpecError(
                f"{where}: a serving point's KV cache takes what the weights leave of HBM, so {name} changes its "
                "latencies and throughput; remove the flag"
            )
        others = [c for c in spec.constraints if c != MEMORY_CONSTRAINT]
        if others:
            raise SpecError(
                f"{where}: constraint {others[0]} may depend on {name}, and only {MEMORY_CONSTRAINT} is derived for "
                "each value; remove the flag or the constraint"
            )


def _check_tiered_capacity(spec: StudySpec, points: list[DesignPoint]) -> None:
    """On an accelerator with memory tiers beside HBM, HBM's capacity places the working set among the tiers and so
    prices memory-bound kernels: it cannot be feasibility-only there (one evaluation would stand for every size)."""
    for name in feasibility_only(spec):
        tiered = [point.system.accelerator.name for point in points if point.system.accelerator.memory_tiers]
        if tiered:
            raise SpecError(
                f"{spec.source}: field 'space.{name}.feasibility_only': accelerator '{tiered[0]}' has memory_tiers, "
                f"where HBM's size decides which tier serves each byte, so {name} changes the step time; remove "
                "the flag"
            )


def _with_absolute_paths(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A study file's data with each relative file path (FILE_FIELDS, in base or among a parameter's choices)
    made absolute against the study file's folder: the study then reads the same files from any working
    directory, on any Ray worker, and as saved into its output folder."""
    if isinstance(raw.get("base"), dict):
        raw["base"] = with_paths_from(folder, raw["base"])
    space = raw.get("space")
    for field in FILE_FIELDS:
        param = space.get(field) if isinstance(space, dict) else None
        choices = param.get("choices") if isinstance(param, dict) else None
        if isinstance(choices, list):
            relative = [isinstance(c, str) and c != "" and not Path(c).is_absolute() for c in choices]
            resolved = [file_path_from(folder, c) if r else c for c, r in zip(choices, relative, strict=True)]
            space[field] = {**param, "choices": resolved}
    return raw


def space_size(spec: StudySpec) -> int | None:
    """Distinct parameter sets of the space, or None when a parameter is a float range."""
    sizes = [param.size for param in spec.space.values()]
    return None if None in sizes else prod(sizes)  # type: ignore[arg-type]


def _check_refinements(spec: StudySpec) -> None:
    """A field that changes nothing at some values of another (IGNORED_RULES: `fsdp` outside ZeRO 3,
    `recompute_every` beyond the layer count), set by the study where no point can give it effect, is an error:
    every trial would silently ignore it."""
    for rule in IGNORED_RULES:
        values, partners = _possible(spec, rule.field), _possible(spec, rule.partner)
        if values is None or partners is None:
            continue
        value = rule.first_ignored(values, partners)
        if value is None:
            continue
        where = f"space.{rule.field}" if rule.field in spec.space else f"base.{rule.field}"
        if isinstance(rule, Refinement):
            raise SpecError(
                f"{spec.source}: field '{where}': {value!r} only takes effect with {rule.condition}, which no point "
                f"of the study has ({rule.partner}: {', '.join(map(repr, partners))}); remove it or search "
                f"{rule.partner} over values that include it"
            )
        raise SpecError(
            f"{spec.source}: field '{where}': no point of the study gives {value!r} effect "
            f"({rule.partner}: {', '.join(map(repr, partners))}): {rule.reason(value, partners[0]).split(': ', 1)[1]}"
        )


def _possible(spec: StudySpec, path: str) -> list[Any] | None:
    """The values a study's points can have at a dotted path, or None when a derived value or a searched catalog
    entry decides it."""
    parts = path.split(".")
    if any(".".join(parts[:n]) in spec.derived for n in range(1, len(parts) + 1)):
        return None
    if path in spec.space:
        return spec.space[path].values
    if any(".".join(parts[:n]) in spec.space for n in range(1, len(parts))):
        return None
    node: Any = spec.expanded_base
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return [default_of(path)]
        node = node[part]
    return [node]


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
