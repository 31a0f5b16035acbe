"""A parameter set the study has not tried: where the loop steers a sampler that keeps proposing tried ones.

Model-based samplers settle on the points they like: on the quickstart's 1,296 points, TPE (seed 0) at a budget of
324 evaluations proposed up to 200 evaluated points in a row, and left to find new points itself (up to 100 asks per
evaluation) it took 3,146 trials and 250 s of asks for 248 evaluations. The budget counts evaluations, so after
STALL_ASKS fruitless asks in a row the loop enqueues a parameter set drawn at random among those not tried, which
the sampler then learns from as from its own: the same study takes 922 trials and 19 s for its 324 evaluations
(with 10 asks before a draw: 2,227 trials, 187 s, as each ask of TPE costs more as its trials grow). In a space
small enough to list (ENUMERABLE) the draw is among the untried sets exactly (QUICK_DRAWS random draws first, which
are as uniform among them and skip the listing while most sets are untried), so the study ends only when every set
was tried; in a larger one it is a random draw retried up to DRAW_ATTEMPTS times, and a space where that finds nothing
untried is taken as exhausted.
"""

import itertools
import math
import random
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

STALL_ASKS = 3
"""Fruitless asks in a row (a trial that repeats an evaluated point, or a tried parameter set) before the loop
steers the sampler to an untried parameter set."""
BARREN_ASKS = 10_000
"""Asks in a row that start no new evaluation (each pruned, a repeat of an evaluated point, or resolved from one)
after which the search ends: a pruned ask costs no budget, so a space with (almost) no untried point that can run
would be asked without end (an int range of 10^6 values with four that run wrote 29 MB of journal in 90 s). With
the random sampler that is 10,000 draws, so a space where one point in 1,000 can run is stopped early with a chance
of e^-10 per evaluation; a sampler that repeats evaluated points (TPE) is steered to an untried set after every
STALL_ASKS repeats, so at least a quarter of its barren asks are untried draws, and the same chance holds where one
point in 250 can run. An ask costs about 1 KB of journal and 2 ms of the driver: 10 MB and 20 s at most per run of
barren asks (measured on the issue's space)."""
BARREN_ASK_S = 30.0
"""Driver seconds spent on one run of barren asks after which the search ends too: a sampler whose asks grow slow
with the trials (TPE at thousands of trials) would otherwise spin for minutes before BARREN_ASKS."""
ENUMERABLE = 100_000
"""Largest space whose untried parameter sets are listed for a draw (a tenth of a second in Python)."""
DRAW_ATTEMPTS = 1_000
QUICK_DRAWS = 32
"""Random draws tried before an enumerable space's untried sets are listed (a tenth of a second at ENUMERABLE sets)."""


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
        enumerable = self._size is not None and self._size <= ENUMERABLE
        for _ in range(QUICK_DRAWS if enumerable else DRAW_ATTEMPTS):
            key = tuple((name, self._value(d)) for name, d in self._distributions.items())
            if key not in seen:
                return dict(key)
        if enumerable:
            untried = [key for key in self._every_set() if key not in seen]
            return dict(self._rng.choice(untried)) if untried else None
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


@dataclass
class Barren:
    """The current run of asks that started no new evaluation: how many, how many of them could not run (with the
    last reason), and the driver's time they took; `ending` says when the search should stop for it."""

    asks: int = 0
    pruned: int = 0
    seconds: float = 0.0
    reason: str | None = None

    def add(self, reason: str | None) -> None:
        """One more barren ask: pruned with `reason`, or (None) a repeat of or resolved from an evaluated point."""
        self.asks += 1
        if reason is not None:
            self.pruned += 1
            self.reason = reason

    def took(self, seconds: float) -> None:
        """The driver's time of the last ask, counted if it was barren."""
        if self.asks:
            self.seconds += seconds

    def ending(self) -> str | None:
        """Why the search stops here (BARREN_ASKS or BARREN_ASK_S reached), or None."""
        if self.asks < BARREN_ASKS and not (self.asks and self.seconds >= BARREN_ASK_S):
            return None
        last = f" (the last: {self.reason})" if self.reason else ""
        return (
            f"no new point to evaluate in the last {self.asks:,} ask{'s' if self.asks != 1 else ''} "
            f"({self.seconds:.1f} s of asking): {self.pruned:,} could not run{last}, {self.asks - self.pruned:,} were "
            "answered from evaluated points; few points of the space that can run are left untried: narrow its ranges "
            "and choices to values that can run (`dse check` shows why points cannot)"
        )
