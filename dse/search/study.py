"""The study lifecycle in the driver: open or resume the Optuna study, then ask, decode, evaluate and tell.

The driver is the only writer of the Optuna journal, so the journal is the record of truth: every finished
trial carries its metrics, point key and reason as user attributes, which is all that Parquet and MLflow are
rebuilt from. The executor's `capacity` of evaluations stay in flight (each worker's and those queued behind
it); infeasible points are told PRUNED at once with their reason and points already evaluated reuse their
metrics, so no evaluation is spent twice.

The budget (`trials`) counts evaluations, not trials: samplers propose evaluated points again (the issue measured
TPE spending 33-58% of its trials on them), and a trial that reuses an evaluation or is pruned before one costs
next to nothing, so the loop keeps asking until the budget's evaluations are spent or the space is exhausted. A
sampler that keeps proposing tried points is steered to untried ones (`dse.search.unseen`), so a finite space ends
only when every parameter set was tried, or, as a space with (almost) no untried point that can run would be asked
without end, after BARREN_ASKS asks in a row (or BARREN_ASK_S seconds of them) that started no evaluation.
"""

import math
import time
import warnings
from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers._ga._base import BaseGASampler
from optuna.study._tell import _tell_with_warning
from optuna.trial import FrozenTrial, TrialState

from dse.errors import SpecError
from dse.search import capacity
from dse.search.decoding import decode, point_fields
from dse.search.executor import NODE, Executor, Result
from dse.search.generations import GenerationGate
from dse.search.journal import JournalMirror
from dse.search.local_search import ParetoLocalSampler
from dse.search.space import SUMMARY_FIELDS, StudySpec, feasibility_only, grid, optuna_distributions, space_size
from dse.search.storage import describe, open_storage
from dse.search.unseen import STALL_ASKS, Barren, Unseen
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
"""The trial whose evaluation of the same point this trial reuses: not an evaluation, it does not use the budget."""
RESOLVED_FROM = "resolved_from"
"""The trial whose evaluation, at another value of the study's feasibility-only dimensions, this trial's result
is derived from (`dse.search.capacity`): not an evaluation either."""
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
        # Points asked ahead and not told yet count as bad ones (the constant liar), so that a batch of asks
        # spreads out instead of proposing one point again and again; Optuna 5's default, kept whatever it becomes.
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    if spec.sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if spec.sampler == "random":
        return RandomSampler(seed=seed)
    if spec.sampler == "local":
        return ParetoLocalSampler(optuna_distributions(spec), seed=seed)
    population = {} if spec.population_size is None else {"population_size": spec.population_size}
    if spec.sampler == "nsga3":
        with warnings.catch_warnings():  # Optuna marks it experimental; the study file chose it
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.NSGAIIISampler(seed=seed, **population)
    return optuna.samplers.NSGAIISampler(seed=seed, **population)


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


def is_evaluation(trial: FrozenTrial) -> bool:
    """Whether a finished trial spent an evaluation: it has a point that was evaluated for it, not reused from
    another trial's evaluation (a pruned trial has no point). A trial a stopped driver left running also passes;
    `evaluations` leaves those out."""
    attrs = trial.user_attrs
    return (
        trial.state in (TrialState.COMPLETE, TrialState.FAIL)
        and POINT_KEY in attrs
        and DUPLICATE_OF not in attrs
        and RESOLVED_FROM not in attrs
    )


def evaluations(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that spent an evaluation: what the study's budget counts. A trial a stopped driver left running
    (failed and retried by a resume) counts only if its evaluation was stored before the stop: its retry then
    reuses it, else the retry evaluates it."""
    retried = {t.user_attrs[RETRY_OF] for t in trials if RETRY_OF in t.user_attrs}
    return [t for t in trials if is_evaluation(t) and (t.number not in retried or METRICS in t.user_attrs)]


def requeue_running(study: optuna.Study, names: Collection[str]) -> None:
    """Fail the trials a stopped driver left RUNNING and enqueue their params again.

    The driver is the only one telling, so a RUNNING trial at start (or after an interrupt) is one nobody will
    finish. Its retry is marked so that it, not the failed trial, counts toward the budget. A trial that holds
    only some of the space's parameters `names` (a journal cut while its parameters were being written) is only
    failed: enqueued, its missing parameters would be drawn anew and some samplers (grid) refuse that.
    """
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for trial in running:
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        if set(names) <= set(trial.params):
            study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})


@dataclass
class _Job:
    trial: optuna.Trial
    point: DesignPoint
    evaluated: DesignPoint
    """The point evaluated for it: its own, or with feasibility-only dimensions at their largest values."""
    followers: list[tuple[optuna.Trial, DesignPoint]] = field(default_factory=list)
    """Trials (and their points) that need the same evaluation, asked before it was done; they share its outcome."""


@dataclass(frozen=True)
class _Known:
    """An evaluation done: the trial it was made for, that trial's point key, and its result or error."""

    number: int
    key: str
    result: Result | None = None
    error: str | None = None


class _Loop:
    """One run of the ask/tell loop; `run` is its only entry point.

    It asks ahead: the executor holds queued points (asked, decoded and checked while the workers were busy)
    that a worker takes as soon as it frees up, and the loop keeps one more ready, so Optuna's ask and tell
    stay off the workers' critical path. An evolutionary sampler's asks wait at a generation's end (`GenerationGate`).
    """

    def __init__(self, spec: StudySpec, study: optuna.Study, executor: Executor, on_trial: OnTrial) -> None:
        self.spec = spec
        self.study = study
        self.executor = executor
        self.on_trial = on_trial
        self.distributions = optuna_distributions(spec)
        self.derives = bool(feasibility_only(spec))
        self.decoded: dict[tuple, tuple[DesignPoint, dict[str, Any]] | str] = {}
        """Per parameter set asked, its point and point fields, or why it is infeasible. Samplers ask the same
        parameters again and again in a discrete space (planning-70b: four trials in five), and decoding is the
        driver's largest cost per trial after Optuna's own."""
        stored = study.get_trials(deepcopy=False)
        self.known: dict[str, _Known] = self._evaluated(stored)
        """Evaluations by the key of the point evaluated (`_Job.evaluated`)."""
        self.ready: list[_Job] = []
        """Asked points that need an evaluation and wait for a free worker."""
        self.in_flight: dict[int, _Job] = {}
        self.leaders: dict[str, _Job] = {}
        """Ready or in-flight jobs by the key of the point they evaluate, so a trial that needs the same evaluation
        follows the first instead of running."""
        retried = {t.user_attrs[RETRY_OF] for t in stored if RETRY_OF in t.user_attrs}
        self.seen = {self._params_key(t.params) for t in stored if t.state in FINISHED and t.number not in retried}
        """Parameter sets asked (but those of trials a resume asks again): with space_size, when the space is
        exhausted."""
        self.size = space_size(spec)
        self.fruitless = 0
        """Asks in a row that brought neither an evaluation nor a parameter set not seen before."""
        self.barren = Barren()
        """Asks in a row that brought no evaluation: the search ends when they grow too many (`Barren.ending`)."""
        self.unseen = Unseen(self.distributions, self.size, spec.seed + len(stored))
        self.gate = GenerationGate(study, study.sampler) if isinstance(study.sampler, BaseGASampler) else None
        self.left = 0
        """Evaluations this run may still start."""
        self.retries = 0
        """Trials a stopped driver left, enqueued again by requeue_running and not asked yet: asked whatever the
        budget says (their evaluations were counted in it when they started, or were stored and are reused)."""
        self.ending: str | None = None
        """Why the search ended before the budget was spent, once it has."""

    @property
    def capacity(self) -> int:
        """Evaluations in flight: the executor's capacity. The GP sampler ignores trials not told yet, so points
        asked ahead of the workers would repeat its last proposal: it asks only for a free worker."""
        return self.executor.workers if self.spec.sampler == "gp" else self.executor.capacity

    def run(self, budget: int, stop: Callable[[], bool]) -> str | None:
        trials = self.study.get_trials(deepcopy=False)
        self.left = budget - len(evaluations(trials))
        self.retries = sum(t.state == TrialState.WAITING for t in trials)
        self._check_exhausted()
        self._fill(stop)
        while self.in_flight and not stop():
            outcome = self.executor.wait(timeout=STOP_POLL_S)
            if outcome is None or stop():
                continue
            job = self.in_flight.pop(outcome.tag)
            self._fill(stop)  # a point asked now that needs this evaluation still joins its followers
            del self.leaders[job.evaluated.key]
            known = _Known(job.trial.number, job.point.key, outcome.result, outcome.error or "evaluation failed")
            self.known[job.evaluated.key] = known
            self._settle(job.trial, job.point, known, {})
            for trial, point in job.followers:
                self._reuse(trial, point, job.evaluated.key)
            self._fill(stop)
        return self.ending

    def _fill(self, stop: Callable[[], bool]) -> None:
        """Give every free worker a point, then keep one point ready for the next worker to free up; once all are
        asked and submitted, let the executor share out its queue for an even finish."""
        while not stop():
            if len(self.in_flight) < self.capacity and self.ready:
                job = self.ready.pop(0)
                self.in_flight[job.trial.number] = job
                self.executor.submit(job.trial.number, job.evaluated)
            elif self._may_ask() and (len(self.in_flight) < self.capacity or not self.ready):
                asked = time.monotonic()
                self._start(*self._ask())
                self.barren.took(time.monotonic() - asked)
            else:
                if (self.left <= 0 or self.ending) and not self.retries and not self.ready:
                    self.executor.drain()
                return

    def _may_ask(self) -> bool:
        """Whether to ask a trial now; after STALL_ASKS fruitless asks, the next one is an untried parameter set
        enqueued for the sampler (or, when none is left, the search ends, as it does after too many barren asks)."""
        if self.gate is not None and not self.gate.open():
            return False
        if self.retries:
            return True
        if self.left <= 0 or self.ending is not None:
            return False
        if (ending := self.barren.ending()) is not None:
            self.ending = ending
            return False
        if self.fruitless >= STALL_ASKS:
            params = self.unseen.draw(self.seen)
            if params is None:
                self.ending = "the space is exhausted: no parameter set is left that the study has not tried"
                return False
            self.study.enqueue_trial(params)
            self.fruitless = 0
        return True

    def _check_exhausted(self) -> None:
        if self.size is not None and len(self.seen) >= self.size and self.ending is None:
            self.ending = f"the space is exhausted: all {self.size:,} of its parameter sets were tried"

    def _params_key(self, params: dict[str, Any]) -> tuple:
        return tuple((name, params.get(name)) for name in self.distributions)

    def _ask(self) -> tuple[optuna.Trial, dict[str, Any]]:
        """Study.ask(self.distributions), and the params it suggested (Trial.params would be a deep copy).

        Optuna 5's ask is these lines, but for what costs the driver and changes nothing here: its per-ask
        conversion of deprecated distribution classes (a check that compares every choice of every categorical
        parameter; optuna_distributions makes the current classes), and in each suggestion a copy of the trial
        (see _suggest)."""
        study = self.study
        self.retries = max(0, self.retries - 1)  # Optuna asks the waiting trials first
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
        if self.gate is not None:
            self.gate.asked(trial)
        key = self._params_key(params)
        fresh = key not in self.seen
        self.seen.add(key)
        decoded = self._decoded(params)
        if isinstance(decoded, str):
            self.fruitless = 0 if fresh else self.fruitless + 1
            self.barren.add(decoded)
            trial.set_user_attr(REASON, decoded)
            self._tell(trial, state=TrialState.PRUNED)
        else:
            point, fields = decoded
            _set_user_attrs(trial, {POINT_KEY: point.key, FIELDS: fields})
            evaluated = self._evaluated_point(params, point)
            if evaluated.key in self.known:
                self.fruitless += 1
                self.barren.add(None)
                self._reuse(trial, point, evaluated.key)
            elif evaluated.key in self.leaders:
                self.fruitless += 1
                self.barren.add(None)
                self.leaders[evaluated.key].followers.append((trial, point))
            else:
                self.fruitless = 0
                self.barren = Barren()
                self.left -= 1
                self.leaders[evaluated.key] = job = _Job(trial, point, evaluated)
                self.ready.append(job)
        self._check_exhausted()

    def _decoded(self, params: dict[str, Any]) -> tuple[DesignPoint, dict[str, Any]] | str:
        decoded = self.decoded.get(key := tuple(params.items()))
        if decoded is None:
            if len(self.decoded) >= DECODED_CACHE_SIZE:
                self.decoded.clear()
            decoded = self.decoded[key] = self._decode(params)
        return decoded

    def _evaluated_point(self, params: dict[str, Any], point: DesignPoint) -> DesignPoint:
        """The point evaluated for a trial's: its own, or its configuration at the largest values of the
        feasibility-only dimensions (`capacity`)."""
        if not self.derives:
            return point
        canonical = self._decoded(capacity.canonical(self.spec, params))
        return point if isinstance(canonical, str) else canonical[0]

    def _decode(self, params: dict[str, Any]) -> tuple[DesignPoint, dict[str, Any]] | str:
        try:
            point = decode(self.spec, params)
        except SpecError as exc:
            return str(exc)
        if isinstance(point, str):
            return point
        return point, point_fields(point, [*self.spec.derived, *SUMMARY_FIELDS])

    def _reuse(self, trial: optuna.Trial, point: DesignPoint, key: str) -> None:
        known = self.known[key]
        self._settle(trial, point, known, {DUPLICATE_OF if known.key == point.key else RESOLVED_FROM: known.number})

    def _settle(self, trial: optuna.Trial, point: DesignPoint, known: _Known, attrs: dict[str, Any]) -> None:
        """Tell a trial the outcome of the evaluation it needed (its own, if `attrs` is empty)."""
        if known.result is None:
            self._fail(trial, known.error or "evaluation failed", attrs)
            return
        result = known.result if not attrs else {**known.result, TIMINGS: {}, NODE: None}
        self._complete(trial, capacity.at_capacity(self.spec, result, point) if self.derives else result, attrs)

    def _complete(self, trial: optuna.Trial, result: Result, attrs: dict[str, Any]) -> None:
        metrics = result["metrics"]
        attrs = {**attrs, METRICS: metrics}
        if result.get(TIMINGS):
            attrs[TIMINGS] = result[TIMINGS]
        if result.get(NODE):
            attrs[NODE] = result[NODE]
        _set_user_attrs(trial, attrs)
        absent = [m for m in self.spec.metrics if m not in metrics]
        absent += [c.name for c in self.spec.constraint_list if c.name not in result["violations"]]
        if absent:
            self._fail(trial, f"the point has no {absent[0]}: it does not apply to this point")
            return
        for constraint in self.spec.constraint_list:
            trial.set_constraint(constraint.name, result["violations"][constraint.name])
        values = [metrics[metric] for metric in self.spec.metrics]
        bad = [m for m, v in zip(self.spec.metrics, values, strict=True) if not math.isfinite(v)]
        if bad:
            self._fail(trial, f"objective metric {bad[0]} is {metrics[bad[0]]}, not a finite number")
            return
        self._tell(trial, values=values)

    def _fail(self, trial: optuna.Trial, error: str, attrs: dict[str, Any] | None = None) -> None:
        _set_user_attrs(trial, {**(attrs or {}), REASON: error})
        self._tell(trial, state=TrialState.FAIL)

    def _tell(self, trial: optuna.Trial, values: list[float] | None = None, state: TrialState | None = None) -> None:
        """Study.tell, without the deep copy of the told trial it returns (its metrics and point fields: a tenth
        of the driver's time per trial). on_trial only reads the trial, and a finished trial is not changed again.
        Study.tell is this function and that copy (Optuna 5)."""
        _tell_with_warning(self.study, trial, values, state)
        if self.gate is not None:
            self.gate.told(trial.number, state or TrialState.COMPLETE)
        self.on_trial(self.study._storage.get_trial(trial._trial_id))

    def _evaluated(self, trials: list[FrozenTrial]) -> dict[str, _Known]:
        """Results already in the storage by the key of the point evaluated, so that a resumed study does not
        evaluate a point again.

        A trial whose metrics were stored counts even if it was then failed by a resume: the driver was killed
        between storing them and telling the trial, and its point need not run again. Its violations come from the
        metrics (a constraint's metric is its violation), since the kill can land before they were stored. Trials
        from journals written before metrics were one attribute have none to reuse; their points run again."""
        out: dict[str, _Known] = {}
        for trial in trials:
            attrs = trial.user_attrs
            if not (trial.state in (TrialState.COMPLETE, TrialState.FAIL) and METRICS in attrs):
                continue
            key = attrs.get(POINT_KEY)
            if self.derives:
                decoded = self._decoded(capacity.canonical(self.spec, trial.params))
                key = key if isinstance(decoded, str) else decoded[0].key
            if key is not None and key not in out:
                metrics = attrs[METRICS]
                violations = trial.constraints or {c.name: metrics[c.metric] for c in self.spec.constraint_list}
                result = {"metrics": metrics, "violations": violations}
                out[key] = _Known(trial.number, attrs[POINT_KEY], result)
        return out


def _set_user_attrs(trial: optuna.Trial, attrs: dict[str, Any]) -> None:
    """Trial.set_user_attr for each attribute, in one storage call where the storage takes several at once."""
    storage = trial.storage
    if isinstance(storage, JournalMirror):
        storage.set_trial_user_attrs(trial._trial_id, attrs)
    else:
        for key, value in attrs.items():
            storage.set_trial_user_attr(trial._trial_id, key, value)
    trial._cached_frozen_trial.user_attrs.update(attrs)


def run(
    spec: StudySpec,
    study: optuna.Study,
    executor: Executor,
    trials: int,
    on_trial: OnTrial | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> str | None:
    """Bring the study to `trials` evaluations (`evaluations`); on_trial sees every trial told, as it is told.
    Returns why the search ended short of that (the space exhausted), or None.

    When `stop()` turns true (the CLI's Ctrl-C), no new trial is asked and in-flight evaluations are abandoned.
    Trials left running, by a crashed driver before this run or by a stop or an exception in it, are failed
    and re-enqueued, so the next run evaluates them again and the budget counts each point once.
    """
    requeue_running(study, spec.space)
    try:
        return _Loop(spec, study, executor, on_trial or (lambda trial: None)).run(trials, stop)
    finally:
        requeue_running(study, spec.space)
