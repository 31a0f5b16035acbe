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
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import optuna
import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dse import plugins
from dse.cli import check, outcome, ui
from dse.cli import commands as commands_module
from dse.cli import generate as generate_command
from dse.cli import sweep as sweep_command
from dse.cli.outcome import EXIT_INTERRUPTED, EXIT_USER_ERROR
from dse.cli.stdout import stdout_to_stderr
from dse.errors import DseError
from dse.fields import GiB
from dse.interfaces import TimelineCostModel
from dse.objective import in_seconds
from dse.point import calibration
from dse.point.evaluate import evaluate
from dse.point.points import load_point
from dse.results import folders, pareto, refinement, report, study_plots, tracking
from dse.results.tracking import EVALUATION
from dse.search import preflight, refine
from dse.search import study as studies
from dse.search.executor import Executor, InlineExecutor, PluginEvaluation, RayExecutor, check_address
from dse.search.inline_first import InlineFirstExecutor
from dse.search.space import StudySpec, load_study
from dse.search.storage import scheme_of
from dse.search.study import DUPLICATE_OF, POINT_KEY, RESOLVED_FROM
from dse.search.sweep_parts import MANIFEST
from dse.spec import DesignPoint

PIPED_WIDTH = 160
"""Columns of tables printed to a file or a pipe."""
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
    where = run.add_mutually_exclusive_group()  # where evaluations run: README's [--address ADDR | --ray | --inline]
    where.add_argument(
        "--address",
        help="Ray cluster to join, e.g. auto or ray://head:10001 (default: this process, and a local Ray once the "
        "study's remaining work pays for its start)",
    )
    run.add_argument("--out", type=Path, help="output folder (default: runs/<study name>)")
    run.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///OUT/mlflow.db)"
    )
    where.add_argument(
        "--inline", action="store_true", help="evaluate in this process only, never start Ray (debugging)"
    )
    where.add_argument(
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
    run.add_argument(
        "--force",
        action="store_true",
        help="replace the results of another study in --out (without it, a folder holding another study's "
        "results is refused)",
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

    generate_command.add_parser(commands)
    return parser


def _run(args: argparse.Namespace, console: Console) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    overrides = {"sweep": True} if args.sweep else {}
    spec = load_study(args.study, trials=args.trials, workers=args.workers, storage=args.storage, **overrides)
    preflight.check_study(spec)  # what would fail every trial, before the output folder is touched
    out = args.out or Path("runs") / spec.name
    uri = tracking.tracking_uri(args.tracking_uri, out)
    scheme_of(spec.storage, out)
    check_address(args.address)
    _make_out(out)
    folders.claim(spec, out, args.force)
    if spec.sweep:
        return sweep_command.run(args, spec, out, uri, console, _stop_on_interrupt, _print_summary)
    if (out / MANIFEST).exists():
        raise DseError(
            f"--out {out}: the folder holds a sweep ({MANIFEST}); run the study with another --out, or --force to "
            "replace the sweep"
        )
    tracking.save_spec(spec, out)  # before the journal exists: a folder's results always come with their study
    study = studies.open_study(spec, out)
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
    if spec.report is not None and spec.report.plots:
        console.print(f"report plots  {out / study_plots.PLOTS_DIR}", soft_wrap=True)
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
    return outcome.report_failures(frame)


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
        refiner and refiner.serving_depth,
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
    frame = folders.read_parquet(args.out)
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
    # Under --json stdout holds the one JSON line: what plugins and model factories print goes to stderr.
    with stdout_to_stderr() if args.json else nullcontext():
        point, metrics = _evaluated(args)
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


def _evaluated(args: argparse.Namespace) -> tuple[DesignPoint, dict[str, float | bool]]:
    """`dse evaluate`'s point and its metrics: loaded, pre-flighted (before anything is generated), generated and
    priced, its trace written if asked."""
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


def run_study(study: Path, out: Path, tracking_uri: str, workers: int | None, console: Console) -> int:
    """`dse run STUDY --out OUT --tracking-uri URI [--workers N]` as a call, every other option at its default:
    what `dse nightly` runs each study with (it is handed this, as a nightly.StudyRunner, not importing the CLI)."""
    argv = ["run", str(study), "--out", str(out), "--tracking-uri", tracking_uri]
    return _run(_parser().parse_args(argv + (["--workers", str(workers)] if workers else [])), console)


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit code (dse.cli.outcome): bad input and the user's environment (an OSError naming a
    file) print one `error:` line, a bug one `internal error` line naming the file that holds its traceback."""
    args = _parser().parse_args(argv)
    to_stderr = args.command == "evaluate" and args.json
    stream = sys.stderr if to_stderr else sys.stdout
    # Piped into a file or a CI log, Rich would cut tables to 80 columns; lay them out whole instead.
    width = None if stream.isatty() or "COLUMNS" in os.environ else PIPED_WIDTH
    # Nothing dse prints is Rich markup, and names and paths from files may look like it ('[/x]' raised MarkupError).
    console = Console(stderr=to_stderr, width=width, markup=False)
    try:
        _refuse_nul_bytes(sys.argv[1:] if argv is None else argv)
        commands = {"run": _run, "evaluate": _evaluate, "report": _report, "generate": generate_command.main}
        commands |= commands_module.handlers(partial(run_study, console=console))
        commands["calibrate"] = calibration.main
        commands["ui"] = ui.main
        commands["check"] = check.main
        return commands[args.command](args, console)
    except DseError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return getattr(exc, "exit_code", EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print(f"\n{RESUME_HINT if args.command == 'run' else 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (`dse report OUT | head`): stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return outcome.EXIT_BROKEN_PIPE
    except OSError as exc:
        if line := outcome.environment_error(exc):
            print(" ".join(line.split()), file=sys.stderr)
            return EXIT_USER_ERROR
        print(outcome.internal_error(exc, args.command), file=sys.stderr)
        return outcome.EXIT_INTERNAL_ERROR
    except Exception as exc:
        print(outcome.internal_error(exc, args.command), file=sys.stderr)
        return outcome.EXIT_INTERNAL_ERROR


def _refuse_nul_bytes(argv: Sequence[str]) -> None:
    """No path or value holds a NUL byte (a shell cannot even pass one); said, naming its option, before any file
    is touched."""
    for index, argument in enumerate(argv):
        if "\0" in argument:
            if argument.startswith("--") and "=" in argument:
                name, argument = argument.split("=", 1)
            elif index and argv[index - 1].startswith("--"):
                name = argv[index - 1]
            else:
                name = "argument"
            raise DseError(f"{name} {argument!r}: holds a NUL byte, which no path or value may; remove it")


if __name__ == "__main__":
    sys.exit(main())
