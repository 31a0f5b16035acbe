"""The `dse` command: run a study, evaluate one point, report a finished study.

Errors a user can cause print as one `error:` line on stderr with exit code 2, never a traceback; an interrupted
study says how to resume it and exits with 130.
"""

import argparse
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import optuna
import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dse import plugins
from dse.cli import check, ui
from dse.cli import commands as commands_module
from dse.cli import sweep as sweep_command
from dse.errors import DseError
from dse.fields import GiB
from dse.interfaces import TimelineCostModel
from dse.point import calibration
from dse.point.evaluate import evaluate
from dse.point.points import load_point
from dse.results import pareto, refinement, report, tracking
from dse.results.tracking import EVALUATION
from dse.search import refine
from dse.search import study as studies
from dse.search.executor import Executor, InlineExecutor, PluginEvaluation, RayExecutor
from dse.search.inline_first import InlineFirstExecutor
from dse.search.space import StudySpec, load_study
from dse.search.study import DUPLICATE_OF, POINT_KEY, RESOLVED_FROM
from dse.search.sweep_parts import MANIFEST

PIPED_WIDTH = 160
"""Columns of tables printed to a file or a pipe."""
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
RESUME_HINT = "interrupted; run the same command again to resume the study (finished trials are kept)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dse",
        description="Design-space exploration of distributed AI training: search parallelism and hardware "
        "with Optuna, evaluate points on Ray, track results in MLflow and Parquet.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run (or resume) a study",
        description="Run a study: Optuna proposes design points, Ray actors evaluate them, every trial lands in "
        "OUT/trials.parquet and MLflow, and the Pareto front is printed. Running the same study into the same "
        "OUT again resumes it: its evaluations count toward --trials and only the rest run.",
    )
    run.add_argument("study", type=Path, metavar="STUDY.yaml", help="study file, e.g. studies/quickstart.yaml")
    run.add_argument(
        "--trials",
        type=int,
        help="the budget: distinct evaluations, including those already in OUT (default: the file's); trials that "
        "repeat an evaluated point or are pruned before evaluation do not count",
    )
    run.add_argument("--workers", type=int, help="evaluations in flight at once (default: the file's)")
    run.add_argument(
        "--address",
        help="Ray cluster to join, e.g. auto or ray://head:10001 (default: this process, and a local Ray once the "
        "study's remaining work pays for its start)",
    )
    run.add_argument("--out", type=Path, help="output folder (default: runs/<study name>)")
    run.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///OUT/mlflow.db)"
    )
    run.add_argument("--inline", action="store_true", help="evaluate in this process only, never start Ray (debugging)")
    run.add_argument(
        "--ray",
        action="store_true",
        help="start the local Ray pool at once (default without --address: evaluate in this process first and "
        "start Ray only when the study's remaining work pays for its start)",
    )
    run.add_argument(
        "--sweep",
        action="store_true",
        help="price every point of the grid in batches, without an Optuna trial per point (as `sweep: true` in the "
        "file; needs sampler grid and no trials)",
    )
    run.add_argument(
        "--storage",
        help="Optuna storage URL: postgresql://..., redis://..., sqlite:///... or a journal file "
        "(default: the file's storage, else OUT/optuna-journal.log)",
    )

    evaluate = commands.add_parser(
        "evaluate",
        help="evaluate one design point",
        description="Generate and price one design point (a file like studies/points/*.yaml) and print its metrics.",
    )
    evaluate.add_argument("point", type=Path, metavar="POINT.yaml", help="design point file")
    evaluate.add_argument("--json", action="store_true", help="print the metrics as one JSON object, nothing else")
    plugins.add_arguments(evaluate)
    evaluate.add_argument(
        "--trace", type=Path, metavar="FILE", help="also write the simulated timeline as Chrome/Perfetto trace JSON"
    )

    report = commands.add_parser(
        "report",
        help="summarise a finished study",
        description="Print the trial counts, the most common infeasibility reasons and the Pareto front of a "
        "study's output folder (from OUT/trials.parquet alone).",
    )
    report.add_argument("out", type=Path, metavar="OUT_DIR", help="a study's output folder, e.g. runs/quickstart")
    commands_module.add_parsers(commands)
    calibration.add_parser(commands)
    ui.add_parser(commands)
    check.add_parser(commands)

    generate = commands.add_parser(
        "generate",
        help="generate one design point's workload (Chakra traces, a summary)",
        description="Generate the distributed execution graph of one design point; write it as Chakra execution "
        "traces (one .et file per rank and the communicator groups, for ASTRA-sim) and/or print per rank class "
        "its op counts, FLOPs, communication bytes, parameters and memory.",
    )
    generate.add_argument("point", type=Path, metavar="POINT.yaml", help="design point file")
    generate.add_argument("--chakra", type=Path, metavar="OUT_DIR", help="write OUT_DIR/<prefix>.<rank>.et files")
    generate.add_argument("--prefix", default="trace", help="file name prefix of the traces (default: trace)")
    generate.add_argument("--summary", action="store_true", help="print the per-rank-class summary")
    plugins.add_arguments(generate, cost_model=False)
    return parser


def _run(args: argparse.Namespace, console: Console) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    overrides = {"sweep": True} if args.sweep else {}
    spec = load_study(args.study, trials=args.trials, workers=args.workers, storage=args.storage, **overrides)
    out = args.out or Path("runs") / spec.name
    _make_out(out)
    if spec.sweep:
        return sweep_command.run(args, spec, out, console, _stop_on_interrupt, _print_summary)
    if (out / MANIFEST).exists():
        raise DseError(f"--out {out}: the folder holds a sweep ({MANIFEST}); run the study with another --out")
    study = studies.open_study(spec, out)
    tracking.save_spec(spec, out)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or tracking.default_tracking_uri(out)
    stop = threading.Event()
    completed = False
    with _stop_on_interrupt(stop, console):
        tracker = tracking.Tracker(uri, spec, out)
        tracker.start(study)
        done = len(studies.evaluations(study.get_trials(deepcopy=False)))
        if done >= spec.trials:
            console.print(
                f"study {spec.name} already has {done} of {spec.trials} evaluations in {out}: nothing left to run "
                "(--trials N asks for more); its results follow",
                soft_wrap=True,
            )
        executor = _executor(args, spec, remaining=spec.trials - done, console=console)
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        try:
            with Progress(*columns, console=console, transient=True) as progress:
                task = progress.add_task(f"study {spec.name}", total=spec.trials, completed=min(done, spec.trials))

                def on_trial(trial: optuna.trial.FrozenTrial) -> None:
                    tracker.record(trial)
                    if studies.is_evaluation(trial):
                        progress.advance(task)

                ending = refine.run(spec, study, executor, spec.trials, on_trial, stop.is_set, refining(progress))
            completed = not stop.is_set()
        except BaseException:  # a second Ctrl-C or a bug: what has finished is still written, then it goes on up
            executor.close()
            tracker.finish(study, tracking.write_results(spec, study, out), completed=False)
            raise
        executor.close()
        results = tracking.write_tables(spec, study, out)
        frame, best = results.frame, results.front
        if ending:
            console.print(f"stopped before {spec.trials} evaluations: {ending}", soft_wrap=True)
        _print_summary(console, frame, best, f"Pareto front of {spec.name}")
        refinement.print_refinement(console, frame)
        with console.status("writing the Pareto plots and the MLflow runs"):
            tracking.write_plots(spec, results, out)
            missing = tracker.finish(study, results, completed)
    if tracker.error:
        print(_mlflow_behind(uri, tracker.error, missing, out), file=sys.stderr)
    # Paths and commands are printed whole (soft wrap) so that they can be copied.
    console.print(f"trials table  {out / tracking.PARQUET}", soft_wrap=True)
    if spec.tracking.timelines == "none" and not best.empty:
        console.print(
            f"timelines     dse timeline {out}  (the Pareto points' simulated steps, for Perfetto)", soft_wrap=True
        )
    console.print(f"MLflow        {uri}  (experiment '{spec.name}')", soft_wrap=True)
    for line in ui.browse_lines(uri, tracker.experiment_id, tracker.parent_id, out):
        console.print(line, soft_wrap=True)
    if not completed:
        print(RESUME_HINT, file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def refining(progress: Progress) -> refine.OnRefined:
    """A progress line for the refinements (their number is known only as each round starts, so it counts up)."""
    task = None

    def on_refined(key: str, record: dict) -> None:
        nonlocal task
        if task is None:
            task = progress.add_task(f"refine with {record['cost_model']}", total=None)
        progress.advance(task)

    return on_refined


def _mlflow_behind(uri: str, error: str, missing: int, out: Path) -> str:
    return (
        f"warning: MLflow at {uri} failed ({error}); the study went on without it and every trial is in "
        f"{out / tracking.PARQUET}; {missing} child runs and the study's artifacts are not in MLflow yet: run "
        f"`dse sync {out}` once it is back"
    )


def _make_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise DseError(f"--out {out}: a file is in the way, not a folder; give a folder path") from None
    except OSError as exc:
        raise DseError(f"--out {out}: cannot create the folder ({exc.strerror}); give a writable folder") from None


def _executor(args: argparse.Namespace, spec: StudySpec, remaining: int, console: Console) -> Executor:
    """This process with --inline or when nothing is left to run; the Ray pool at once for a cluster (--address,
    RAY_ADDRESS, a Ray this process has joined) or with --ray; else this process first, and the pool once the
    remaining work pays for a local Ray's start (`InlineFirstExecutor`)."""
    refiner = spec.refine
    evaluation = PluginEvaluation(
        spec.generator,
        spec.cost_model,
        spec.cost_model_options,
        refiner and refiner.cost_model,
        refiner and refiner.cost_model_options,
    )
    if args.inline or remaining <= 0:
        return InlineExecutor(evaluation)
    ray_module = sys.modules.get("ray")
    if args.ray or args.address or os.environ.get("RAY_ADDRESS") or (ray_module and ray_module.is_initialized()):
        with console.status("starting Ray" if not args.address else f"joining Ray at {args.address}"):
            return RayExecutor(evaluation, spec.workers, args.address)

    def announce(seconds: float) -> None:
        console.print(
            f"starting Ray: about {seconds:.0f} s of evaluation left in this process, so the rest goes to "
            f"{spec.workers or os.cpu_count()} Ray workers (--inline stays here)"
        )

    return InlineFirstExecutor(
        evaluation, remaining, spec.workers, lambda: RayExecutor(evaluation, spec.workers), announce
    )


@contextmanager
def _stop_on_interrupt(stop: threading.Event, console: Console) -> Iterator[None]:
    """The first Ctrl-C asks the study to stop cleanly (results are written); a second one quits at once.

    Letting KeyboardInterrupt land anywhere could leave the Optuna journal's lock held mid-write.
    """

    def handle(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        console.print("stopping: writing what has finished (Ctrl-C again to quit at once)")

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _print_summary(console: Console, frame: pd.DataFrame, best: pd.DataFrame, title: str) -> None:
    console.print(trial_counts(frame), soft_wrap=True)
    if best.empty:
        console.print("no feasible trial completed, so there is no Pareto front")
        return
    console.print(pareto.table(best, frame.attrs["objectives"], title))


def trial_counts(frame: pd.DataFrame) -> str:
    """What became of a study's trials, in one line: evaluations (what the budget counts), trials that reused one
    (the same point, or the same configuration at another value of a feasibility-only dimension), trials pruned
    before evaluation; then feasible, infeasible and failed over all trials."""
    if frame.empty:
        return "0 trials"
    state = frame["state"]
    complete = state == "COMPLETE"
    fits = int((complete & (frame["feasible"] == True)).sum())  # noqa: E712 - nullable column
    over = int(complete.sum()) - fits
    pruned, failed = int((state == "PRUNED").sum()), int((state == "FAIL").sum())
    constraints = ", ".join(frame.attrs.get("constraints", [])) or "a constraint"
    duplicates, resolved = (int(frame[c].notna().sum()) if c in frame else 0 for c in (DUPLICATE_OF, RESOLVED_FROM))
    evaluations = int(frame[EVALUATION].sum()) if EVALUATION in frame else len(frame) - pruned - duplicates
    derived = f", {resolved} resolved from an evaluation at another value of a feasibility-only field" * bool(resolved)
    return (
        f"{len(frame)} trials: {evaluations} evaluations, {duplicates} repeats of an evaluated point{derived}, "
        f"{pruned} pruned before evaluation; {fits} feasible, {over + pruned} infeasible ({over} evaluated over "
        f"{constraints}, {pruned} pruned), {failed} failed; {frame[POINT_KEY].nunique()} distinct points"
    )


def _report(args: argparse.Namespace, console: Console) -> int:
    frame = tracking.read_parquet(args.out)
    reasons = frame.loc[frame["state"] == "PRUNED", "reason"].value_counts().head(5)
    best = pareto.front(frame)
    _print_summary(console, frame, best, f"Pareto front of {frame.attrs.get('study', args.out)}")
    written = report.print_report(console, frame, args.out)
    refinement.print_refinement(console, frame)
    if not reasons.empty:
        console.print("most common infeasibility reasons:")
        for reason, count in reasons.items():
            console.print(f"  {count:4d}  {reason}", highlight=False, soft_wrap=True)
    console.print(f"plots         {'  '.join(str(path) for path in written)}", soft_wrap=True)
    return 0


def _evaluate(args: argparse.Namespace, console: Console) -> int:
    point = load_point(args.point)
    cost_model = plugins.cost_model_of(args)
    traced = None
    if args.trace is not None:
        if not isinstance(cost_model, TimelineCostModel):
            raise DseError(f"--trace: cost model '{args.cost_model}' keeps no timeline; use --cost-model analytical")
        traced, cost_model = cost_model, cost_model.with_timeline()
    try:
        evaluation = evaluate(point, plugins.generator(args.generator), cost_model)
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


def _human(name: str, value: float | bool) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name.endswith("_bytes"):
        return f"{value / GiB:,.2f} GiB"
    if name.endswith("_s"):
        return f"{value:.4f} s"
    if name in ("mfu", "overlap_ratio"):
        return f"{100 * value:.1f} %"
    return f"{value:,.4g}"


def _generate(args: argparse.Namespace, console: Console) -> int:
    from dse.modelstats import active_param_count, param_count
    from dse.point import chakra
    from dse.point.feasibility import check_feasible
    from dse.point.summary import summarize

    point = load_point(args.point)
    check_feasible(point)
    workload = plugins.generator(args.generator).generate(point)
    if args.chakra:
        network = [d.npus for d in point.system.network]
        paths = chakra.export(
            workload, args.chakra, network, args.prefix, point.model.dtype_bytes, point.system.accelerator
        )
        console.print(f"wrote {len(paths)} traces and {args.prefix}.comm_groups.json to {args.chakra}", soft_wrap=True)
    if args.summary or not args.chakra:
        m = point.model
        console.print(
            f"{point.model.name}: {param_count(m):,} parameters ({active_param_count(m):,} active per token), "
            f"{point.parallel.world} ranks in {len(workload.programs)} rank classes, "
            f"{len(workload.blocks)} blocks",
            soft_wrap=True,
        )
        for s in summarize(workload):
            table = Table(title=f"rank class {s.rank_class} ({s.name}, {s.ranks} ranks)", title_justify="left")
            table.add_column("what")
            table.add_column("value", justify="right")
            for category, count in sorted(s.ops.items()):
                table.add_row(f"ops: {category}", f"{count:,}")
            table.add_row("FLOPs", f"{s.flops:.4g}")
            for (kind, axis), size in sorted(s.comm_bytes.items()):
                table.add_row(f"comm: {kind} on {axis}", f"{size / GiB:,.3f} GiB")
            table.add_row("parameters on a rank", f"{s.parameters / m.dtype_bytes:,.0f}")
            for kind, size in sorted(s.static_bytes.items()):
                table.add_row(f"static: {kind}", f"{size / GiB:,.3f} GiB")
            table.add_row("peak activations", f"{s.peak_activation_bytes / GiB:,.3f} GiB")
            console.print(table)
    return 0


def run_study(study: Path, out: Path, tracking_uri: str, workers: int | None, console: Console) -> int:
    """`dse run STUDY --out OUT --tracking-uri URI [--workers N]` as a call, every other option at its default:
    what `dse nightly` runs each study with (it is handed this, as a nightly.StudyRunner, not importing the CLI)."""
    argv = ["run", str(study), "--out", str(out), "--tracking-uri", tracking_uri]
    return _run(_parser().parse_args(argv + (["--workers", str(workers)] if workers else [])), console)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    to_stderr = args.command == "evaluate" and args.json
    stream = sys.stderr if to_stderr else sys.stdout
    # Piped into a file or a CI log, Rich would cut tables to 80 columns; lay them out whole instead.
    width = None if stream.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH
    # Nothing dse prints is Rich markup, and names and paths from files may look like it ('[/x]' raised MarkupError).
    console = Console(stderr=to_stderr, width=width, markup=False)
    try:
        commands = {"run": _run, "evaluate": _evaluate, "report": _report, "generate": _generate}
        commands |= commands_module.handlers(partial(run_study, console=console))
        commands["calibrate"] = calibration.main
        commands["ui"] = ui.main
        commands["check"] = check.main
        return commands[args.command](args, console)
    except DseError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"\n{RESUME_HINT if args.command == 'run' else 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
