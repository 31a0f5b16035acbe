"""`dse check FILE`: validate a point or a study file without running it.

For a point: everything `dse evaluate` checks before it generates anything (fields, limits, settings that
would be ignored, feasibility, and the pre-flight of its generator and cost model, chosen with the same flags).
For a study: everything `dse run` checks before its first trial (every choice and range end against its field,
the pre-flight of its plugins and storage), plus the size of the space and the points that vary one parameter at
a time from the first, with the reason of each that cannot run. Nothing is generated, priced or written.
"""

import argparse
from pathlib import Path

from rich.console import Console

from dse import plugins
from dse.errors import SpecError
from dse.modelstats import param_count
from dse.point.described import description
from dse.point.points import POINT_FIELDS, load_point
from dse.search import preflight
from dse.search.decoding import vary
from dse.search.space import load_study, space_size
from dse.spec import DesignPoint
from dse.yamlio import load_mapping

STUDY_FIELDS = ("base", "space")
SHOWN_REASONS = 10


def main(args: argparse.Namespace, console: Console) -> int:
    data = load_mapping(args.file)
    if any(field in data for field in STUDY_FIELDS):
        _refuse_point_flags(args)
        _check_study(args.file, console)
    elif any(field in data for field in POINT_FIELDS):
        point = load_point(args.file, args.generator)
        flag = f"--cost-model {args.cost_model}"
        preflight.check_point(point, str(args.file), args.generator, plugins.cost_model_of(args), flag)
        model = description(point, args.generator)
        total = param_count(point.model) if model is None else model.parameters
        console.print(
            f"{args.file}: a valid point: {point.model.name} ({total:.3g} parameters) on "
            f"{point.parallel.world} NPUs of {point.system.name}, key {point.key}",
            soft_wrap=True,
            highlight=False,
        )
        _report_factories([point], args.generator, console)
    else:
        raise SpecError(
            f"{args.file}: neither a point file (fields {', '.join(POINT_FIELDS)}) nor a study file (fields name, "
            f"{', '.join(STUDY_FIELDS)}, ...); see the README's Point files and Study files"
        )
    return 0


def _refuse_point_flags(args: argparse.Namespace) -> None:
    """A study names its own generator and cost model: the flags, which choose them for a point, would be ignored."""
    given = {
        "--generator": args.generator != plugins.DEFAULT_GENERATOR,
        "--cost-model": args.cost_model != plugins.DEFAULT_COST_MODEL,
        plugins.OPTIONS_FLAG: bool(args.cost_option),
    }
    for flag, set_ in given.items():
        if set_:
            raise SpecError(
                f"{flag}: {args.file} is a study file, which names its own generator, cost_model and "
                "cost_model_options; remove the flag (it is for a point file) or change the study"
            )


def _report_factories(points: list[DesignPoint], generator: str, console: Console) -> None:
    """Under a generator whose model is code (fx), one line per distinct model the points build: its factory,
    layer count and exact parameters (dse.point.described), and where ModelSpec's closed form cannot count it."""
    shown = set()
    for point in points:
        model = description(point, generator)
        if model is None:
            return
        line = f"model factory '{model.factory}': {point.model.layers} layers, {model.parameters:,} parameters "
        line += f"({model.active:,} active){f'; {model.unexpressed}' if model.unexpressed else ''}"
        if line not in shown:
            shown.add(line)
            console.print(line, soft_wrap=True, highlight=False)


def _check_study(path: Path, console: Console) -> None:
    spec = load_study(path)
    preflight.check_study(spec)
    size = space_size(spec)
    shown = "a continuous space" if size is None else f"{size:,} points in the space"
    budget = "every point priced (a sweep)" if spec.sweep else f"{spec.trials} evaluations ({spec.sampler})"
    console.print(
        f"{path}: a valid study: {spec.name}, {len(spec.space)} parameters, {shown}, {budget}",
        soft_wrap=True,
        highlight=False,
    )
    if (refine := spec.refine) is not None:
        when = "after the search" + (f" and every {refine.every} evaluations" if refine.every else "")
        options = f" with options {refine.cost_model_options}" if refine.cost_model_options else ""
        options += f" at serving depth {refine.serving_depth}" if refine.serving_depth else ""
        console.print(
            f"refines the feasible Pareto members and the top {refine.top_k} per objective with cost model "
            f"'{refine.cost_model}'{options}, {when}",
            soft_wrap=True,
            highlight=False,
        )
    variants = vary(spec)
    _report_factories([point for _, _, point in variants if isinstance(point, DesignPoint)], spec.generator, console)
    reasons = [(name, value, outcome) for name, value, outcome in variants if isinstance(outcome, str)]
    console.print(
        f"{len(variants)} points varying one parameter at a time from the first: "
        f"{len(variants) - len(reasons)} can run, {len(reasons)} cannot",
        soft_wrap=True,
        highlight=False,
    )
    for name, value, reason in reasons[:SHOWN_REASONS]:
        console.print(f"  {name}={value}: {reason}", highlight=False, soft_wrap=True)
    if len(reasons) > SHOWN_REASONS:
        console.print(f"  ... and {len(reasons) - SHOWN_REASONS} more")
