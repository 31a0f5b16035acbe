"""The batch path's compiled replacements for per-chunk numpy (`batch_kernels.longest_steady`, `keeps_order`,
`add_rows`) against the code they replace, on draws that reach ties, runs of equal length and repeated rows; and
the timing keys kept per system object (`batch._timing_key`)."""

import numpy as np

from simulators.analytical import batch
from simulators.analytical.batch_kernels import add_rows, keeps_order, longest_steady
from simulators.analytical.memory import Liveness
from simulators.analytical.steady import TOLERANCE_S, _longest_steady
from tests.helpers import make_point


def test_every_system_s_steady_run_is_the_one_the_per_point_search_finds():
    """Every system's period and first longest steady run at once, as `steady._longest_steady` finds them on one
    timeline. Times drawn from a few values make runs, ties between runs, and periods of zero."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        calls, distance, systems = int(rng.integers(1, 40)), int(rng.integers(1, 4)), int(rng.integers(1, 8))
        twin = rng.random(calls) < rng.random()
        start = rng.integers(0, 3, (calls + distance, systems)).astype(float)
        end = start + rng.integers(0, 2, start.shape)
        middle = int(rng.integers(0, calls))
        length, lo, hi = longest_steady(twin, start, end, distance, middle, TOLERANCE_S)
        for system in range(systems):
            own = float(start[middle + distance, system] - start[middle, system])
            assert length[system] == own
            found = _longest_steady(twin, start[:, system], end[:, system], distance, own, TOLERANCE_S)
            assert (int(lo[system]), int(hi[system])) == (found if found[0] >= 0 else (0, 0))


def test_an_order_is_kept_where_the_rounded_times_sort_as_the_first_system_s():
    """`keeps_order` against the arrays it replaces: the events' times (`Liveness.times`) rounded to 9 decimals in
    the first system's sweep order, later or tied with an allocation after a free. Times a nanosecond apart, equal
    or swapped between systems all occur."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        calls, events, systems = int(rng.integers(1, 12)), int(rng.integers(1, 30)), int(rng.integers(1, 9))
        side = rng.integers(0, 3, events)  # at a call's start, at its end, or at neither
        at_start = np.where(side == 0, rng.integers(0, calls, events), -1).astype(np.intp)
        at_end = np.where(side == 1, rng.integers(0, calls, events), -1).astype(np.intp)
        deltas = rng.choice([-2.0, -1.0, 1.0, 3.0], events)
        liveness = Liveness(at_start=at_start, at_end=at_end, deltas=deltas, kinds=np.zeros(events, dtype=np.intp))
        base = rng.integers(0, 4, (calls, 1)) * 1e-3
        call_start = base + rng.integers(0, 3, (calls, systems)) * 4e-10  # ties within rounding, and not
        call_end = call_start + rng.integers(0, 3, (calls, systems)) * 1e-3
        times = liveness.times(call_start, call_end)
        order = liveness.order(times[:, 0])
        when = np.round(times[order], 9)
        allocates = (deltas > 0)[order]
        later = when[1:] > when[:-1]
        tied = (when[1:] == when[:-1]) & (allocates[1:, None] >= allocates[:-1, None])
        expected = (later | tied).all(axis=0)
        found = keeps_order(call_start, call_end, at_start, at_end, order, allocates)
        assert np.array_equal(found, expected)


def test_rows_are_added_as_add_at_adds_them():
    rng = np.random.default_rng(2)
    for _ in range(50):
        rows, systems, count = int(rng.integers(1, 6)), int(rng.integers(1, 7)), int(rng.integers(0, 20))
        out = rng.random((rows, systems))
        at = rng.integers(0, rows, count)
        values = rng.random((count, systems)) * 10.0 ** rng.integers(-9, 3, (count, 1))
        expected = out.copy()
        np.add.at(expected, at, values)
        add_rows(out, at, values)
        assert np.array_equal(out, expected)


def test_a_timing_key_is_kept_per_system_object():
    """The key of a system priced again is the one kept for that object; an equal system of its own is keyed
    anew, and gets an equal key."""
    system = make_point(tp=2, pp=1, dp=1, system={"base": "dgx-h100"}).system
    key = batch._timing_key(system)
    assert batch._timing_key(system) is key
    twin = system.model_copy(deep=True)
    assert batch._timing_key(twin) == key
    assert batch._timing_key(twin) is not key
    faster = make_point(
        tp=2, pp=1, dp=1, system={"base": "dgx-h100"}, overrides={"system.accelerator.peak_tflops.bf16": 2000.0}
    ).system
    assert batch._timing_key(faster) != key
