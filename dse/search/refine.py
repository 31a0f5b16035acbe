"""Multi-fidelity studies: the best screened points priced again with a second, slower cost model (`refine:` in the
study file), both results kept.

Which points: the feasible Pareto members and the `top_k` best feasible points per objective, one trial per design
point (its first). When: after the search, and with `every: N` after every N evaluations, each time only the
points not refined yet. How: through the study's executor (the Ray actors, in parallel), as the refining cost
model's evaluation of the same point (`PluginEvaluation.refine`).

Where the result lives: Optuna refuses new attributes on a finished trial in every storage (InMemory and the
journal raise UpdateFinishedTrialError, RDB checks the state too, and a journal reader drops such a line written by
another process), so a refinement is a *study* user attribute, `refined:<point key>` -> {cost_model, options,
trial, metrics, feasible and node | reason}, one journal line each. The storage stays the record of truth: Parquet and
MLflow are rebuilt from it, and a resume refines only the points that have no record for the refine section's cost
model and options (a changed section refines them again). A refinement that raises keeps its reason; the screened
trial is untouched either way.
"""

import math
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from dse.search import study as studies
from dse.search.decoding import decode
from dse.search.executor import NODE, Executor
from dse.search.space import StudySpec
from dse.search.study import POINT_KEY, STOP_POLL_S, OnTrial, evaluations

REFINED = "refined:"
"""Prefix of the study user attributes that hold the refinements, one per design point: REFINED + point key."""
OnRefined = Callable[[str, dict[str, Any]], None]
"""Hears each refinement stored: the point key and its record."""


def fidelity(spec: StudySpec) -> dict[str, Any]:
    """What a refinement record must match to count as done: the refine section's cost model and options."""
    assert spec.refine is not None
    out = {"cost_model": spec.refine.cost_model, "options": dict(spec.refine.cost_model_options)}
    return out | ({"serving_depth": spec.refine.serving_depth} if spec.refine.serving_depth else {})


def records(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """Every refinement stored in the study, by point key."""
    return {key.removeprefix(REFINED): value for key, value in study.user_attrs.items() if key.startswith(REFINED)}


def candidates(spec: StudySpec, study: optuna.Study) -> list[FrozenTrial]:
    """The trials to refine, in trial order: the first trial of each design point that is a feasible Pareto member
    or among the `top_k` best feasible trials of some objective."""
    assert spec.refine is not None
    first: dict[str, FrozenTrial] = {}
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if POINT_KEY in trial.user_attrs and all(v <= 0 for v in trial.constraints.values()):
            first.setdefault(trial.user_attrs[POINT_KEY], trial)
    chosen = {t.user_attrs[POINT_KEY] for t in study.best_trials if POINT_KEY in t.user_attrs} & set(first)
    for index, direction in enumerate(spec.directions):
        sign = 1.0 if direction == "minimize" else -1.0
        ranked = sorted(first.values(), key=lambda t: (sign * t.values[index], t.number))
        chosen.update(t.user_attrs[POINT_KEY] for t in ranked[: spec.refine.top_k])
    return sorted((first[key] for key in chosen), key=lambda t: t.number)


def refine(
    spec: StudySpec,
    study: optuna.Study,
    executor: Executor,
    stop: Callable[[], bool] = lambda: False,
    on_refined: OnRefined | None = None,
) -> int:
    """Refine the candidates that lack a record of this fidelity; returns how many were refined (or failed).

    Called between runs of the ask/tell loop, so the executor has nothing else in flight and tags are trial
    numbers. A stop abandons what is in flight: those points are refined by the next run."""
    if spec.refine is None:
        return 0
    wanted, done = fidelity(spec), records(study)
    todo = [t for t in candidates(spec, study) if _missing(done.get(t.user_attrs[POINT_KEY]), wanted)]
    in_flight: dict[int, FrozenTrial] = {}
    finished = 0
    if todo:
        executor.expect(len(todo))
    while (todo or in_flight) and not stop():
        while todo and len(in_flight) < executor.capacity:
            trial = todo.pop(0)
            point = decode(spec, trial.params)
            if isinstance(point, str):  # the study file changed under a resume; nothing to refine
                continue
            in_flight[trial.number] = trial
            executor.submit(trial.number, point, refine=True)
        if not todo:
            executor.drain()
        outcome = executor.wait(timeout=STOP_POLL_S) if in_flight else None
        if outcome is None or stop():
            continue
        trial = in_flight.pop(outcome.tag)
        record = {**wanted, "trial": trial.number}
        if outcome.result is not None:
            record["metrics"] = _finite(outcome.result["metrics"])
            record["feasible"] = all(v <= 0 for v in outcome.result["violations"].values())
            if outcome.result.get(NODE):
                record[NODE] = outcome.result[NODE]
        else:
            record["reason"] = outcome.error or "refinement failed"
        key = trial.user_attrs[POINT_KEY]
        study.set_user_attr(REFINED + key, record)
        finished += 1
        if on_refined is not None:
            on_refined(key, record)
    return finished


def _missing(record: dict[str, Any] | None, wanted: dict[str, Any]) -> bool:
    return record is None or fidelity_of(record) != wanted


def fidelity_of(record: dict[str, Any]) -> dict[str, Any]:
    """The cost model and options a refinement record was made with (what `fidelity` gives for a study)."""
    return {"cost_model": record.get("cost_model"), "options": record.get("options")}


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics as JSON can hold them: a non-finite figure (a refiner's overflow) is left out, not stored as
    a value the journal's JSON cannot read back."""
    return {k: v for k, v in metrics.items() if isinstance(v, bool) or math.isfinite(v)}


def run(
    spec: StudySpec,
    study: optuna.Study,
    executor: Executor,
    trials: int,
    on_trial: OnTrial | None = None,
    stop: Callable[[], bool] = lambda: False,
    on_refined: OnRefined | None = None,
) -> str | None:
    """studies.run, with the study's refinements: after every `refine.every` evaluations and after the search
    (also when a resume finds the search done: refinements a stopped run left are made then). Returns why the
    search ended short of `trials` evaluations, or None (studies.run)."""
    targets = [trials]
    if spec.refine is not None and spec.refine.every is not None:
        every = spec.refine.every
        done = len(evaluations(study.get_trials(deepcopy=False)))
        targets = [*range((done // every + 1) * every, trials, every), trials]
    ending = None
    for target in targets:
        ending = studies.run(spec, study, executor, target, on_trial, stop)
        if stop():
            return ending
        refine(spec, study, executor, stop, on_refined)
        if ending:
            break
    return ending
