"""How much of the exhaustive Pareto front each sampler finds with 5 %, 10 % and 25 % of the quickstart's space.

The ground truth is every point of studies/quickstart.yaml (1,296) priced once through the per-point path, with
the study's own generator, cost model, objectives and constraints (the evaluation a study's trial runs, without a
trial), kept in benchmarks/data/quickstart_exhaustive.parquet; `--recompute` rebuilds it. Each sampler then runs
the study with the study API (the ask/tell loop `dse run --inline` runs, without MLflow) at each budget and seed,
and its trials are scored against that front:

- hypervolume ratio: the hypervolume of the feasible completed trials over the exhaustive feasible set's, both
  with Optuna's `optuna._hypervolume.compute_hypervolume` (what Optuna's own hypervolume history plot uses) and the
  reference point at the nadir of the exhaustive feasible set (the worst feasible value of each objective), not a
  1.1x margin that would reward the front's extremes;
- front points recovered: the exhaustive front's trade-offs (distinct objective vectors; the points that tie on
  them differ only in HBM capacity) among the study's feasible trials;
- evaluations to reach 95 % and 99 % of the exhaustive hypervolume ("-": not reached within the budget);
- wasted trials: trials that spent no evaluation (repeats of an evaluated point and pruned trials).

Figures are medians over the seeds. Run: .venv/bin/python benchmarks/search_quality.py [--seeds 3] [--recompute]
"""

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
from optuna._hypervolume import compute_hypervolume
from optuna.trial import FrozenTrial, TrialState

from dse.results.pareto import non_dominated
from dse.search.executor import InlineExecutor, PluginEvaluation
from dse.search.space import StudySpec, decode, grid, load_study
from dse.search.study import evaluations, is_evaluation, open_study, run

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "studies" / "quickstart.yaml"
EXHAUSTIVE = Path(__file__).resolve().parent / "data" / "quickstart_exhaustive.parquet"
SAMPLERS = ("random", "tpe", "nsga2", "nsga3", "gp")
DEFAULT_SAMPLERS = ("random", "tpe", "nsga2", "nsga3")
"""gp (Optuna's GPSampler, torch) only when asked: over minutes per run at these budgets on 2 cores."""
BUDGETS = (0.05, 0.10, 0.25)
TARGETS = (0.95, 0.99)


def exhaustive(spec: StudySpec) -> pd.DataFrame:
    """Every point of the space: its key, parameters, objective metrics and feasibility (a point that cannot run
    has no key and no metrics, and is not feasible)."""
    evaluation = PluginEvaluation(spec.generator, spec.cost_model, spec.cost_model_options)
    names = list(spec.space)
    rows = []
    for values in itertools.product(*grid(spec).values()):
        params = dict(zip(names, values, strict=True))
        point = decode(spec, params)
        row: dict = {"point_key": None, **params, **dict.fromkeys(spec.metrics, float("nan")), "feasible": False}
        if not isinstance(point, str):
            result = evaluation(point)
            row.update({metric: result["metrics"][metric] for metric in spec.metrics})
            row.update(point_key=point.key, feasible=all(v <= 0 for v in result["violations"].values()))
        rows.append(row)
    return pd.DataFrame(rows)


def costs(values: np.ndarray, spec: StudySpec) -> np.ndarray:
    """Objective values as costs to minimise (maximised objectives negated)."""
    return values * np.array([1.0 if d == "minimize" else -1.0 for d in spec.directions])


def hypervolume(points: np.ndarray, reference: np.ndarray) -> float:
    """Hypervolume of cost points against the reference; points not strictly better in every objective add none."""
    inside = points[np.all(points < reference, axis=1)]
    return compute_hypervolume(inside, reference) if len(inside) else 0.0


def run_study(sampler: str, budget: int, seed: int) -> list[FrozenTrial]:
    """The study's trials after a run of `budget` evaluations with this sampler and seed, in a fresh storage."""
    spec = load_study(STUDY, sampler=sampler, seed=seed, trials=budget, tracking={"child_runs": "none"})
    evaluation = PluginEvaluation(spec.generator, spec.cost_model, spec.cost_model_options)
    with tempfile.TemporaryDirectory() as out:
        study = open_study(spec, Path(out))
        run(spec, study, InlineExecutor(evaluation), budget)
        return study.get_trials(deepcopy=False)


def score(trials: list[FrozenTrial], spec: StudySpec, truth: dict) -> dict:
    """A run's figures against the exhaustive front (see the module docstring)."""
    found: list[np.ndarray] = []
    reached: dict[float, int | None] = dict.fromkeys(TARGETS)
    spent = 0
    ratio = 0.0
    for trial in sorted(trials, key=lambda t: t.number):
        spent += is_evaluation(trial)
        feasible = trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())
        if not feasible:
            continue
        found.append(costs(np.array(trial.values, dtype=float), spec))
        ratio = hypervolume(np.array(found), truth["reference"]) / truth["hypervolume"]
        for target in TARGETS:
            if reached[target] is None and ratio >= target - 1e-12:
                reached[target] = spent
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)]
    return {
        "ratio": ratio,
        "recovered": recovered(np.array(found).reshape(-1, len(spec.metrics)), truth["front"]),
        "reached": reached,
        "wasted": len(finished) - len(evaluations(trials)),
        "trials": len(finished),
    }


def recovered(found: np.ndarray, front: np.ndarray) -> int:
    """How many of the front's trade-offs (distinct cost vectors) the found points include."""
    return int(sum(np.isclose(found, target, rtol=1e-9, atol=0).all(axis=1).any() for target in front))


def ground_truth(frame: pd.DataFrame, spec: StudySpec) -> dict:
    """The exhaustive feasible set's nadir (the reference point), its hypervolume and its front as distinct cost
    vectors: points that differ only in a dimension that decides feasibility alone (HBM capacity) tie on every
    objective and are one trade-off, found when any of them is."""
    feasible = frame[frame["feasible"]]
    points = costs(feasible[spec.metrics].to_numpy(dtype=float), spec)
    reference = points.max(axis=0)
    front = np.unique(points[non_dominated(points)], axis=0)
    return {
        "reference": reference,
        "hypervolume": hypervolume(points, reference),
        "front": front,
        "size": len(front),
        "feasible": len(feasible),
    }


def median_or_dash(values: Sequence[int | None]) -> str:
    """The median of the seeds that reached a target, with how many did when not all of them."""
    reached = [v for v in values if v is not None]
    if not reached:
        return "-"
    shown = f"{statistics.median(reached):.0f}"
    return shown if len(reached) == len(values) else f"{shown} ({len(reached)}/{len(values)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recompute", action="store_true", help="rebuild the exhaustive front's data file")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samplers", nargs="+", default=list(DEFAULT_SAMPLERS), choices=SAMPLERS)
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    began = time.perf_counter()
    spec = load_study(STUDY, tracking={"child_runs": "none"})
    if args.recompute or not EXHAUSTIVE.exists():
        start = time.perf_counter()
        frame = exhaustive(spec)
        EXHAUSTIVE.parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(EXHAUSTIVE, index=False, compression="zstd")
        print(f"exhaustive: {len(frame)} points priced in {time.perf_counter() - start:.1f} s -> {EXHAUSTIVE.name}")
    frame = pd.read_parquet(EXHAUSTIVE)
    truth = ground_truth(frame, spec)
    reference = ", ".join(f"{m} {v:.6g}" for m, v in zip(spec.metrics, truth["reference"], strict=True))
    print(
        f"{STUDY.name}: {len(frame)} points, {truth['feasible']} feasible, exhaustive front {truth['size']} points; "
        f"reference point (nadir of the feasible set, as costs): {reference}; {args.seeds} seeds, medians"
    )
    header = (
        f"{'sampler':<8} {'budget':>9} {'HV ratio':>9} {'front':>8} {'evals→95%':>11} {'evals→99%':>11} {'wasted':>14}"
    )
    print(header)
    for sampler in args.samplers:
        for share in BUDGETS:
            budget = round(share * len(frame))
            scores = [score(run_study(sampler, budget, seed), spec, truth) for seed in range(args.seeds)]
            ratio = statistics.median(s["ratio"] for s in scores)
            recovered = f"{statistics.median(s['recovered'] for s in scores):.0f}/{truth['size']}"
            trials = statistics.median(s["trials"] for s in scores)
            wasted = f"{statistics.median(s['wasted'] for s in scores):.0f} of {trials:.0f}"
            reached = " ".join(f"{median_or_dash([s['reached'][t] for s in scores]):>11}" for t in TARGETS)
            print(
                f"{sampler:<8} {f'{budget} ({share:.0%})':>9} {ratio:>9.4f} {recovered:>8} {reached} {wasted:>14}",
                flush=True,
            )
    print(f"wall time {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
