"""The default executor of a study without a cluster: evaluate in the driver, and start the pool only once the
remaining work, at the measured rate, takes longer in the driver than the pool's start plus its share there.

The pool here is a real executor made by the factory (an InlineExecutor, so the policy is tested without paying a
Ray start); the points take a real, measured time each."""

import time

import pytest
from conftest import ROOT

from dse.search import inline_first
from dse.search.decoding import decode
from dse.search.executor import InlineExecutor
from dse.search.inline_first import TIMED_OUTCOMES, InlineFirstExecutor
from dse.search.space import load_study


def sleeper(seconds: float):
    def evaluate(point):
        time.sleep(seconds)
        return {"metrics": {"step_time_s": 1.0}, "violations": {}, "timings": {}}

    return evaluate


@pytest.fixture
def point():
    spec = load_study(ROOT / "studies" / "small.yaml")
    return decode(
        spec, {"parallel.tp": 2, "parallel.pp": 1, "workload.micro_batch": 1, "system.accelerator.hbm_GiB": 80}
    )


def run(executor: InlineFirstExecutor, point, outcomes: int) -> list[int]:
    """Capacity after each outcome, as the study loop sees it."""
    seen = []
    for tag in range(outcomes):
        executor.submit(tag, point)
        assert executor.wait().tag == tag
        seen.append(executor.capacity)
    return seen


@pytest.mark.parametrize(("seconds", "trials", "starts"), [(0.02, 1000, True), (0.02, 20, False), (0.001, 500, False)])
def test_the_pool_starts_only_when_the_remaining_work_pays_for_it(monkeypatch, point, seconds, trials, starts):
    """A pool start of 2 s and 2 workers pays once more than 4 s of evaluation is left: 1000 points of 20 ms
    (20 s) pay after the timed ones; 20 of them (0.4 s) and 500 of 1 ms (0.5 s) do not. The points sleep, and a
    busy machine wakes a sleeper late: at a 0.5 s start, the bound was 1 s and three timed sleeps of 1 ms that
    came to over 2 ms each on average (a loaded 2-core machine, 2026-11-30) started the pool; the 4 s bound holds
    them to 8 ms."""
    monkeypatch.setattr(inline_first, "RAY_START_S", 2.0)
    pools: list[InlineExecutor] = []
    announced: list[float] = []

    def start_pool():
        pools.append(InlineExecutor(sleeper(seconds)))
        pools[-1].capacity = 7  # what a pool's queue would take: the loop reads it to keep the workers fed
        return pools[-1]

    executor = InlineFirstExecutor(sleeper(seconds), trials, 2, start_pool, announced.append)
    capacities = run(executor, point, TIMED_OUTCOMES + 3)
    if starts:
        assert len(pools) == 1 and capacities == [1] * TIMED_OUTCOMES + [7, 7, 7]
        left = announced[0]
        assert left == pytest.approx((trials - TIMED_OUTCOMES - 1) * seconds, rel=0.5)
        assert not pools[0]._queue, "every point after the start went to the pool and came back"
    else:
        assert not pools and not announced and capacities == [1] * (TIMED_OUTCOMES + 3)
    executor.close()


def test_a_draining_study_does_not_start_the_pool(monkeypatch, point):
    monkeypatch.setattr(inline_first, "RAY_START_S", 0.0)
    pools = []
    executor = InlineFirstExecutor(sleeper(0.01), 1000, 2, lambda: pools.append(1), lambda s: None)
    executor.drain()
    run(executor, point, TIMED_OUTCOMES + 2)
    assert not pools


def test_one_worker_never_starts_the_pool(monkeypatch, point):
    monkeypatch.setattr(inline_first, "RAY_START_S", 0.0)
    pools = []
    executor = InlineFirstExecutor(sleeper(0.01), 1000, 1, lambda: pools.append(1), lambda s: None)
    run(executor, point, TIMED_OUTCOMES + 2)
    assert not pools
