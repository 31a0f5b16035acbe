"""The `dse` command: run a study, evaluate one point, report a finished study.

Errors a user can cause print as one `error:` line on stderr with exit code 2, never a traceback; an interrupted
study says how to resume it and exits with 130.
"""

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import optuna
import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dse import pareto, plugins, tracking
from dse import study as studies
from dse.errors import DseError
from dse.evaluate import evaluate
from dse.executor import Executor, InlineExecutor, PluginEvaluation, RayExecutor
from dse.points import load_point
from dse.space import StudySpec, load_study
from dse.spec import GiB

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
MAKE_UI_OUT = "runs/quickstart"
"""The output folder `make ui` serves (the Makefile's DEMO_OUT)."""
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
        "OUT again resumes it: finished trials count toward --trials and only the rest run.",
    )
    run.add_argument("study", type=Path, metavar="STUDY.yaml", help="study file, e.g. studies/quickstart.yaml")
    run.add_argument("--trials", type=int, help="total trials, including those already in OUT (default: the file's)")
    run.add_argument("--workers", type=int, help="evaluations in flight at once (default: the file's)")
    run.add_argument(
        "--address", help="Ray cluster to join, e.g. auto or ray://head:10001 (default: start a local Ray)"
    )
    run.add_argument("--out", type=Path, help="output folder (default: runs/<study name>)")
    run.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///OUT/mlflow.db)"
    )
    run.add_argument("--inline", action="store_true", help="evaluate in this process, without Ray (debugging)")

    evaluate = commands.add_parser(
        "evaluate",
        help="evaluate one design point",
        description="Generate and price one design point (a file like studies/points/*.yaml) and print its metrics.",
    )
    evaluate.add_argument("point", type=Path, metavar="POINT.yaml", help="design point file")
    evaluate.add_argument("--json", action="store_true", help="print the metrics as one JSON object, nothing else")
    evaluate.add_argument("--generator", default="symbolic", help="workload generator plugin (default: symbolic)")
    evaluate.add_argument("--cost-model", default="analytical", help="cost model plugin (default: analytical)")

    report = commands.add_parser(
        "report",
        help="summarise a finished study",
        description="Print the trial counts, the most common infeasibility reasons and the Pareto front of a "
        "study's output folder (from OUT/trials.parquet alone).",
    )
    report.add_argument("out", type=Path, metavar="OUT_DIR", help="a study's output folder, e.g. runs/quickstart")
    return parser


def _run(args: argparse.Namespace, console: Console) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = load_study(args.study, trials=args.trials, workers=args.workers)
    out = args.out or Path("runs") / spec.name
    study = studies.open_study(spec, out)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or tracking.default_tracking_uri(out)
    stop = threading.Event()
    completed = False
    with _stop_on_interrupt(stop, console):
        tracker = tracking.Tracker(uri, spec, out)
        tracker.start(study)
        done = len(studies.counted(study.get_trials(deepcopy=False)))
        executor = _executor(args, spec, remaining=spec.trials - done, console=console)
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        try:
            with Progress(*columns, console=console, transient=True) as progress:
                task = progress.add_task(f"study {spec.name}", total=spec.trials, completed=min(done, spec.trials))

                def on_trial(trial: optuna.trial.FrozenTrial) -> None:
                    tracker.record(trial)
                    progress.advance(task)

                studies.run(spec, study, executor, spec.trials, on_trial, stop.is_set)
            completed = not stop.is_set()
        finally:
            executor.close()
            with console.status("writing the trials table and MLflow runs"):
                frame = tracking.trials_frame(spec, study)
                best = pareto.front(frame)
                tracking.write_parquet(frame, out / tracking.PARQUET)
                best.to_csv(out / tracking.PARETO_CSV, index=False)
                artifacts = [out / tracking.PARQUET, out / tracking.PARETO_CSV]
                tracker.finish(study, frame, set(best["number"]), artifacts, completed)
    _print_summary(console, frame, best, f"Pareto front of {spec.name}")
    # Paths and commands are printed whole (soft wrap) so that they can be copied.
    console.print(f"trials table  {out / tracking.PARQUET}", soft_wrap=True)
    console.print(f"MLflow        {uri}  (experiment '{spec.name}')", soft_wrap=True)
    if uri.startswith("sqlite:"):
        make_ui = "make ui, or " if out.resolve() == Path(MAKE_UI_OUT).resolve() else ""
        console.print(f"browse        {make_ui}mlflow ui --backend-store-uri {uri}", soft_wrap=True)
    if not completed:
        print(RESUME_HINT, file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _executor(args: argparse.Namespace, spec: StudySpec, remaining: int, console: Console) -> Executor:
    """Ray actors, or this process with --inline or when nothing is left to run (Ray's start is not free)."""
    evaluation = PluginEvaluation(spec.generator, spec.cost_model)
    if args.inline or remaining <= 0:
        return InlineExecutor(evaluation)
    with console.status("starting Ray"):
        return RayExecutor(evaluation, spec.workers, args.address)


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
    counts = frame["state"].value_counts() if not frame.empty else pd.Series(dtype=int)
    feasible = int((frame["feasible"] == True).sum()) if not frame.empty else 0  # noqa: E712 - nullable
    console.print(
        f"{len(frame)} trials: {counts.get('COMPLETE', 0)} complete ({feasible} fit in memory), "
        f"{counts.get('PRUNED', 0)} infeasible, {counts.get('FAIL', 0)} failed"
    )
    if best.empty:
        console.print("no feasible trial completed, so there is no Pareto front")
        return
    console.print(pareto.table(best, frame.attrs["objectives"], title))


def _report(args: argparse.Namespace, console: Console) -> int:
    frame = tracking.read_parquet(args.out)
    reasons = frame.loc[frame["state"] == "PRUNED", "reason"].value_counts().head(5)
    best = pareto.front(frame)
    _print_summary(console, frame, best, f"Pareto front of {frame.attrs.get('study', args.out)}")
    if not reasons.empty:
        console.print("most common infeasibility reasons:")
        for reason, count in reasons.items():
            console.print(f"  {count:4d}  {reason}", markup=False, highlight=False, soft_wrap=True)
    return 0


def _evaluate(args: argparse.Namespace, console: Console) -> int:
    point = load_point(args.point)
    evaluation = evaluate(point, plugins.generator(args.generator), plugins.cost_model(args.cost_model))
    metrics = {k: v if isinstance(v, bool) else float(v) for k, v in evaluation.metrics.items()}
    if args.json:
        print(json.dumps(metrics))
        return 0
    console.print(f"{args.point}: {point.model.name} on {point.parallel.world} NPUs, key {point.key}", soft_wrap=True)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=args.command == "evaluate" and args.json)
    try:
        return {"run": _run, "evaluate": _evaluate, "report": _report}[args.command](args, console)
    except DseError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"\n{RESUME_HINT if args.command == 'run' else 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
