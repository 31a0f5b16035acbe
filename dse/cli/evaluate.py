"""`dse evaluate POINT.yaml`: generate and price one design point and print its metrics (a table, or one JSON line
with --json)."""

import argparse
import json
import math
import sys
from contextlib import nullcontext

from rich.console import Console
from rich.table import Table

from dse import plugins
from dse.cli.stdout import stdout_to_stderr
from dse.errors import DseError
from dse.fields import GiB
from dse.interfaces import TimelineCostModel
from dse.objective import in_seconds
from dse.point import described
from dse.point.evaluate import evaluate
from dse.point.points import load_point
from dse.search import preflight
from dse.spec import DesignPoint


def evaluate_command(args: argparse.Namespace, console: Console) -> int:
    # Under --json stdout holds the one JSON line: what plugins and model factories print goes to stderr.
    with stdout_to_stderr() if args.json else nullcontext():
        point, metrics = _evaluated(args)
    _note_uncounted(point, args.generator)
    if args.json:
        print(json.dumps(metrics, allow_nan=False))
        return 0
    header = f"{args.point}: {point.model.name} on {point.parallel.world} NPUs, key {point.key}"
    console.print(header, soft_wrap=True, highlight=False)
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in metrics.items():
        table.add_row(name, _human(name, value))
    console.print(table)
    return 0


def _note_uncounted(point: DesignPoint, generator: str) -> None:
    """On stderr, where the model's code has a layout ModelSpec's closed form cannot count (a bias on some
    projections only, ...): the parameters the step's weights, gradients, optimizer state and data-parallel traffic
    are sized by are then the closed form's, not the module's, and the user should know by how much."""
    model = described.description(point, generator)
    if model is not None and model.unexpressed:
        print(
            f"note: model factory '{model.factory}': {model.unexpressed}; the step's weights, gradients, optimizer "
            "state and data-parallel traffic are sized by the closed form",
            file=sys.stderr,
        )


def _evaluated(args: argparse.Namespace) -> tuple[DesignPoint, dict[str, float | bool]]:
    """`dse evaluate`'s point and its metrics: loaded, pre-flighted (before anything is generated), generated and
    priced, its trace written if asked."""
    with described.in_this_process():  # its model is built here next: described here, not in a child
        point = load_point(args.point, args.generator)
    cost_model = plugins.cost_model_of(args)
    flag = f"--cost-model {args.cost_model}"
    generator = preflight.check_point(point, str(args.point), args.generator, cost_model, flag)
    traced = None
    if args.trace is not None:
        if not isinstance(cost_model, TimelineCostModel):
            raise DseError(f"--trace: cost model '{args.cost_model}' keeps no timeline; use --cost-model analytical")
        traced, cost_model = cost_model, cost_model.with_timeline()
    try:
        evaluation = evaluate(point, generator, cost_model)
    except DseError as exc:  # raised while generating or pricing: name the file as the loading errors do
        if str(exc).startswith(str(args.point)):
            raise
        raise type(exc)(f"{args.point}: {exc}") from None
    if traced is not None:
        try:
            args.trace.write_text(json.dumps(traced.chrome_trace(evaluation.result)))
        except OSError as exc:
            raise DseError(f"--trace: cannot write {args.trace} ({exc.strerror}); choose another FILE") from None
    metrics = {k: v if isinstance(v, bool) else float(v) for k, v in evaluation.metrics.items()}
    # The limits keep every figure finite; should one slip through, say so rather than print a number (or, in
    # --json, an Infinity that is not JSON) that cannot be right.
    if unbounded := [name for name, value in metrics.items() if not math.isfinite(value)]:
        raise DseError(
            f"{args.point}: the evaluation gave {unbounded[0]} = {metrics[unbounded[0]]}, not a finite number; the "
            "point's figures are beyond what the cost model can price: bring them nearer the README's Limits"
        )
    return point, metrics


def _human(name: str, value: float | bool) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name.endswith("_bytes"):
        return f"{value / GiB:,.2f} GiB"
    if in_seconds(name):
        return f"{value:.4f} s"
    if name in ("mfu", "overlap_ratio"):
        return f"{100 * value:.1f} %"
    return f"{value:,.4g}"
