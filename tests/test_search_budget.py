"""Search that does not waste its budget: the budget counts evaluations, evolutionary samplers breed their
generations from completed trials under ask-ahead, and feasibility-only dimensions are resolved from one evaluation.

Real Optuna and the real plugins (tiny-llama on the analytical model prices a point in milliseconds); the
generation test runs on the session's Ray, whose pool asks ahead of the workers.
"""

import sys
from collections import Counter
from pathlib import Path

import optuna
import pandas as pd
import pytest
import ray.cloudpickle
import yaml
from mlflow import MlflowClient
from optuna.trial import TrialState

from dse.cli.main import main
from dse.errors import SpecError
from dse.search.decoding import decode
from dse.search.executor import InlineExecutor, PluginEvaluation, RayExecutor
from dse.search.space import load_study
from dse.search.study import DUPLICATE_OF, POINT_KEY, RESOLVED_FROM, evaluations, open_study, run
from dse.spec import DesignPoint

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
optuna.logging.set_verbosity(optuna.logging.WARNING)

TWELVE_POINTS = {
    "name": "twelve",
    "seed": 3,
    "objectives": {"step_time": "minimize", "peak_memory": "minimize"},
    "constraints": ["fits_memory"],
    "sampler": "tpe",
    "trials": 10,
    "workers": 1,
    "tracking": {"child_runs": "none"},
    "base": {
        "model": "tiny-llama",
        "workload": {"mode": "train", "seq_len": 512, "global_batch": 16},
        "parallel": {"pp": 1},
        "system": "tiny-ring",
    },
    "space": {"parallel.tp": {"choices": [1, 2, 4, 8]}, "parallel.zero": {"choices": [0, 1, 3]}},
    "derived": {"parallel.dp": "world / parallel.tp"},
}
"""A space of 12 points, every one feasible: tp x ZeRO stage on 8 NPUs."""


def study_file(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({**TWELVE_POINTS, **changes}))
    return path


class Recording(PluginEvaluation):
    """The real evaluation, remembering each point it evaluated."""

    def __init__(self, spec) -> None:
        super().__init__(spec.generator, spec.cost_model, spec.cost_model_options)
        self.points: list[DesignPoint] = []

    def __call__(self, point: DesignPoint) -> dict:
        self.points.append(point)
        return super().__call__(point)


def test_duplicate_trials_do_not_reduce_the_distinct_points_evaluated_below_the_budget(tmp_path):
    spec = load_study(study_file(tmp_path), trials=10)
    study = open_study(spec, tmp_path / "out")
    evaluation = Recording(spec)
    ending = run(spec, study, InlineExecutor(evaluation), spec.trials)
    keys = [point.key for point in evaluation.points]
    assert ending is None
    assert len(keys) == len(set(keys)) == len(evaluations(study.trials)) == 10
    repeats = [t for t in study.trials if DUPLICATE_OF in t.user_attrs]
    assert repeats, "TPE on 12 points proposes evaluated ones again"
    for trial in repeats:  # answered from the stored result, not evaluated again
        first = study.trials[trial.user_attrs[DUPLICATE_OF]]
        assert (first.user_attrs[POINT_KEY], first.values) == (trial.user_attrs[POINT_KEY], trial.values)
        assert trial.state == TrialState.COMPLETE


def test_a_budget_beyond_the_space_stops_when_the_space_is_exhausted_and_says_so(tmp_path, capsys):
    """... and MLflow gets a child run per evaluated point, none for a repeat (the trials table keeps those)."""
    out = tmp_path / "out"
    tracked = study_file(tmp_path, tracking={"child_runs": "all"})
    assert main(["run", str(tracked), "--trials", "20", "--out", str(out), "--inline"]) == 0
    printed = capsys.readouterr().out
    assert "stopped before 20 evaluations: the space is exhausted" in printed
    frame = pd.read_parquet(out / "trials.parquet")
    duplicates = int(frame["duplicate_of"].notna().sum())
    assert frame["evaluation"].sum() == frame["point_key"].nunique() == 12
    assert f"{len(frame)} trials: 12 evaluations, {duplicates} repeats of an evaluated point, 0 pruned" in printed
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    children = client.search_runs([client.get_experiment_by_name("twelve").experiment_id], "tags.trial_number != ''")
    assert duplicates and len(children) == 12
    # A resume finds the space exhausted at once: nothing is evaluated again.
    assert main(["run", str(study_file(tmp_path)), "--trials", "20", "--out", str(out), "--inline"]) == 0
    assert "the space is exhausted" in capsys.readouterr().out
    assert pd.read_parquet(out / "trials.parquet")["evaluation"].sum() == 12


def by_parallel_degrees(point: DesignPoint) -> dict:
    """Fast and deterministic: smaller tp x pp is faster and needs more memory; every point fits."""
    p = point.parallel
    memory = 400.0 / (p.tp * p.pp) + point.workload.micro_batch + point.system.accelerator.hbm_GiB / 1000
    return {
        "metrics": {"step_time_s": p.tp + p.pp + 0.1 * point.workload.micro_batch, "peak_memory_bytes": memory},
        "violations": {"fits_memory": -1.0},
    }


def generations_run(tmp_path: Path, sampler: str, population: int) -> optuna.Study:
    small = Path(__file__).parents[1] / "studies" / "small.yaml"
    extra = {"population_size": population} if sampler == "nsga2" else {}
    spec = load_study(small, trials=3 * population, sampler=sampler, seed=11, **extra)
    study = open_study(spec, tmp_path / sampler)
    executor = RayExecutor(by_parallel_degrees, workers=2)
    try:
        assert executor.capacity > population, "the pool asks further ahead than a generation"
        run(spec, study, executor, spec.trials)
    finally:
        executor.close()
    return study


def test_nsga2_breeds_each_generation_from_completed_trials_under_ask_ahead(ray_address, tmp_path):
    population = 8
    nsga2 = generations_run(tmp_path, "nsga2", population)
    random = generations_run(tmp_path, "random", population)
    key = optuna.samplers.NSGAIISampler._get_generation_key()
    complete = [t for t in nsga2.trials if t.state == TrialState.COMPLETE]
    per_generation = Counter(t.system_attrs[key] for t in complete if key in t.system_attrs)
    assert per_generation[0] == population, "generation 0 is one population, not everything asked ahead"
    assert max(per_generation) >= 2
    assert [t.params for t in nsga2.trials[:population]] == [t.params for t in random.trials[:population]]
    # Bred from generation 0 as soon as its population completed (the issue: 69-87 trials drawn as the random
    # sampler draws them), and from then on unlike the random sampler's trials of the same number.
    bred = [t for t in nsga2.trials if t.system_attrs.get(key, 0) > 0]
    assert bred[0].number < 2 * population
    pairs = [(t.params, random.trials[t.number].params) for t in bred if t.number < len(random.trials)]
    assert len(pairs) >= population and sum(a != b for a, b in pairs) >= 0.8 * len(pairs)


HBM = [0.52, 0.53, 80]
"""HBM sizes (GiB) around tiny-llama's peak memory with ZeRO 1 (0.515 GiB at tp 8 to 0.544 at tp 1)."""


def test_a_feasibility_only_dimension_is_resolved_from_one_evaluation_per_configuration(tmp_path):
    space = {
        "parallel.tp": {"choices": [1, 2, 4, 8]},
        "system.accelerator.hbm_GiB": {"choices": HBM, "feasibility_only": True},
    }
    path = study_file(tmp_path, space=space, base={**TWELVE_POINTS["base"], "parallel": {"pp": 1, "zero": 1}})
    spec = load_study(path, trials=12, sampler="random")
    study = open_study(spec, tmp_path / "out")
    evaluation = Recording(spec)
    ending = run(spec, study, InlineExecutor(evaluation), spec.trials)
    assert ending is not None and "exhausted" in ending
    assert len(evaluation.points) == 4, "one evaluation per configuration"
    assert {p.system.accelerator.hbm_GiB for p in evaluation.points} == {80}, "at the largest capacity"
    finished = {tuple(t.params.values()): t for t in study.trials if t.state == TrialState.COMPLETE}
    assert len(finished) == 12 and any(RESOLVED_FROM in t.user_attrs for t in finished.values())
    direct = PluginEvaluation(spec.generator, spec.cost_model, spec.cost_model_options)
    fits = Counter()
    for (tp, hbm), trial in finished.items():
        point = decode(spec, {"parallel.tp": tp, "system.accelerator.hbm_GiB": hbm})
        expected = direct(point)
        assert trial.values == [expected["metrics"][m] for m in spec.metrics]
        assert trial.constraints == expected["violations"]
        for metric in ("hbm_bytes", "memory_excess_bytes", "fits_memory", "mfu", "peak_memory_bytes"):
            assert trial.user_attrs["metrics"][metric] == expected["metrics"][metric], metric
        fits[expected["metrics"]["fits_memory"]] += 1
    assert fits[True] and fits[False], "some points fit only the larger sizes"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"space": {"parallel.tp": {"choices": [1, 2], "feasibility_only": True}}},
            "field 'space.parallel.tp.feasibility_only': parallel.tp can change what a point costs",
        ),
        (
            {"sampler": "tpe", "population_size": 10},
            "field 'population_size': only the evolutionary samplers (nsga2, nsga3) breed generations, not tpe",
        ),
    ],
)
def test_search_settings_a_study_cannot_honour_are_refused_naming_the_field(tmp_path, changes, message):
    with pytest.raises(SpecError, match=None) as error:
        load_study(study_file(tmp_path, **changes))
    assert message in str(error.value) and str(tmp_path / "study.yaml") in str(error.value)


@pytest.mark.parametrize("sampler", ["gp", "nsga3"])
def test_the_gp_and_nsga3_samplers_run_a_study(tmp_path, sampler):
    spec = load_study(study_file(tmp_path), trials=6, sampler=sampler)
    study = open_study(spec, tmp_path / "out")
    run(spec, study, InlineExecutor(Recording(spec)), spec.trials)
    assert len(evaluations(study.trials)) == 6
    assert type(study.sampler).__name__ == {"gp": "GPSampler", "nsga3": "NSGAIIISampler"}[sampler]
