"""The study lifecycle in the driver: open or resume the Optuna study, then ask, decode, evaluate and tell.

The driver is the only writer of the Optuna journal, so the journal is the record of truth: every finished
trial carries its metrics, point key and reason as user attributes, which is all that Parquet and MLflow are
rebuilt from. The executor's `capacity` of evaluations stay in flight (each worker's and those queued behind
it); infeasible points are told PRUNED at once with their reason and points already evaluated reuse their
metrics, so no evaluation is spent twice.
"""

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.study._tell import _tell_with_warning
from optuna.trial import FrozenTrial, TrialState

from dse.errors import SpecError
from dse.search.executor import NODE, Executor, Result
from dse.search.journal import JournalMirror
from dse.search.space import SUMMARY_FIELDS, StudySpec, decode, grid, optuna_distributions, point_fields
from dse.search.storage import describe, open_storage
from dse.spec import DesignPoint

# Trial user attributes. Each is one write to the storage (a journal line, a row), so they are few and whole.
METRICS = "metrics"
"""Every metric of the evaluation: {name: value}."""
REASON = "reason"
"""Why a trial was pruned (infeasible) or failed (the evaluation's error)."""
POINT_KEY = "point_key"
FIELDS = "fields"
"""Derived values and SUMMARY_FIELDS of the decoded point: {dotted path: value}."""
TIMINGS = "timings"
DUPLICATE_OF = "duplicate_of"
"""The trial whose evaluation of the same point this trial reuses."""
RETRY_OF = "retry_of"
"""On a trial enqueued by a resume: the trial a stopped driver left running, told FAIL and not counted."""

SCREENED_WITH = "screened_with"
"""Study user attribute: the cost model and options that priced its trials. A resume with others is refused:
points evaluated before are reused by point key, which would mix two models' figures in one search."""

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
OnTrial = Callable[[FrozenTrial], None]
STOP_POLL_S = 0.2
"""How often a wait for evaluations looks at the stop request."""
DECODED_CACHE_SIZE = 4096
"""Parameter sets whose decoded points a run keeps (emptied when full): a discrete space repeats far fewer, and a
continuous one would otherwise keep a point per trial for the whole study."""


def open_study(spec: StudySpec, out_dir: Path) -> optuna.Study:
    """Create the study in its storage (spec.storage, else OUT_DIR's journal), or load it to resume; the
    sampler is seeded from the spec.

    The seed is offset by the trials already stored, so a resumed random or evolutionary sampler does not
    replay the points of the first run, while a fresh run with the same seed repeats itself exactly.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    storage = open_storage(spec.storage, out_dir)
    study = optuna.create_study(storage=storage, study_name=spec.name, directions=spec.directions, load_if_exists=True)
    stored = [d.name.lower() for d in study.directions]
    if stored != spec.directions:
        raise SpecError(
            f"{spec.source}: field 'objectives': {describe(spec.storage, out_dir)} holds study '{spec.name}' with "
            f"directions {stored}, not {spec.directions}; use another --out or restore the objectives"
        )
    screen = {"cost_model": spec.cost_model, "options": dict(spec.cost_model_options)}
    screened = study.user_attrs.get(SCREENED_WITH)
    if screened is None:
        study.set_user_attr(SCREENED_WITH, screen)
    elif screened != screen:
        field = "cost_model" if screened["cost_model"] != spec.cost_model else "cost_model_options"
        raise SpecError(
            f"{spec.source}: field '{field}': {describe(spec.storage, out_dir)} holds study '{spec.name}' "
            f"priced by cost model '{screened['cost_model']}' with options {screened['options']}, not "
            f"'{screen['cost_model']}' with {screen['options']}; its results would mix the two: use another --out "
            "or restore cost_model and cost_model_options"
        )
    study.sampler = _sampler(spec, spec.seed + len(study.trials))
    return study


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler, without its study.stop() once the grid is covered: stop() only works inside
    optimize(), which the ask/tell loop does not use; the trial budget ends the study (later trials revisit
    grid points, and the loop reuses their results instead of evaluating them again)."""

    def after_trial(self, study: Any, trial: FrozenTrial, state: TrialState, values: Any) -> None:
        pass


def _sampler(spec: StudySpec, seed: int) -> optuna.samplers.BaseSampler:
    if spec.sampler == "grid":
        return _GridSampler(grid(spec), seed=seed)
    if spec.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if spec.sampler == "random":
        return RandomSampler(seed=seed)
    return optuna.samplers.NSGAIISampler(seed=seed)


class RandomSampler(optuna.samplers.RandomSampler):
    """Optuna's random sampler, drawing a categorical parameter without the search-space transform it builds for
    every parameter of every trial (an eighth of the driver's instructions per trial on the quickstart). The draw
    is Optuna's own, n uniforms and their argmax, from the same generator: a seed gives the same trials."""

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: optuna.distributions.BaseDistribution,
    ) -> Any:
        if isinstance(param_distribution, optuna.distributions.CategoricalDistribution):
            choices = param_distribution.choices
            return choices[int(self._rng.rng.uniform(0.0, 1.0, len(choices)).argmax())]
        return super().sample_independent(study, trial, param_name, param_distribution)


def counted(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Finished trials that count toward the study's budget: all but those a resume retried."""
    retried = {t.user_attrs[RETRY_OF] for t in trials if RETRY_OF in t.user_attrs}
    return [t for t in trials if t.state in FINISHED and t.number not in retried]


def requeue_running(study: optuna.Study) -> None:
    """Fail the trials a stopped driver left RUNNING and enqueue their params again.

    The driver is the only one telling, so a RUNNING trial at start (or after an interrupt) is one nobody will
    finish. Its retry is marked so that it, not the failed trial, counts toward the budget.
    """
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for trial in running:
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})


@dataclass
class _Job:
    trial: optuna.Trial
    point: DesignPoint
    followers: list[optuna.Trial] = field(default_factory=list)
    """Trials that decoded to the same point before it was evaluated; they share its outcome."""


class _Loop:
    """One run of the ask/tell loop; `run` is its only entry point.

    It asks ahead: the executor holds queued points (asked, decoded and checked while the workers were busy)
    that a worker takes as soon as it frees up, and the loop keeps one more ready, so Optuna's ask and tell
    stay off the workers' critical path.
    """

    def __init__(self, spec: StudySpec, study: optuna.Study, executor: Executor, on_trial: OnTrial) -> None:
        self.spec = spec
        self.study = study
        self.executor = executor
        self.on_trial = on_trial
        self.distributions = optuna_distributions(spec)
        self.known: dict[str, tuple[int, Result]] = _evaluated(study.get_trials(deepcopy=False), spec)
        self.ready: list[_Job] = []
        """Asked points that need an evaluation and wait for a free worker."""
        self.in_flight: dict[int, _Job] = {}
        self.leaders: dict[str, _Job] = {}
        """Ready or in-flight jobs by point key, so a duplicate point follows the first instead of running."""
        self.decoded: dict[tuple, tuple[DesignPoint, dict[str, Any]] | str] = {}
        """Per parameter set asked, its point and point fields, or why it is infeasible. Samplers ask the same
        parameters again and again in a discrete space (planning-70b: four trials in five), and decoding is the
        driver's largest cost per trial after Optuna's own."""
        self.asks = 0

    def run(self, asks: int, stop: Callable[[], bool]) -> None:
        self.asks = asks
        self._fill(stop)
        while self.in_flight and not stop():
            outcome = self.executor.wait(timeout=STOP_POLL_S)
            if outcome is None or stop():
                continue
            job = self.in_flight.pop(outcome.tag)
            self._fill(stop)  # a point asked now that equals this one still joins its followers
            del self.leaders[job.point.key]
            if outcome.result is None:
                for trial in [job.trial, *job.followers]:
                    self._fail(trial, outcome.error or "evaluation failed")
            else:
                self.known[job.point.key] = (job.trial.number, outcome.result)
                self._complete(job.trial, outcome.result)
                for trial in job.followers:
                    self._reuse(trial, job.point.key)
            self._fill(stop)

    def _fill(self, stop: Callable[[], bool]) -> None:
        """Give every free worker a point, then keep one point ready for the next worker to free up; once all are
        asked and submitted, let the executor share out its queue for an even finish."""
        while not stop():
            if len(self.in_flight) < self.executor.capacity and self.ready:
                job = self.ready.pop(0)
                self.in_flight[job.trial.number] = job
                self.executor.submit(job.trial.number, job.point)
            elif self.asks > 0 and (len(self.in_flight) < self.executor.capacity or not self.ready):
                self.asks -= 1
                self._start(*self._ask())
            else:
                if not self.asks and not self.ready:
                    self.executor.drain()
                return

    def _ask(self) -> tuple[optuna.Trial, dict[str, Any]]:
        """Study.ask(self.distributions), and the params it suggested (Trial.params would be a deep copy).

        Optuna 5's ask is these lines, but for what costs the driver and changes nothing here: its per-ask
        conversion of deprecated distribution classes (a check that compares every choice of every categorical
        parameter; optuna_distributions makes the current classes), and in each suggestion a copy of the trial
        (see _suggest)."""
        study = self.study
        study._thread_local.cached_all_trials = None  # samplers' view of the trials is kept within one trial
        trial_id = study._pop_waiting_trial_id()
        storage = study._storage
        if trial_id is None:
            trial_id = storage.create_new_trial(study._study_id)
        trial = optuna.Trial(study, trial_id)
        together = storage.params_together(trial_id) if isinstance(storage, JournalMirror) else nullcontext()
        latest = trial._get_latest_trial()  # one copy for the whole ask: it shares the params dict being filled
        with together:
            params = {name: self._suggest(trial, latest, name, d) for name, d in self.distributions.items()}
        return trial, params

    def _suggest(self, trial: optuna.Trial, latest: FrozenTrial, name: str, distribution: BaseDistribution) -> Any:
        """Trial._suggest for a parameter the trial has not suggested yet (Optuna 5): a fixed value (an enqueued
        trial's), a single-valued distribution's value, the sampler's relative value or its independent one.
        The sampler reads `latest`, the trial as Trial._get_latest_trial gives it (its system attributes read
        from the storage when asked), made once per ask instead of once per parameter: a tenth of the driver's
        instructions per trial."""
        if trial._is_fixed_param(name, distribution):
            value = trial._fixed_params[name]
        elif distribution.single():
            value = optuna.distributions._get_single_value(distribution)
        elif trial._is_relative_param(name, distribution):
            value = trial.relative_params[name]
        else:
            study = optuna.pruners._filter_study(self.study, latest)
            value = study.sampler.sample_independent(study, latest, name, distribution)
        self.study._storage.set_trial_param(trial._trial_id, name, distribution.to_internal_repr(value), distribution)
        trial._cached_frozen_trial.distributions[name] = distribution
        trial._cached_frozen_trial.params[name] = value
        return value

    def _start(self, trial: optuna.Trial, params: dict[str, Any]) -> None:
        decoded = self.decoded.get(key := tuple(params.items()))
        if decoded is None:
            if len(self.decoded) >= DECODED_CACHE_SIZE:
                self.decoded.clear()
            decoded = self.decoded[key] = self._decode(params)
        if isinstance(decoded, str):
            trial.set_user_attr(REASON, decoded)
            self._tell(trial, state=TrialState.PRUNED)
            return
        point, fields = decoded
        _set_user_attrs(trial, {POINT_KEY: point.key, FIELDS: fields})
        if point.key in self.known:
            self._reuse(trial, point.key)
        elif point.key in self.leaders:
            self.leaders[point.key].followers.append(trial)
        else:
            self.leaders[point.key] = job = _Job(trial, point)
            self.ready.append(job)

    def _decode(self, params: dict[str, Any]) -> tuple[DesignPoint, dict[str, Any]] | str:
        try:
            point = decode(self.spec, params)
        except SpecError as exc:
            return str(exc)
        if isinstance(point, str):
            return point
        return point, point_fields(point, [*self.spec.derived, *SUMMARY_FIELDS])

    def _reuse(self, trial: optuna.Trial, key: str) -> None:
        number, result = self.known[key]
        self._complete(trial, {**result, TIMINGS: {}, NODE: None}, {DUPLICATE_OF: number})

    def _complete(self, trial: optuna.Trial, result: Result, attrs: dict[str, Any] | None = None) -> None:
        metrics = result["metrics"]
        attrs = {**(attrs or {}), METRICS: metrics}
        if result.get(TIMINGS):
            attrs[TIMINGS] = result[TIMINGS]
        if result.get(NODE):
            attrs[NODE] = result[NODE]
        _set_user_attrs(trial, attrs)
        for constraint in self.spec.constraint_list:
            trial.set_constraint(constraint.name, result["violations"][constraint.name])
        values = [metrics[metric] for metric in self.spec.metrics]
        bad = [m for m, v in zip(self.spec.metrics, values, strict=True) if not math.isfinite(v)]
        if bad:
            self._fail(trial, f"objective metric {bad[0]} is {metrics[bad[0]]}, not a finite number")
            return
        self._tell(trial, values=values)

    def _fail(self, trial: optuna.Trial, error: str) -> None:
        trial.set_user_attr(REASON, error)
        self._tell(trial, state=TrialState.FAIL)

    def _tell(self, trial: optuna.Trial, values: list[float] | None = None, state: TrialState | None = None) -> None:
        """Study.tell, without the deep copy of the told trial it returns (its metrics and point fields: a tenth
        of the driver's time per trial). on_trial only reads the trial, and a finished trial is not changed again.
        Study.tell is this function and that copy (Optuna 5)."""
        _tell_with_warning(self.study, trial, values, state)
        self.on_trial(self.study._storage.get_trial(trial._trial_id))


def _set_user_attrs(trial: optuna.Trial, attrs: dict[str, Any]) -> None:
    """Trial.set_user_attr for each attribute, in one storage call where the storage takes several at once."""
    storage = trial.storage
    if isinstance(storage, JournalMirror):
        storage.set_trial_user_attrs(trial._trial_id, attrs)
    else:
        for key, value in attrs.items():
            storage.set_trial_user_attr(trial._trial_id, key, value)
    trial._cached_frozen_trial.user_attrs.update(attrs)


def _evaluated(trials: list[FrozenTrial], spec: StudySpec) -> dict[str, tuple[int, Result]]:
    """Results already in the storage by point key, so a resumed study does not evaluate a point again.

    A trial whose metrics were stored counts even if it was then failed by a resume: the driver was killed
    between storing them and telling the trial, and its point need not run again. Its violations come from the
    metrics (a constraint's metric is its violation), since the kill can land before they were stored. Trials
    from journals written before metrics were one attribute have none to reuse; their points run again."""
    out: dict[str, tuple[int, Result]] = {}
    for trial in trials:
        attrs = trial.user_attrs
        stored = trial.state in (TrialState.COMPLETE, TrialState.FAIL) and METRICS in attrs
        if stored and attrs.get(POINT_KEY) not in out:
            metrics = attrs[METRICS]
            violations = trial.constraints or {c.name: metrics[c.metric] for c in spec.constraint_list}
            out[attrs[POINT_KEY]] = (trial.number, {"metrics": metrics, "violations": violations})
    return out


def run(
    spec: StudySpec,
    study: optuna.Study,
    executor: Executor,
    trials: int,
    on_trial: OnTrial | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Bring the study to `trials` counted trials; on_trial sees every trial told, as it is told.

    When `stop()` turns true (the CLI's Ctrl-C), no new trial is asked and in-flight evaluations are abandoned.
    Trials left running, by a crashed driver before this run or by a stop or an exception in it, are failed
    and re-enqueued, so the next run evaluates them again and the budget counts each point once.
    """
    requeue_running(study)
    asks = trials - len(counted(study.get_trials(deepcopy=False)))
    try:
        _Loop(spec, study, executor, on_trial or (lambda trial: None)).run(asks, stop)
    finally:
        requeue_running(study)
