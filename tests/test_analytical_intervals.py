"""Busy-time sums against an independent sweep over every interval boundary."""

import random
from itertools import pairwise

import pytest

from simulators.analytical.intervals import Busy, merge, split_busy


def _sweep(compute: list[tuple[float, float]], comm: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Between consecutive boundaries, whether any compute and any communication interval covers the stretch."""
    points = sorted({t for pair in compute + comm for t in pair})
    compute_s = comm_s = exposed_s = 0.0
    for a, b in pairwise(points):
        mid = (a + b) / 2
        busy_compute = any(s <= mid <= e for s, e in compute)
        busy_comm = any(s <= mid <= e for s, e in comm)
        compute_s += (b - a) * busy_compute
        comm_s += (b - a) * busy_comm
        exposed_s += (b - a) * (busy_comm and not busy_compute)
    return compute_s, comm_s, exposed_s


def _one_stream(rng: random.Random, n: int) -> list[tuple[float, float]]:
    """Back-to-back or gapped intervals of one in-order stream, shuffled as the fast path lays them out."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.choice([0.0, rng.uniform(0, 2)])
        length = rng.uniform(0, 3)
        out.append((t, t + length))
        t += length
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_split_busy_matches_a_sweep(seed):
    rng = random.Random(seed)
    compute = _one_stream(rng, rng.randint(0, 30))
    comm = [(s, s + rng.uniform(0, 4)) for s in (rng.uniform(0, 60) for _ in range(rng.randint(0, 30)))]
    got = split_busy([s for s, _ in compute], [e for _, e in compute], [s for s, _ in comm], [e for _, e in comm])
    assert got == pytest.approx(_sweep(compute, comm), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_a_windows_busy_seconds_match_a_sweep_of_the_intervals_clipped_to_it(seed):
    """Busy.between, read off the whole timeline's cumulative seconds, against the sweep over the window alone
    (the steady state's periods are such windows)."""
    rng = random.Random(seed)
    compute = _one_stream(rng, rng.randint(0, 30))
    comm = [(s, s + rng.uniform(0, 4)) for s in (rng.uniform(0, 60) for _ in range(rng.randint(0, 30)))]
    busy = Busy.of([s for s, _ in compute], [e for _, e in compute], [s for s, _ in comm], [e for _, e in comm])
    for _ in range(5):
        a = rng.uniform(-5, 70)
        b = a + rng.uniform(0, 30)
        inside = [_clipped(intervals, a, b) for intervals in (compute, comm)]
        assert busy.between(a, b) == pytest.approx(_sweep(*inside), rel=1e-9, abs=1e-9)


def _clipped(intervals: list[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    return [(max(s, a), min(e, b)) for s, e in intervals if min(e, b) > max(s, a)]


def test_communication_between_compute_is_exposed_exactly():
    """No overlap: every communication second is exposed, with no rounding left over."""
    compute = [(0.0, 0.010), (0.024, 0.025), (0.031, 0.0417)]
    comm = [(0.010, 0.024), (0.025, 0.031)]
    _, comm_s, exposed_s = split_busy(*zip(*compute, strict=True), *zip(*comm, strict=True))
    assert exposed_s == comm_s


def test_merge_joins_touching_and_overlapping_intervals():
    starts, ends = merge([5.0, 0.0, 1.0, 3.0, 9.0], [6.0, 1.0, 2.5, 5.0, 9.5])
    assert list(zip(starts, ends, strict=True)) == [(0.0, 2.5), (3.0, 6.0), (9.0, 9.5)]
