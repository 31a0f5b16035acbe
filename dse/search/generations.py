"""Generations of an evolutionary sampler (NSGA-II, NSGA-III) under a driver that asks ahead.

Optuna's genetic samplers give each trial a generation when it is asked: the latest generation with completed
trials, or the next once that one has `population_size` completed trials; generation 0 is drawn at random and
generation g bred from the completed trials of generation g-1. The driver asks ahead of the workers (the
executor's capacity: up to 66 points with two workers), so without a gate every trial asked before the first
population completes is generation 0: the issue measured NSGA-II's first 69-87 trials identical, row for row, to
the random sampler with the same seed. The gate lets the driver ask a trial only while the generation it would
join has fewer than `population_size` trials completed or running, so each generation is bred as soon as the
previous one has completed, and the workers wait for that only at a generation's last points.
"""

from collections import Counter

import optuna
from optuna.samplers._ga._base import BaseGASampler
from optuna.trial import TrialState


class GenerationGate:
    """Counts a genetic sampler's trials per generation, completed and running, as the loop asks and tells them."""

    def __init__(self, study: optuna.Study, sampler: BaseGASampler) -> None:
        assert sampler.population_size is not None
        self.size = sampler.population_size
        self._key = sampler._get_generation_key()
        self._storage = study._storage
        self._complete: Counter[int] = Counter()
        for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if (generation := trial.system_attrs.get(self._key)) is not None:
                self._complete[generation] += 1
        self._running: Counter[int] = Counter()
        self._generation_of: dict[int, int] = {}
        """The generation of each trial asked and not told yet (one the sampler gave a generation)."""

    @property
    def current(self) -> int:
        """The generation a trial asked now joins (Optuna's BaseGASampler.get_trial_generation)."""
        latest = max(self._complete, default=0)
        return latest if self._complete[latest] < self.size else latest + 1

    def open(self) -> bool:
        """Whether a trial asked now would still be one of its generation's `population_size`."""
        generation = self.current
        return self._complete[generation] + self._running[generation] < self.size

    def asked(self, trial: optuna.Trial) -> None:
        generation = self._storage.get_trial_system_attrs(trial._trial_id).get(self._key)
        if generation is not None:  # a trial whose params were all fixed (a retry) has none, and does not count
            self._generation_of[trial.number] = generation
            self._running[generation] += 1

    def told(self, number: int, state: TrialState) -> None:
        generation = self._generation_of.pop(number, None)
        if generation is not None:
            self._running[generation] -= 1
            if state == TrialState.COMPLETE:
                self._complete[generation] += 1
