"""Evaluating in the driver first, and starting a Ray pool only when the study's remaining work pays for it.

A local Ray takes 10-18 s to start on an idle 2-core machine and ~35 s under load (platform notes; the issue's
first `make demo`), while the quickstart's 60 trials take about 1 s of evaluation in the driver, and planning-70b's
200 about 4 s. Paying the start before the first trial made the first minutes slow for nothing. So a study that
names no cluster starts here, times its evaluations, and moves to `workers` Ray actors once the remaining trials at
the measured rate would take longer in the driver than the start plus their share on the actors. Studies whose
points cost seconds (ASTRA-sim) move after a few points; the quickstart never does.
"""

import os
import time
from collections.abc import Callable

from dse.search.executor import EvaluateFn, Executor, InlineExecutor, Outcome
from dse.spec import DesignPoint

RAY_START_S = 25.0
"""What a local Ray pool costs before its first evaluation: the start (10-18 s idle, ~35 s under load, measured on
this 2-core machine) and the actors' first calls (imports, cold caches)."""
TIMED_OUTCOMES = 3
"""Evaluations timed before deciding; the first is not among them (it imports the plugins and fills caches)."""


class InlineFirstExecutor:
    """An InlineExecutor that hands over to the pool `start_pool()` makes once it pays (see the module docstring).

    `trials` is the evaluations still to come (the study's budget counts evaluations; a search that exhausts its
    space makes fewer, so it errs toward starting the pool); `workers` is the pool's size, None for one per CPU of
    this machine; `on_start` hears the projected seconds of evaluation left, so the caller can say why it waits."""

    def __init__(
        self,
        fn: EvaluateFn,
        trials: int,
        workers: int | None,
        start_pool: Callable[[], Executor],
        on_start: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self._inline = InlineExecutor(fn)
        self._trials = trials
        self._pool_workers = workers or os.cpu_count() or 1
        self._start_pool = start_pool
        self._on_start = on_start
        self._pool: Executor | None = None
        self._outcomes = 0
        self._timed_s: list[float] = []
        self._draining = False

    @property
    def _current(self) -> Executor:
        return self._pool or self._inline

    @property
    def workers(self) -> int:
        return self._current.workers

    @property
    def capacity(self) -> int:
        return self._current.capacity

    def submit(self, tag: int, point: DesignPoint, refine: bool = False) -> None:
        self._current.submit(tag, point, refine)

    def wait(self, timeout: float | None = None) -> Outcome | None:
        if self._pool is not None:
            return self._pool.wait(timeout)
        start = time.perf_counter()
        outcome = self._inline.wait(timeout)
        self._outcomes += 1
        if self._outcomes > 1:
            self._timed_s.append(time.perf_counter() - start)
        self._consider_pool()
        return outcome

    def _consider_pool(self) -> None:
        """Start the pool once the remaining evaluations, at the mean measured time, take longer here than the
        pool's start plus their share on its workers."""
        if self._draining or self._pool_workers < 2 or len(self._timed_s) < TIMED_OUTCOMES:
            return
        left_s = (self._trials - self._outcomes) * sum(self._timed_s) / len(self._timed_s)
        if left_s > RAY_START_S + left_s / self._pool_workers:
            self._on_start(left_s)
            self._pool = self._start_pool()

    def drain(self) -> None:
        """No more points come: the inline part never starts the pool from here on."""
        self._draining = True
        self._current.drain()

    def expect(self, count: int) -> None:
        """The coming points are timed afresh, and the pool started once they pay for it (a refiner that takes
        seconds a point moves to the pool after a few, as a slow study does)."""
        if self._pool is not None:
            self._pool.expect(count)
            return
        self._draining = False
        self._trials = max(self._trials, self._outcomes) + count  # with `refine.every`, the search goes on after
        self._timed_s = []

    def close(self) -> None:
        self._inline.close()
        if self._pool is not None:
            self._pool.close()
