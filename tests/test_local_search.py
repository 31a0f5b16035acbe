"""The local sampler (Pareto local search): it walks the front it has found one field at a time, never proposes a
tried parameter set, and finds the whole front of the quickstart's space with a quarter of its evaluations.

The study loop is the real one (Optuna, the ask/tell loop, decoding, feasibility); the evaluation is a closed form
of the point's fields (a stand-in for the analytical model, whose exhaustive front over 1,296 points would take a
test 12 s), so that the exhaustive front is computed in the test from every point of the space.
"""

import itertools
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from dse.errors import SpecError
from dse.results.pareto import non_dominated
from dse.search.decoding import decode
from dse.search.executor import InlineExecutor
from dse.search.local_search import STARTUP
from dse.search.space import grid, load_study
from dse.search.study import evaluations, open_study, run
from dse.spec import DesignPoint

optuna.logging.set_verbosity(optuna.logging.WARNING)
QUICKSTART = Path(__file__).resolve().parents[1] / "studies" / "quickstart.yaml"
GiB = 2**30


def closed_form(point: DesignPoint) -> dict:
    """Step time and peak memory of a point, from its fields: tensor and pipeline parallelism and ZeRO shard the
    state, recomputation and micro-batches trade memory for time; constraint fits_memory against its HBM."""
    p, w = point.parallel, point.workload
    recompute = {"none": (1.0, 3.0), "selective": (1.08, 1.6), "full": (1.33, 1.0)}[p.recompute]
    state = 16 * 8e9 / (p.tp * p.pp) / {0: 1, 1: 2.5, 3: p.dp}[p.zero]
    memory = state + recompute[1] * w.micro_batch * 9e9 / p.tp * (1 + (p.pp - 1) / 4)
    step = recompute[0] * (4.0 + 0.15 * p.tp + 0.6 * (p.pp - 1) / w.micro_batch + 0.2 * (p.zero == 3))
    step *= 1 - 0.04 * np.log2(w.micro_batch)
    excess = memory - point.system.accelerator.hbm_GiB * GiB
    return {
        "metrics": {"step_time_s": step, "peak_memory_bytes": memory, "memory_excess_bytes": excess},
        "violations": {"fits_memory": excess},
    }


def exhaustive_front(spec) -> np.ndarray:
    """The distinct (step time, peak memory) pairs of the feasible front over every point of the space."""
    names, found = list(spec.space), []
    for values in itertools.product(*grid(spec).values()):
        point = decode(spec, dict(zip(names, values, strict=True)))
        if not isinstance(point, str) and (result := closed_form(point))["violations"]["fits_memory"] <= 0:
            found.append([result["metrics"]["step_time_s"], result["metrics"]["peak_memory_bytes"]])
    costs = np.array(found)
    return np.unique(costs[non_dominated(costs)], axis=0)


def searched(tmp_path: Path, sampler: str, budget: int) -> list[optuna.trial.FrozenTrial]:
    spec = load_study(QUICKSTART, sampler=sampler, seed=0, trials=budget, tracking={"child_runs": "none"})
    study = open_study(spec, tmp_path / sampler)
    run(spec, study, InlineExecutor(closed_form), budget)
    return study.get_trials(deepcopy=False)


def recovered(trials, front: np.ndarray) -> int:
    done = [t.values for t in trials if t.state == TrialState.COMPLETE and t.constraints["fits_memory"] <= 0]
    found = np.array(done)
    return sum(bool(np.isclose(found, target, rtol=1e-12).all(axis=1).any()) for target in front)


def test_the_local_sampler_finds_the_front_that_random_search_misses(tmp_path):
    spec = load_study(QUICKSTART)
    front = exhaustive_front(spec)
    assert len(front) >= 10  # a front worth walking
    local = searched(tmp_path, "local", 324)
    assert len(evaluations(local)) == 324
    assert recovered(local, front) >= 0.9 * len(front)
    assert recovered(local, front) > recovered(searched(tmp_path, "random", 324), front) + 0.2 * len(front)


def test_it_proposes_untried_neighbours_of_what_it_has_found(tmp_path):
    trials = sorted(searched(tmp_path, "local", 120), key=lambda t: t.number)
    keys = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(keys)) == len(keys)  # no parameter set asked twice
    feasible = [t for t in trials if t.state == TrialState.COMPLETE and t.constraints["fits_memory"] <= 0]
    walked = [t for t in trials if sum(f.number < t.number - 2 for f in feasible) >= STARTUP]  # two asked ahead
    assert len(walked) > 60
    for trial in walked:
        earlier = [f for f in feasible if f.number < trial.number]
        assert any(sum(f.params[k] != trial.params[k] for k in trial.params) == 1 for f in earlier), trial.params


def test_a_float_range_is_refused_naming_the_field(tmp_path):
    study = tmp_path / "study.yaml"
    study.write_text(
        QUICKSTART.read_text()
        .replace("sampler: nsga2", "sampler: local")
        .replace(
            "system.accelerator.hbm_GiB: {choices: [80, 96, 141]}", "system.accelerator.hbm_GiB: {low: 80, high: 141.5}"
        )
    )
    with pytest.raises(SpecError) as error:
        load_study(study)
    assert f"{study}: field 'space.system.accelerator.hbm_GiB': the local sampler walks a discrete space" in str(
        error.value
    )
