"""How much of the exhaustive Pareto front each sampler finds with a small share of a space's evaluations.

Three spaces, each with its ground truth, every point priced once through the per-point path with the study's own
generator, cost model, objectives and constraints (the evaluation a study's trial runs, without a trial), kept in
benchmarks/data/<study>_exhaustive.parquet; `--recompute` rebuilds it:
- studies/quickstart.yaml, 1,296 points, at 5 %, 10 % and 25 % of the space;
- studies/parallel-13b.yaml, 110,592 points (36,864 configurations times 3 HBM sizes, a feasibility-only
  dimension), at 0.25 %, 0.5 % and 1 % of the space: Llama-2-13B's execution strategies on 64 H100s;
- studies/serving-70b.yaml, 5,040 points, at 2.5 %, 5 % and 10 %: serving Llama-3-70B on 8-32 H100s, one decode step
  (latency per token against tokens per second per GPU) over the TP/PP split, the sequences in flight, the
  micro-batch, the number of nodes and HBM size.
Each sampler then runs the study with the study API (the ask/tell loop `dse run --inline` runs, without MLflow)
once per seed at the largest budget, scored at each budget on its trials up to that many evaluations; evaluations
are answered from the table (`TableEvaluation`: the same deterministic figures, so that 5 seeds of every sampler
take minutes, not hours; `check` re-evaluates a sample live and prints the largest difference). A run's trials
are scored against the exhaustive front:

- hypervolume ratio: the hypervolume of the feasible completed trials over the exhaustive feasible set's, both
  with Optuna's `optuna._hypervolume.compute_hypervolume` (what Optuna's own hypervolume history plot uses) and the
  reference point at the nadir of the exhaustive feasible set (the worst feasible value of each objective), not a
  1.1x margin that would reward the front's extremes;
- front points recovered: the exhaustive front's trade-offs (distinct objective vectors; the points that tie on
  them differ only in HBM capacity) among the study's feasible trials;
- evaluations to reach 95 % and 99 % of the exhaustive hypervolume ("-": not reached within the budget);
- wasted trials: trials that spent no evaluation (repeats of an evaluated point and pruned trials).

Figures are medians over the seeds.
Run: .venv/bin/python benchmarks/search_quality.py [--spaces quickstart parallel-13b serving-70b] [--seeds 5]
[--recompute]
"""

import argparse
import itertools
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd
from optuna._hypervolume import compute_hypervolume
from optuna.trial import FrozenTrial, TrialState

from dse.results.pareto import non_dominated
from dse.search import capacity
from dse.search.decoding import decode
from dse.search.executor import InlineExecutor, PluginEvaluation, Result
from dse.search.space import MEMORY_CONSTRAINT, StudySpec, grid, load_study
from dse.search.study import evaluations, is_evaluation, open_study, run
from dse.spec import DesignPoint

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Space:
    """A benchmark space: its study file and the budgets measured, as shares of its points."""

    study: Path
    budgets: tuple[float, ...]

    @property
    def data(self) -> Path:
        return DATA / f"{self.study.stem}_exhaustive.parquet"


SPACES = {
    "quickstart": Space(ROOT / "studies" / "quickstart.yaml", (0.05, 0.10, 0.25)),
    "parallel-13b": Space(ROOT / "studies" / "parallel-13b.yaml", (0.0025, 0.005, 0.01)),
    "serving-70b": Space(ROOT / "studies" / "serving-70b.yaml", (0.025, 0.05, 0.10)),
}
SAMPLERS = ("random", "tpe", "nsga2", "nsga3", "local", "gp")
DEFAULT_SAMPLERS = ("random", "tpe", "nsga2", "nsga3", "local")
"""gp (Optuna's GPSampler, torch) only when asked: over minutes per run at these budgets on 2 cores."""
TARGETS = (0.95, 0.99)


def exhaustive(spec: StudySpec, processes: int) -> pd.DataFrame:
    """Every point of the space: its key, parameters, objective metrics, memory excess, feasibility and, for a
    point whose evaluation failed, the error (a point that cannot run has no key and no metrics, and is not
    feasible). A configuration is evaluated once, at the largest value of its feasibility-only dimensions, and its
    result derived for the others (`dse.search.capacity`), as a study does; the evaluations run in `processes`
    worker processes."""
    names = list(spec.space)
    rows = []
    evaluated: dict[str, dict[str, Any]] = {}  # params evaluated, by the evaluated point's key
    decoded: dict[tuple, DesignPoint | str] = {}
    for values in itertools.product(*grid(spec).values()):
        params = dict(zip(names, values, strict=True))
        point = decode(spec, params)
        at_largest = capacity.canonical(spec, params)
        canonical = decoded.get(key := tuple(at_largest.values()))
        if canonical is None:
            canonical = decoded[key] = decode(spec, at_largest)
        rows.append((params, point, canonical))
        if not isinstance(point, str) and not isinstance(canonical, str):
            evaluated.setdefault(canonical.key, at_largest)
    keys = list(evaluated)
    with multiprocessing.get_context("spawn").Pool(processes, _start_worker, (spec.source,)) as pool:
        results = dict(zip(keys, pool.map(_evaluate, [evaluated[k] for k in keys], chunksize=64), strict=True))
    out = []
    for params, point, canonical in rows:
        row: dict[str, Any] = {"point_key": None, **params, **dict.fromkeys(KEPT, float("nan"))}
        row.update(feasible=False, error=None)
        if not isinstance(point, str) and not isinstance(canonical, str):
            result = results[canonical.key]
            row["point_key"] = point.key
            if isinstance(result, str):
                row["error"] = result
            else:
                result = capacity.at_capacity(spec, result, point)
                row.update({metric: result["metrics"][metric] for metric in KEPT})
                row["feasible"] = all(v <= 0 for v in result["violations"].values())
        out.append(row)
    return pd.DataFrame(out)


KEPT = ("step_time_s", "tokens_per_s_per_gpu", "peak_memory_bytes", "memory_excess_bytes")
"""The metrics kept per point: the benchmark spaces' objectives, peak memory and the memory constraint's violation
(what a result needs to be derived for another HBM size, `capacity.at_capacity`)."""
_worker: dict[str, Any] = {}


def _start_worker(source: str) -> None:
    spec = load_study(Path(source), tracking={"child_runs": "none"})
    _worker.update(spec=spec, evaluation=PluginEvaluation(spec.generator, spec.cost_model, spec.cost_model_options))


def _evaluate(params: dict[str, Any]) -> Result | str:
    """The study's evaluation of one configuration in a worker process, or its error as a line."""
    point = decode(_worker["spec"], params)
    assert not isinstance(point, str)
    try:
        return _worker["evaluation"](point)
    except Exception as exc:  # a failed evaluation is a row of the ground truth, as a failed trial is
        return f"{type(exc).__name__}: {exc}"


class TableEvaluation:
    """The study's evaluation answered from the exhaustive table: the figures the evaluation gave when the table
    was built (it is deterministic; `check` re-evaluates a sample live), so that every sampler, budget and seed
    runs in seconds. A study asks it only for points it evaluates, at the largest value of feasibility-only
    dimensions, whose rows hold that evaluation's own figures."""

    def __init__(self, frame: pd.DataFrame) -> None:
        rows = frame[frame["point_key"].notna()]
        self._kept = [metric for metric in KEPT if metric in frame]
        self._rows = dict(zip(rows["point_key"], rows[[*self._kept, "error"]].itertuples(index=False), strict=True))

    def __call__(self, point: Any) -> Result:
        row = self._rows[point.key]
        if row.error is not None:
            raise RuntimeError(row.error)
        metrics = {metric: float(getattr(row, metric)) for metric in self._kept}
        excess = metrics["memory_excess_bytes"]
        return {"metrics": {**metrics, "fits_memory": excess <= 0}, "violations": {MEMORY_CONSTRAINT: excess}}


def check(spec: StudySpec, frame: pd.DataFrame, sample: int) -> float:
    """The largest relative difference between the table and a live evaluation, over `sample` evaluated rows
    drawn at random (a stale table, built by older code, shows here)."""
    largest = {name: param.largest for name, param in capacity.feasibility_only(spec).items()}
    rows = frame[frame["point_key"].notna() & frame["error"].isna()]
    for name, value in largest.items():
        rows = rows[rows[name] == value]
    evaluation = PluginEvaluation(spec.generator, spec.cost_model, spec.cost_model_options)
    worst = 0.0
    for _, row in rows.sample(min(sample, len(rows)), random_state=0).iterrows():
        point = decode(spec, {name: _plain(row[name]) for name in spec.space})
        assert not isinstance(point, str) and point.key == row["point_key"]
        metrics = evaluation(point)["metrics"]
        worst = max(worst, *(abs(metrics[m] / row[m] - 1) for m in ("step_time_s", "peak_memory_bytes")))
    return worst


def _plain(value: Any) -> Any:
    """A parameter value read back from the table as the Python value the space lists (numpy scalars are not)."""
    return value.item() if isinstance(value, np.generic) else value


def costs(values: np.ndarray, spec: StudySpec) -> np.ndarray:
    """Objective values as costs to minimise (maximised objectives negated)."""
    return values * np.array([1.0 if d == "minimize" else -1.0 for d in spec.directions])


def hypervolume(points: np.ndarray, reference: np.ndarray) -> float:
    """Hypervolume of cost points against the reference; points not strictly better in every objective add none."""
    inside = points[np.all(points < reference, axis=1)]
    return compute_hypervolume(inside, reference) if len(inside) else 0.0


def run_study(source: Path, table: TableEvaluation, sampler: str, budget: int, seed: int) -> list[FrozenTrial]:
    """The study's trials after a run of `budget` evaluations with this sampler and seed, in a fresh storage."""
    spec = load_study(source, sampler=sampler, seed=seed, trials=budget, tracking={"child_runs": "none"})
    with tempfile.TemporaryDirectory() as out:
        study = open_study(spec, Path(out))
        run(spec, study, InlineExecutor(table), budget)
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
    parser.add_argument("--spaces", nargs="+", default=list(SPACES), choices=list(SPACES))
    parser.add_argument("--recompute", action="store_true", help="rebuild the exhaustive fronts' data files")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samplers", nargs="+", default=list(DEFAULT_SAMPLERS), choices=SAMPLERS)
    parser.add_argument("--processes", type=int, default=2, help="worker processes building a data file")
    parser.add_argument("--check", type=int, default=20, help="rows of each table re-evaluated live")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    began = time.perf_counter()
    for name in args.spaces:
        measure(SPACES[name], args)
    print(f"wall time {time.perf_counter() - began:.0f} s")
    return 0


def measure(space: Space, args: argparse.Namespace) -> None:
    """Print one space's table."""
    spec = load_study(space.study, tracking={"child_runs": "none"})
    if args.recompute or not space.data.exists():
        start = time.perf_counter()
        frame = exhaustive(spec, args.processes)
        DATA.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(space.data, index=False, compression="zstd")
        print(f"exhaustive: {len(frame)} points priced in {time.perf_counter() - start:.1f} s -> {space.data.name}")
    frame = pd.read_parquet(space.data)
    truth = ground_truth(frame, spec)
    reference = ", ".join(f"{m} {v:.6g}" for m, v in zip(spec.metrics, truth["reference"], strict=True))
    print(
        f"{space.study.name}: {len(frame)} points, {truth['feasible']} feasible, exhaustive front {truth['size']} "
        f"points; reference point (nadir of the feasible set, as costs): {reference}; {args.seeds} seeds, medians; "
        f"table against a live evaluation of {args.check} rows: largest difference {check(spec, frame, args.check):.1e}"
    )
    header = (
        f"{'sampler':<8} {'budget':>12} {'HV ratio':>9} {'front':>8} {'evals→95%':>11} {'evals→99%':>11} {'wasted':>14}"
    )
    print(header)
    table = TableEvaluation(frame)
    budgets = [round(share * len(frame)) for share in space.budgets]
    for sampler in args.samplers:
        runs, seconds = [], []
        for seed in range(args.seeds):
            start = time.perf_counter()
            runs.append(run_study(space.study, table, sampler, max(budgets), seed))
            seconds.append(time.perf_counter() - start)
        for share, budget in zip(space.budgets, budgets, strict=True):
            scores = [score(first_evaluations(trials, budget), spec, truth) for trials in runs]
            ratio = statistics.median(s["ratio"] for s in scores)
            recovered = f"{statistics.median(s['recovered'] for s in scores):.0f}/{truth['size']}"
            trials = statistics.median(s["trials"] for s in scores)
            wasted = f"{statistics.median(s['wasted'] for s in scores):.0f} of {trials:.0f}"
            reached = " ".join(f"{median_or_dash([s['reached'][t] for s in scores]):>11}" for t in TARGETS)
            print(
                f"{sampler:<8} {f'{budget} ({share:.2%})':>12} {ratio:>9.4f} {recovered:>8} {reached} {wasted:>14}"
                + (f"  {statistics.median(seconds):.0f} s a run" if budget == max(budgets) else ""),
                flush=True,
            )


def first_evaluations(trials: list[FrozenTrial], budget: int) -> list[FrozenTrial]:
    """The trials of a run up to the one that spent its `budget`-th evaluation: what a run with that budget does,
    as no sampler here knows the budget (a seed asks the same trials whatever it is)."""
    out, spent = [], 0
    for trial in sorted(trials, key=lambda t: t.number):
        if spent >= budget:
            break
        out.append(trial)
        spent += is_evaluation(trial)
    return out


if __name__ == "__main__":
    sys.exit(main())
