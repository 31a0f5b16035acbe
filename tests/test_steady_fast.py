"""Busy's compiled windows (`Busy.between`, `Busy.periods`, as `steady` reads a period's busy seconds) against
numpy's arithmetic for them, bit for bit."""

import numpy as np
import pytest

from simulators.analytical.intervals import Busy, _interp


def _busy(seed: int) -> Busy:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    edges = np.cumsum(rng.choice([0.0, 0.5, 1.0, 1.25], size=2 * n))  # touching intervals share a knot
    m = int(rng.integers(0, 300))
    comm_starts = rng.random(m) * (edges[-1] if n else 10.0)
    comm_ends = comm_starts + rng.choice([0.0, 0.1, 0.7, 2.0], size=m)
    return Busy.of(edges[0::2], edges[1::2], comm_starts, comm_ends)


def _numpy_before(busy: Busy, moment: float) -> tuple[float, float, float]:
    """Compute, communication and hidden communication seconds before `moment`, in numpy."""
    compute = float(np.interp(moment, busy.knots, busy.done)) if len(busy.knots) else 0.0
    whole = int(np.searchsorted(busy.comm_ends, moment, side="right"))
    comm = float((busy.comm_ends[:whole] - busy.comm_starts[:whole]).sum())
    hidden = float(busy.hidden[:whole].sum())
    if whole < len(busy.comm_starts) and busy.comm_starts[whole] < moment:
        start = float(busy.comm_starts[whole])
        comm += moment - start
        if len(busy.knots):
            hidden += compute - float(np.interp(start, busy.knots, busy.done))
    return compute, comm, hidden


def _numpy_between(busy: Busy, start: float, end: float) -> tuple[float, float, float]:
    (compute_a, comm_a, hidden_a), (compute_b, comm_b, hidden_b) = _numpy_before(busy, start), _numpy_before(busy, end)
    comm = comm_b - comm_a
    return compute_b - compute_a, comm, max(0.0, comm - (hidden_b - hidden_a))


@pytest.mark.parametrize("seed", range(200))
def test_windows_equal_numpys(seed):
    busy = _busy(seed)
    rng = np.random.default_rng(seed + 1000)
    for lo, shift in [(0.0, 1.0), (float(rng.random() * 20), float(rng.random() * 5)), (-1.0, 0.5), (3.0, 100.0)]:
        first, second = _numpy_between(busy, lo, lo + shift), _numpy_between(busy, lo + shift, lo + 2 * shift)
        assert busy.periods(lo, shift) == (first, second)
        assert busy.between(lo, lo + shift) == first


def test_interp_equals_numpy_at_knots_between_and_outside():
    xp = np.array([0.0, 1.0, 1.0, 2.5, 4.0, 4.0, 7.0])
    fp = np.array([0.0, 1.0, 1.0, 2.5, 4.0, 4.0, 7.0]) * 0.3
    for x in [-1.0, 0.0, 0.5, 1.0, 1.7, 2.5, 4.0, 6.99, 7.0, 9.0, np.nan]:
        expected = float(np.interp(x, xp, fp))
        assert _interp(x, xp, fp) == expected or (np.isnan(expected) and np.isnan(_interp(x, xp, fp)))
