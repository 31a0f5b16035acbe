"""The steady checks' compiled windows (`steady._windows`) against `Busy.between`, bit for bit."""

import numpy as np
import pytest

from simulators.analytical.intervals import Busy
from simulators.analytical.steady import _interp, _windows


def _busy(seed: int) -> Busy:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    edges = np.cumsum(rng.choice([0.0, 0.5, 1.0, 1.25], size=2 * n))  # touching intervals share a knot
    m = int(rng.integers(0, 300))
    comm_starts = rng.random(m) * (edges[-1] if n else 10.0)
    comm_ends = comm_starts + rng.choice([0.0, 0.1, 0.7, 2.0], size=m)
    return Busy.of(edges[0::2], edges[1::2], comm_starts, comm_ends)


@pytest.mark.parametrize("seed", range(200))
def test_windows_equal_busy_between(seed):
    busy = _busy(seed)
    rng = np.random.default_rng(seed + 1000)
    for lo, shift in [(0.0, 1.0), (float(rng.random() * 20), float(rng.random() * 5)), (-1.0, 0.5), (3.0, 100.0)]:
        expected = busy.between(lo, lo + shift) + busy.between(lo + shift, lo + 2 * shift)
        got = _windows(busy.knots, busy.done, busy.comm_starts, busy.comm_ends, busy.hidden, lo, shift)
        assert got == expected


def test_interp_equals_numpy_at_knots_between_and_outside():
    xp = np.array([0.0, 1.0, 1.0, 2.5, 4.0, 4.0, 7.0])
    fp = np.array([0.0, 1.0, 1.0, 2.5, 4.0, 4.0, 7.0]) * 0.3
    for x in [-1.0, 0.0, 0.5, 1.0, 1.7, 2.5, 4.0, 6.99, 7.0, 9.0, np.nan]:
        expected = float(np.interp(x, xp, fp))
        assert _interp(x, xp, fp) == expected or (np.isnan(expected) and np.isnan(_interp(x, xp, fp)))
