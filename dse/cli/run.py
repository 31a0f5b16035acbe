"""`dse run` and `dse report`: run (or resume) a study and print its results; summarise a finished one.

An interrupted study says how to resume it and exits with 130 (dse.cli.outcome).
"""

import argparse
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dse import lru
from dse.cli import outcome, ui
from dse.cli import sweep as sweep_command
from dse.cli.outcome import EXIT_INTERRUPTED, RESUME_HINT
from dse.errors import DseError
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


def run_command(args: argparse.Namespace, console: Console) -> int:
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
        return sweep_command.run(args, spec, out, uri, console, _stop_on_interrupt, print_summary)
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
        print_summary(console, frame, best, f"Pareto front of {spec.name}")
        refinement.print_refinement(console, frame)
        with console.status("writing the Pareto plots and the MLflow runs"):
            tracking.write_plots(spec, results, out)
            missing = tracker.finish(study, results, completed)
    if caches := lru.summary():
        print(caches, file=sys.stderr)  # the trials priced here (--inline, or before Ray started), not Ray's
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


def print_summary(console: Console, frame: pd.DataFrame, best: pd.DataFrame, title: str) -> None:
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


def report_command(args: argparse.Namespace, console: Console) -> int:
    frame = folders.read_parquet(args.out)
    reasons = frame.loc[frame["state"] == "PRUNED", "reason"].value_counts().head(5)
    best = pareto.front(frame)
    print_summary(console, frame, best, f"Pareto front of {frame.attrs.get('study', args.out)}")
    written = report.print_report(console, frame, args.out)
    refinement.print_refinement(console, frame)
    if not reasons.empty:
        console.print("most common infeasibility reasons:")
        for reason, count in reasons.items():
            console.print(f"  {count:4d}  {reason}", highlight=False, soft_wrap=True)
    console.print(f"plots         {'  '.join(str(path) for path in written)}", soft_wrap=True)
    return 0
