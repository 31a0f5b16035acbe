"""The batch path's per-chunk shortcuts against what they replace: the latest call end in one compiled pass
(`batch_kernels.latest`), and one memory sweep shared by the chunks of a rank class (`batch._peaks`), which must give
every system the peak and breakdown of its own sweep, whichever system's order the shared sweep follows."""

import numpy as np

from simulators.analytical import batch, batch_kernels
from simulators.analytical.memory import Liveness


def test_the_latest_end_is_the_reduction_s():
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows, columns = int(rng.integers(0, 40)), int(rng.integers(1, 9))
        times = rng.integers(-2, 5, (rows, columns)) * rng.random()
        assert np.array_equal(batch_kernels.latest(times), times.max(axis=0, initial=0.0))


def test_a_sweep_kept_across_chunks_gives_each_system_its_own_peak():
    """Events at calls' starts and ends, of kinds and sizes drawn so that peaks fall at different events; times a
    nanosecond apart or tied between systems, so that some systems keep another's order and some do not."""
    rng = np.random.default_rng(1)
    for _ in range(150):
        calls, events = int(rng.integers(1, 10)), int(rng.integers(1, 25))
        side = rng.integers(0, 3, events)
        at_start = np.where(side == 0, rng.integers(0, calls, events), -1).astype(np.intp)
        at_end = np.where(side == 1, rng.integers(0, calls, events), -1).astype(np.intp)
        deltas = rng.choice([-3.0, -1.0, 2.0, 5.0], events)
        kinds = rng.integers(0, 3, events).astype(np.intp)
        liveness = Liveness(at_start=at_start, at_end=at_end, deltas=deltas, kinds=kinds)
        sweep = None
        for _chunk in range(3):
            systems = int(rng.integers(1, 6))
            base = rng.integers(0, 4, (calls, 1)) * 1e-3
            call_start = base + rng.integers(0, 3, (calls, systems)) * 4e-10
            call_end = call_start + rng.integers(0, 3, (calls, systems)) * 1e-3
            peaks, sweep = batch._peaks(liveness, call_start, call_end, sweep)
            for system, found in enumerate(peaks):
                own = liveness.peak(liveness.times(call_start[:, system], call_end[:, system]))
                assert found == own
