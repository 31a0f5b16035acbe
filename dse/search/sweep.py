"""A sweep: every point of a grid priced in batches, without an Optuna trial per point (`sweep: true`).

Calculon's only mode, and what a hardware planner asks first of a space that can be enumerated: the whole front,
not a sample of it. The grid (`sweep_grid`) is cut into tasks of one structure on a run of systems; Ray actors
(`SweepActor`, the study's `workers`) price tasks as `sweep_pricer` does, each keeping its decoded systems and
structures, two tasks in flight each so that none waits for the driver; the driver writes what arrives to Parquet
parts (`sweep_parts`) every few seconds and at the end. A sweep stopped any way (Ctrl-C, a crash, a kill) keeps
every part written, each a whole Parquet file, and the same command resumes it with the tasks no part holds.
"""

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from dse.errors import DseError
from dse.search.executor import connect
from dse.search.space import StudySpec
from dse.search.sweep_grid import SweepGrid, Task
from dse.search.sweep_parts import PartStore
from dse.search.sweep_pricer import SweepPricer, failed_table
from dse.search.tuning import tune_process

FLUSH_S = 10.0
"""Seconds between parts written: what an outright kill can lose, and few enough files for a long sweep."""
IN_FLIGHT_PER_ACTOR = 2
"""Tasks sent to an actor at once: it starts the next the moment one ends, instead of waiting for the driver."""
RESTART_LIMIT_S = 120.0
"""How long an actor may take to come back after a crash before the sweep gives up on it."""


class Pool(Protocol):
    workers: int

    def results(self, tasks: list[Task], stop: Callable[[], bool]) -> Iterator[pa.Table]:
        """Each task's rows as they are priced, in any order; stops early once `stop()` turns true."""
        ...

    def close(self) -> None: ...


class InlinePool:
    """Prices in this process, task by task (`--inline`, and sweeps too small to pay for Ray's start)."""

    workers = 1

    def __init__(self, spec: StudySpec) -> None:
        self._pricer = SweepPricer(spec.model_dump(), spec.source)

    def results(self, tasks: list[Task], stop: Callable[[], bool]) -> Iterator[pa.Table]:
        for task in tasks:
            if stop():
                return
            yield self._pricer.price(task)

    def close(self) -> None:
        pass


class SweepActor:
    """A Ray actor holding a SweepPricer (its plugins, decoded systems and structures) for its lifetime."""

    def __init__(self, spec_data: dict[str, Any], source: str) -> None:
        import ray

        tune_process()
        self._pricer = SweepPricer(spec_data, source, ray.get_runtime_context().get_node_id())

    def price(self, task: Task) -> pa.Table:
        return self._pricer.price(task)

    def ping(self) -> None:
        """Answers once the actor is up (again)."""


@dataclass
class _Call:
    task: Task
    actor: int


class RayPool:
    """`workers` SweepActors on the Ray cluster at `address` (a local Ray without one), IN_FLIGHT_PER_ACTOR tasks
    each. An actor that dies is restarted by Ray; its tasks run again on any actor once it answers, and a task that
    was in flight in two crashes fails as rows (state FAIL) instead of taking the sweep down."""

    def __init__(self, spec: StudySpec, grid: SweepGrid, workers: int | None, address: str | None) -> None:
        import ray

        self._ray = ray
        self._grid = grid
        self._started = connect(address)
        cpus = ray.cluster_resources().get("CPU", 1.0)
        self.workers = workers or max(1, int(cpus))
        actor = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=min(1.0, cpus / self.workers))(SweepActor)
        data = spec.model_dump()
        self._actors = [actor.remote(data, spec.source) for _ in range(self.workers)]

    def results(self, tasks: list[Task], stop: Callable[[], bool]) -> Iterator[pa.Table]:
        from ray.exceptions import RayActorError, RayTaskError

        queue = deque(tasks)
        crashes: dict[int, int] = {}
        calls: dict[Any, _Call] = {}
        pings: dict[Any, tuple[int, float]] = {}
        load = [0] * len(self._actors)
        down: set[int] = set()

        def send() -> None:
            for actor in range(len(self._actors)):
                while queue and actor not in down and load[actor] < IN_FLIGHT_PER_ACTOR:
                    task = queue.popleft()
                    calls[self._actors[actor].price.remote(task)] = _Call(task, actor)
                    load[actor] += 1

        send()
        while (calls or pings) and not stop():
            ready, _ = self._ray.wait([*calls, *pings], num_returns=1, timeout=0.2)
            if not ready:
                continue
            ref = ready[0]
            if ref in pings:
                actor, since = pings.pop(ref)
                try:
                    self._ray.get(ref)
                    down.discard(actor)
                except RayActorError as exc:
                    if time.monotonic() - since > RESTART_LIMIT_S:
                        raise DseError(f"a sweep worker did not come back after a crash ({exc})") from None
                    pings[self._actors[actor].ping.remote()] = (actor, since)
                send()
                continue
            call = calls.pop(ref)
            load[call.actor] -= 1
            try:
                table = self._ray.get(ref)
            except RayTaskError as exc:  # a bug in pricing the task as a whole: its rows say so
                yield failed_table(self._grid, call.task, _first_line(exc.cause or exc))
            except RayActorError as exc:
                crashes[call.task.id] = crashes.get(call.task.id, 0) + 1
                if crashes[call.task.id] >= 2:
                    yield failed_table(self._grid, call.task, f"the sweep worker died twice on this task ({exc})")
                else:
                    queue.appendleft(call.task)
                if call.actor not in down:
                    down.add(call.actor)
                    pings[self._actors[call.actor].ping.remote()] = (call.actor, time.monotonic())
            else:
                yield table
            send()

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)
        self._actors.clear()
        if self._started:
            self._ray.shutdown()


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


@dataclass
class SweepRun:
    """What a run of a sweep did: points on disk before it and priced by it, and whether it finished the grid."""

    before: int
    priced: int
    complete: bool
    seconds: float


def run(
    spec: StudySpec,
    store: PartStore,
    pool: Pool,
    on_rows: Callable[[int], None] = lambda rows: None,
    stop: Callable[[], bool] = lambda: False,
) -> SweepRun:
    """Price the tasks of the grid that no part on disk holds, writing parts as results arrive (every FLUSH_S
    and at the end, also when stopped or failing); on_rows hears how many rows each task brought."""
    grid = SweepGrid(spec)
    pending = pending_tasks(grid, store)
    before = store.rows()
    start = time.monotonic()
    buffer: list[pa.Table] = []
    priced = 0
    flushed = time.monotonic()
    try:
        for table in pool.results(pending, stop):
            buffer.append(table)
            priced += table.num_rows
            on_rows(table.num_rows)
            if time.monotonic() - flushed > FLUSH_S:
                store.write(buffer)
                buffer, flushed = [], time.monotonic()
    finally:
        store.write(buffer)
    complete = len(store.numbers()) == grid.size
    return SweepRun(before, priced, complete, time.monotonic() - start)


def pending_tasks(grid: SweepGrid, store: PartStore) -> list[Task]:
    """The tasks with a point that no part on disk holds."""
    tasks = grid.tasks()
    done = store.numbers()
    if not done.size:
        return tasks
    held = np.zeros(grid.size, dtype=bool)
    held[done] = True
    return [task for task in tasks if not held[grid.task_numbers(task)].all()]
