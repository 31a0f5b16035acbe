"""The batch path's compiled loops (`batch_kernels`) against plain references, on what the grids of
`test_analytical_batch` rarely reach: rows far from sorted, and intervals in any order; and the chunks of systems
they are run on (`batch._chunks`), which must not change a figure."""

from dataclasses import asdict

import numpy as np

from generators.symbolic import SymbolicGenerator
from simulators.analytical import batch, batch_kernels
from simulators.analytical.batch_busy import BLOCK
from tests.helpers import make_point


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
        values, durations, rows, np.zeros(count, dtype=np.intp), rows + count, False, moments, np.array([0, 32, 37])
    )
    for system in range(systems):
        expected = _union(list(zip(starts[:, system], ends[:, system], strict=True)), 5.0)
        assert np.allclose((total[system], before[0, system]), expected, rtol=1e-12, atol=1e-12)


def test_chunks_keep_every_system_in_its_measuring_block():
    """Chunks cover the systems in order, in the blocks of `BLOCK` systems from the start of each run of
    LAYOUT_BYTES' width (a run's last block shorter): a system's block, which sets a tie within rounding, is the one
    it had when a chunk was a whole run. A chunk holds as many blocks as the budget allows, at least one."""
    for systems, rows in [(1000, 78_265), (1000, 152_107), (1000, 405_000), (250, 20_000), (5, 10**7), (1, 10)]:
        run = max(1, batch.LAYOUT_BYTES // (8 * rows))
        width = batch.MEMORY_BUDGET_BYTES // (8 * rows)
        expected = [lo for start in range(0, systems, run) for lo in range(start, min(start + run, systems), BLOCK)]
        chunks = batch._chunks(systems, rows)
        assert [int(b) for c in chunks for b in c[:-1]] == expected
        assert [int(c[-1]) for c in chunks] == [int(c[0]) for c in chunks[1:]] + [systems]
        for chunk in chunks:
            assert len(chunk) == 2 or chunk[-1] - chunk[0] <= width


def test_figures_do_not_depend_on_the_memory_budget(monkeypatch):
    """Chunks of one block each give the figures, to the last bit, that one chunk of every system gives."""
    case = dict(tp=2, pp=4, dp=2, sp=True, zero=1, global_batch=64, system={"base": "dgx-h100"})
    systems = [
        make_point(**case, overrides={"system.accelerator.peak_tflops.bf16": 200.0 + 30 * i}).system for i in range(70)
    ]
    workload = SymbolicGenerator().generate(make_point(**case))
    whole = [asdict(r) for r in batch.price_many(workload, systems)]
    monkeypatch.setattr(batch, "MEMORY_BUDGET_BYTES", 1)
    assert [asdict(r) for r in batch.price_many(workload, systems)] == whole
