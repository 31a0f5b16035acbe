"""The batch path's compiled loops (`batch_kernels`) against plain references, on what the grids of
`test_analytical_batch` rarely reach: rows far from sorted, and intervals in any order."""

import numpy as np

from simulators.analytical import batch_kernels


def test_sort_orders_any_row():
    rng = np.random.default_rng(0)
    rows = [rng.random(500), np.arange(300.0)[::-1].copy(), rng.integers(0, 4, 200).astype(float), np.zeros(0)]
    for row in rows:
        expected = np.sort(row)
        batch_kernels._sort(row)  # a random or reversed row runs out of insertion budget: the heapsort
        assert np.array_equal(row, expected)


def _union(intervals: list[tuple[float, float]], moment: float) -> tuple[float, float]:
    """The seconds the intervals cover, and those before the moment, merging them in order of start."""
    total = before = 0.0
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    for start, end in merged:
        total += end - start
        before += max(0.0, min(end, moment) - start)
    return total, before


def test_measure_is_the_union_of_intervals():
    rng = np.random.default_rng(1)
    count, systems = 40, 37  # two blocks of systems, the second short
    starts = rng.random((count, systems)) * 10
    ends = starts + rng.random((count, systems))
    values = np.vstack((starts, ends))
    durations = np.zeros((1, systems))  # the zero row alone: no start has a duration taken off
    moments = np.full((1, systems), 5.0)
    rows = np.arange(count, dtype=np.intp)
    total, before = batch_kernels.measure(
        values, durations, rows, np.zeros(count, dtype=np.intp), rows + count, False, moments, 32
    )
    for system in range(systems):
        expected = _union(list(zip(starts[:, system], ends[:, system], strict=True)), 5.0)
        assert np.allclose((total[system], before[0, system]), expected, rtol=1e-12, atol=1e-12)
