"""The batch path's compiled loops (`batch_kernels`) against plain references, on what the grids of
`test_analytical_batch` rarely reach: rows far from sorted, and intervals in any order; and the chunks of systems
they are run on (`batch._chunks`), which must not change a figure."""

from dataclasses import asdict

import numpy as np

from generators.symbolic import SymbolicGenerator
from simulators.analytical import batch, batch_kernels, intervals
from simulators.analytical.batch_busy import BLOCK
from simulators.analytical.tape import MAX_ADD, MIN, SHARED
from tests.helpers import make_point


def test_sort_orders_any_row():
    rng = np.random.default_rng(0)
    rows = [rng.random(500), np.arange(300.0)[::-1].copy(), rng.integers(0, 4, 200).astype(float), np.zeros(0)]
    for row in rows:
        expected = np.sort(row)
        batch_kernels._sort(row)  # a random or reversed row runs out of insertion budget: the heapsort
        assert np.array_equal(row, expected)


def test_evaluate_is_what_numpy_makes_of_each_node():
    """`evaluate` against np.maximum, np.minimum and np.add node by node, to the bit, on nodes of one to four
    arguments of every kind, with NaN and inf among the durations (np.maximum and np.minimum pass a NaN on from
    either side)."""
    rng = np.random.default_rng(3)
    for _ in range(100):
        rows, systems, columns = int(rng.integers(3, 40)), int(rng.integers(1, 9)), 4
        kind, first, args, column = [MAX_ADD, MAX_ADD], [0, 1, 2], [0, 0], [columns, columns]
        for row in range(2, rows):
            k = int(rng.choice([MAX_ADD, MIN, SHARED]))
            count = 2 if k == SHARED else int(rng.integers(1, 5))
            kind.append(k)
            args.extend(rng.integers(0, row, count).tolist())
            first.append(len(args))
            column.append(int(rng.integers(0, columns + 1)))
        durations = rng.choice([0.0, 1.0, 2.5, np.inf, np.nan], (columns + 1, systems))
        durations[columns] = 0.0  # the zero row
        kind, first, args, column = (np.array(a, dtype=np.intp) for a in (kind, first, args, column))
        values = np.empty((rows, systems))
        batch_kernels.evaluate(kind, first, args, column, durations, values)
        expected = np.empty((rows, systems))
        expected[0], expected[1] = 0.0, np.inf
        for row in range(2, rows):  # inf - inf makes a NaN, as it does in the kernel
            at, seconds = args[first[row] : first[row + 1]], durations[column[row]]
            if kind[row] == SHARED:
                start = expected[at[0]]
                with np.errstate(invalid="ignore"):
                    expected[row] = start + seconds + np.minimum(expected[at[1]] - start, seconds)
            elif kind[row] == MIN:
                expected[row] = np.minimum.reduce(expected[at])
            else:
                expected[row] = seconds + np.maximum.reduce(expected[at])
        assert np.array_equal(values, expected, equal_nan=True)


def _measured(
    compute: np.ndarray, comm: np.ndarray, moments: np.ndarray, blocks: np.ndarray, wanted: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`batch_kernels.measure` on intervals given as times (2 x intervals x systems: starts, ends), each a row of
    values, the communication's starts and ends in the first system's order; every system wanted by default;
    no cut, and the hidden total made the exposed one, as `batch_busy.BusyMany` makes it."""
    systems = compute.shape[2]
    wanted = np.ones(systems, dtype=bool) if wanted is None else wanted
    values = np.vstack((compute[0], compute[1], comm[0], comm[1]))
    n, m = compute.shape[1], comm.shape[1]
    durations = np.zeros((1, systems))  # the zero row alone: no start has a duration taken off
    rows = np.arange(len(values), dtype=np.intp)
    column = np.zeros(n + m, dtype=np.intp)
    compute_rows = np.stack((rows[:n], column[:n], rows[n : 2 * n]))
    comm_starts = 2 * n + np.argsort(comm[0, :, 0], kind="stable")
    comm_ends = 2 * n + m + np.argsort(comm[1, :, 0], kind="stable")
    comm_rows = np.stack((comm_starts, column[n:], comm_ends))
    no_cut = np.zeros((2, systems), dtype=np.intp)
    calls = np.zeros((2, n), dtype=np.int32), np.zeros((4, m), dtype=np.int32)
    totals, before = batch_kernels.measure(
        values, durations, compute_rows, comm_rows, *calls, moments, blocks, wanted, no_cut
    )
    totals[2] = np.maximum(0.0, totals[1] - totals[2])
    return totals, before


def test_measure_is_what_busy_measures():
    """Every figure `Busy` gives on each system's intervals, to rounding: the totals, and the seconds before each
    moment (`intervals._before`). Communication intervals in any order, overlapping each other and the compute, and
    moments before, inside and past the timeline; on whole seconds, intervals that touch or have no length, and
    moments at their ends. 37 systems make two blocks, the second short."""
    rng = np.random.default_rng(1)
    for n, m, systems, whole in [(30, 40, 37, False), (12, 20, 37, True), (0, 12, 5, False), (9, 0, 5, False)]:
        bounds = np.sort(rng.random((2 * n, systems)) * 10, axis=0)
        starts = rng.random((m, systems)) * 10
        lengths = rng.random((m, systems)) * rng.choice([0.1, 1.0, 3.0], (m, 1))
        if whole:
            bounds, starts, lengths = np.floor(bounds), np.floor(starts), np.floor(lengths * 2)
        compute = np.stack((bounds[0::2], bounds[1::2]))
        comm = np.stack((starts, starts + lengths))
        moments = np.vstack(
            (rng.random((6, systems)) * 12 - 1, compute[0, :1], comm[1, :1], np.full((1, systems), 5.0))
        )
        blocks = np.array([0, 32, systems]) if systems > 32 else np.array([0, systems])
        totals, before = _measured(compute, comm, moments, blocks)
        for system in range(systems):
            busy = intervals.Busy.of(*compute[:, :, system], *comm[:, :, system])
            assert np.allclose(totals[:, system], busy.totals, rtol=1e-12, atol=1e-12)
            for k, moment in enumerate(moments[:, system]):
                expected = intervals._before(
                    busy.knots, busy.done, busy.comm_starts, busy.comm_ends, busy.hidden, moment
                )
                assert np.allclose(before[k, :, system], expected, rtol=1e-12, atol=1e-12)


def test_measure_of_the_wanted_systems_alone():
    """Systems left out (at a block's edges, inside it, a whole block) get zeros; the others the figures, to the
    bit, that measuring every system gives them."""
    rng = np.random.default_rng(2)
    n, m, systems = 20, 30, 70
    bounds = np.sort(rng.random((2 * n, systems)) * 10, axis=0)
    starts = rng.random((m, systems)) * 10
    compute = np.stack((bounds[0::2], bounds[1::2]))
    comm = np.stack((starts, starts + rng.random((m, systems))))
    moments = rng.random((3, systems)) * 12 - 1
    blocks = np.array([0, 32, 64, systems])
    wanted = np.ones(systems, dtype=bool)
    wanted[[0, 1, 5, 6, 7, 31, 33, 62, 63]] = False
    wanted[64:] = False
    every = _measured(compute, comm, moments, blocks)
    some = _measured(compute, comm, moments, blocks, wanted)
    for whole, part in zip(every, some, strict=True):
        assert np.array_equal(part[..., wanted], whole[..., wanted])
        assert not part[..., ~wanted].any()


def test_measure_of_communication_straddling_compute():
    """Compute over [1, 3] and [5, 6]; communication over [0, 2], [2.5, 5.5] straddling the gap between the
    compute intervals, and [4, 4.5] inside it, where no compute runs: 1 + (0.5 + 0.5) seconds hidden of 5, 3
    exposed. Before 5.25: compute 2 + 0.25, communication 2 + 2.75, of it hidden 1 + (0.5 + 0.25)."""
    compute = np.array([[1.0, 5.0], [3.0, 6.0]])[:, :, None]
    comm = np.array([[0.0, 2.5, 4.0], [2.0, 5.5, 4.5]])[:, :, None]
    totals, before = _measured(compute, comm, np.array([[5.25], [0.5], [7.0]]), np.array([0, 1]))
    assert totals[:, 0].tolist() == [3.0, 5.0, 3.0]
    assert before[:, :, 0].tolist() == [[2.25, 4.75, 1.75], [0.0, 0.5, 0.0], [3.0, 5.0, 2.0]]


def test_calls_inside_a_stretch():
    """The run of calls `batch_steady.Period.cut` leaves out: from the one after the last call starting before A to
    the first ending after B, per system cut, as a plain search over every call finds it, (0, 0) on the others; on
    timelines whose calls repeat a period apart within the tolerance, in no order within a period and reaching
    past the next period's, with the steady run and the stretch [A, B] anywhere the search's premises allow: by the
    binary search over windows, and by the walks alone where the period is no more than twice the tolerance."""
    rng = np.random.default_rng(3)
    systems, tolerance = 200, 1e-7
    length = rng.uniform(0.5, 2.0, systems)
    distance = rng.integers(1, 12, systems)
    periods = 40
    calls = int(distance.max()) * periods
    start, end = np.full((calls, systems), np.inf), np.full((calls, systems), np.inf)
    lo, hi = np.zeros(systems, dtype=np.intp), np.zeros(systems, dtype=np.intp)
    a, b = np.zeros(systems), np.zeros(systems)
    for s in range(systems):
        d, own = int(distance[s]), int(distance[s]) * periods
        at = np.arange(own) // d * length[s] + np.tile(rng.uniform(0, length[s], d), periods)
        jitter = rng.uniform(-tolerance / 2, tolerance / 2, (2, own))
        start[:own, s] = at + jitter[0]
        end[:own, s] = at + np.tile(rng.uniform(0, 1.5 * length[s], d), periods) + jitter[1]
        lo[s] = rng.integers(0, 5 * d)
        hi[s] = own - d - rng.integers(1, 5 * d)
        a[s] = start[lo[s] + d, s] + 2 * length[s]
        later = start[hi[s] + d : own, s].min()  # calls from hi + distance start after B
        b[s] = a[s] + rng.integers(0, max(1, int((later - a[s]) / length[s]))) * length[s]
        assert np.all(end[: lo[s] + d, s] <= b[s]) and later > b[s]
    cut = rng.random(systems) < 0.9
    early, late = start < a, end > b
    first = np.where(early.any(axis=0), calls - np.argmax(early[::-1], axis=0), 0)
    after = np.where(late.any(axis=0), np.argmax(late, axis=0), calls)
    expected = [np.where(cut, first, 0).tolist(), np.where(cut, after, 0).tolist()]
    for tolerance in (1e-7, 1.0):  # 1.0: every period within twice it, so no window is searched
        found = batch_kernels.calls_inside(start, end, a, b, cut, lo, hi, distance, length, tolerance)
        assert found.tolist() == expected


def test_chunks_cover_the_systems_in_blocks_within_the_budget():
    """Chunks cover the systems in order, in blocks of `BLOCK` systems (the last shorter), each chunk as many blocks
    as the budget holds the values of, at least one."""
    for systems, rows in [(1000, 78_265), (1000, 152_107), (1000, 405_000), (250, 20_000), (5, 10**7), (1, 10)]:
        width = batch.MEMORY_BUDGET_BYTES // (8 * rows)
        chunks = batch._chunks(systems, rows)
        assert [int(b) for c in chunks for b in c[:-1]] == list(range(0, systems, BLOCK))
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
