"""The commands around a study's results: `dse sync`, `dse compare` and `dse nightly`.

They live here rather than in dse.cli.main so that each stays a small function over tracking, report and nightly;
dse.cli.main defines their arguments and imports this module when one of them runs.
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import optuna
from rich.console import Console

from dse.cli.outcome import EXIT_CHANGED
from dse.errors import DseError
from dse.results import folders, nightly, pareto, report, timelines, tracking
from dse.search import preflight
from dse.search import study as studies
from dse.search.executor import check_address, connect
from dse.search.space import StudySpec
from dse.search.storage import describe, holds_study

T = TypeVar("T")


def _saved_study(out: Path, spec: StudySpec) -> optuna.Study:
    """The study run into OUT, from its storage. A storage that does not hold it (a journal emptied, lost or
    replaced) is refused: opening it would start an empty study, whose empty tables would replace the folder's."""
    if not holds_study(spec.storage, out, spec.name):
        raise DseError(
            f"{describe(spec.storage, out)}: holds no study '{spec.name}', which {out / folders.SPEC_FILE} says was "
            f"run into {out}; restore the journal (or the storage), or run the study again with `dse run`"
        )
    return studies.open_study(spec, out)


def sync(args: argparse.Namespace, console: Console) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = folders.load_saved_spec(args.out)
    if spec.sweep:
        raise DseError(f"{args.out}: a sweep has no child runs to sync; `dse run` on its study again logs its run")
    study = _saved_study(args.out, spec)
    uri = tracking.saved_tracking_uri(study, args.out, args.tracking_uri)
    tracker = tracking.Tracker(uri, spec, args.out)
    tracker.start(study)
    results = tracking.write_results(spec, study, args.out)
    completed = len(studies.evaluations(study.get_trials(deepcopy=False))) >= spec.trials
    missing = tracker.finish(study, results, completed)
    if tracker.error:
        raise DseError(f"MLflow at {uri} still fails ({tracker.error}); {missing} child runs are missing, try again")
    console.print(
        f"uploaded {tracker.written} child runs and the study's artifacts to {uri} (experiment '{spec.name}')",
        soft_wrap=True,
    )
    return 0


def timeline(args: argparse.Namespace, console: Console) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = folders.load_saved_spec(args.out)
    if spec.sweep:
        raise DseError(
            f"{args.out}: a sweep keeps no trials to trace; run `dse evaluate "
            f"{args.out / tracking.BEST_DIR}/trial-N.yaml --trace FILE` on a front point"
        )
    frame = folders.read_parquet(args.out)
    numbers = set(args.trial or pareto.front(frame)["number"])
    complete = set(frame.loc[frame["state"] == "COMPLETE", "number"])
    if missing := sorted(numbers - complete):
        raise DseError(
            f"--trial {missing[0]}: {args.out} has no completed trial {missing[0]}; give one of the numbers in "
            f"{args.out / tracking.PARQUET} whose state is COMPLETE"
        )
    study = _saved_study(args.out, spec)
    trials = {trial.number: trial for trial in study.get_trials(deepcopy=False)}
    if unknown := sorted(numbers - set(trials)):
        raise DseError(
            f"--trial {unknown[0]}: {args.out / tracking.PARQUET} has trial {unknown[0]} but the study's storage "
            f"does not: the table is not this study's; `dse sync {args.out}` writes it again from the storage"
        )
    if partial := sorted(n for n in numbers if not set(spec.space) <= set(trials[n].params)):
        raise DseError(
            f"--trial {partial[0]}: the study's storage ({describe(spec.storage, args.out)}) holds trial "
            f"{partial[0]} without all its parameters (it ends inside the trial: cut by a crash or a copy), while "
            f"{args.out / tracking.PARQUET} has it complete; `dse sync {args.out}` writes the table again from the "
            "storage, or give another --trial"
        )
    uri = tracking.saved_tracking_uri(study, args.out, args.tracking_uri)
    preflight.check_study(spec)  # a cost model or generator that cannot run here: one line, not one per trial
    paths = timelines.write_timelines(spec, {n: trials[n].params for n in numbers}, args.out / timelines.TIMELINES_DIR)
    if numbers and not paths:
        raise DseError(f"cost model '{spec.cost_model}' keeps no timeline; rerun the study with cost_model: analytical")
    try:
        attached = tracking.attach_saved_timelines(uri, study, paths)
    except Exception as exc:  # the files are what was asked for; MLflow is where they are also shown
        first = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        console.print(f"warning: MLflow at {uri} failed ({first}); the traces are only on disk", soft_wrap=True)
        attached = 0
    for number, path in sorted(paths.items()):
        console.print(f"trial {number:5d}  {path}", soft_wrap=True)
    console.print(
        f"{len(paths)} timelines (open them in https://ui.perfetto.dev), {attached} newly attached to MLflow runs",
        soft_wrap=True,
    )
    return 0


def compare(args: argparse.Namespace, console: Console) -> int:
    a, b = folders.read_parquet(args.a), folders.read_parquet(args.b)
    for difference in _study_differences(args.a, args.b):
        console.print(f"warning: {difference}; the changes below compare different things", soft_wrap=True)
    console.print(report.compare(a, b, str(args.a), str(args.b)))
    return 0


def _study_differences(a: Path, b: Path) -> list[str]:
    """What makes two studies' figures incomparable: another model, another workload (from the study files they
    ran, as saved in their folders; none when a folder lacks one), other objectives."""
    try:
        spec_a, spec_b = folders.load_saved_spec(a), folders.load_saved_spec(b)
    except DseError:
        return []
    out: list[str] = []
    model_a, model_b = (spec.expanded_base.get("model", {}) for spec in (spec_a, spec_b))
    if model_a != model_b:
        names = [m.get("name", "?") if isinstance(m, dict) else str(m) for m in (model_a, model_b)]
        shown = f"{names[0]} vs {names[1]}" if names[0] != names[1] else "same name, other fields"
        out.append(f"{a} and {b} plan different models ({shown})")
    work_a, work_b = (spec.expanded_base.get("workload", {}) for spec in (spec_a, spec_b))
    if work_a != work_b:
        keys = sorted(k for k in {*work_a, *work_b} if work_a.get(k) != work_b.get(k))
        changed = ", ".join(f"{k} {work_a.get(k, '-')} vs {work_b.get(k, '-')}" for k in keys)
        out.append(f"{a} and {b} run different workloads ({changed})")
    if spec_a.metrics != spec_b.metrics:
        out.append(
            f"{a} and {b} have different objectives ({', '.join(spec_a.metrics)} vs {', '.join(spec_b.metrics)})"
        )
    return out


def run_nightly(args: argparse.Namespace, console: Console, run_study: nightly.StudyRunner) -> int:
    if not 0 <= args.threshold < 1:
        raise DseError(f"--threshold {args.threshold}: give a relative change between 0 and 1, e.g. 0.01 for 1 %")
    check_address(args.address)
    suite = nightly.load_suite(args.suite)
    night = args.night or nightly.default_night()
    root: Path = args.root
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise DseError(f"--root {root}: a file is in the way, not a folder; give a folder path") from None
    uri = tracking.tracking_uri(args.tracking_uri, root)
    night_run = nightly.NightRun(root, night, uri, args.workers, args.threshold, args.force)
    text, moved = _with_ray(args.address, lambda: nightly.run_suite(suite, night_run, run_study))
    print(text)
    print(f"report: {root / night / nightly.REPORT}", file=sys.stderr)
    return EXIT_CHANGED if moved else 0


def _with_ray(address: str | None, work: Callable[[], T]) -> T:
    """Join (or start) Ray once for the whole suite; each study's executor reuses it instead of paying a start."""
    import ray

    started = connect(address)
    try:
        return work()
    finally:
        if started:
            ray.shutdown()
