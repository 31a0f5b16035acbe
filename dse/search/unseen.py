"""A parameter set the study has not tried: where the loop steers a sampler that keeps proposing tried ones.

Model-based samplers settle on the points they like: on the quickstart's 1,296 points, TPE (seed 0) at a budget of
324 evaluations proposed up to 200 evaluated points in a row, and left to find new points itself (up to 100 asks per
evaluation) it took 3,146 trials and 250 s of asks for 248 evaluations. The budget counts evaluations, so after
STALL_ASKS fruitless asks in a row the loop enqueues a parameter set drawn at random among those not tried, which
the sampler then learns from as from its own: the same study takes 922 trials and 19 s for its 324 evaluations
(with 10 asks before a draw: 2,227 trials, 187 s, as each ask of TPE costs more as its trials grow). In a space
small enough to list (ENUMERABLE) the draw is among the untried sets exactly, so the study ends only when every
set was tried; in a larger one it is a random draw retried up to DRAW_ATTEMPTS times, and a space where that finds
nothing untried is taken as exhausted.
"""

import itertools
import math
import random
from collections.abc import Container, Iterator
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

STALL_ASKS = 3
"""Fruitless asks in a row (a trial that repeats an evaluated point, or a tried parameter set) before the loop
steers the sampler to an untried parameter set."""
ENUMERABLE = 100_000
"""Largest space whose untried parameter sets are listed for a draw (a tenth of a second in Python)."""
DRAW_ATTEMPTS = 1_000


class Unseen:
    """Draws untried parameter sets of a search space; parameter sets are tuples of (name, value) in the order of
    the distributions (the loop's `_params_key`)."""

    def __init__(self, distributions: dict[str, BaseDistribution], size: int | None, seed: int) -> None:
        self._distributions = distributions
        self._size = size
        self._rng = random.Random(seed)

    def draw(self, seen: Container[tuple]) -> dict[str, Any] | None:
        """A parameter set not in `seen`, or None when none is left (or, in a space too large to list, none was
        found in DRAW_ATTEMPTS draws)."""
        if self._size is not None and self._size <= ENUMERABLE:
            untried = [key for key in self._every_set() if key not in seen]
            return dict(self._rng.choice(untried)) if untried else None
        for _ in range(DRAW_ATTEMPTS):
            key = tuple((name, self._value(d)) for name, d in self._distributions.items())
            if key not in seen:
                return dict(key)
        return None

    def _every_set(self) -> Iterator[tuple]:
        names = list(self._distributions)
        for values in itertools.product(*(values_of(self._distributions[name]) for name in names)):
            yield tuple(zip(names, values, strict=True))

    def _value(self, distribution: BaseDistribution) -> Any:
        if isinstance(distribution, CategoricalDistribution):
            return self._rng.choice(distribution.choices)
        if isinstance(distribution, IntDistribution):
            return distribution.low + distribution.step * self._rng.randint(
                0, (distribution.high - distribution.low) // distribution.step
            )
        assert isinstance(distribution, FloatDistribution)
        low, high = distribution.low, distribution.high
        if distribution.log:
            return math.exp(self._rng.uniform(math.log(low), math.log(high)))
        if distribution.step is not None:
            return low + distribution.step * self._rng.randint(0, round((high - low) / distribution.step))
        return self._rng.uniform(low, high)


def values_of(distribution: BaseDistribution) -> list[Any]:
    """Every value of a categorical or integer distribution (load_study refuses the samplers that list them, grid
    and local, on a float range)."""
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    assert isinstance(distribution, IntDistribution)
    return list(range(distribution.low, distribution.high + 1, distribution.step))
