"""The compiled fast path (`fast_kernel`, `fast_compiled`) gives the interpreted fast path's schedules to the bit.

Both run the same rules in the same order with the same float operations; every schedule field is compared exactly
on every case of the fast path's own tests (pipeline schedules, ZeRO 1-3, recompute, tp, sp, cp, ep, every model
family), and the cases whose blocks both compute and transfer (ring attention's steps) are shown to take the
interpreted loop."""

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import fastpath
from simulators.analytical.fastpath import _FastScheduler
from tests.helpers import make_point
from tests.test_analytical_fastpath import CASES

RING = {"zb-h1-zero2-ring-cp"}
"""The case with context parallelism's ring attention (`cp_algorithm: ring`): blocks that both compute and send."""


def _schedules(case: str, compiled: bool, monkeypatch: pytest.MonkeyPatch):
    point = make_point(**CASES[case])
    workload = SymbolicGenerator().generate(point)
    ran = []

    def tracked(scheduler):
        out = fastpath_run_compiled(scheduler) if compiled else None
        ran.append(out is not None)
        return out

    fastpath_run_compiled = fastpath.run_compiled
    with monkeypatch.context() as patch:
        patch.setattr(fastpath, "run_compiled", tracked)
        scheduler = _FastScheduler(workload, point.system)
        return scheduler.run(), ran[0], scheduler.simulated


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_and_interpreted_fast_paths_agree_to_the_bit(case, monkeypatch):
    compiled, ran, simulated = _schedules(case, True, monkeypatch)
    interpreted, _, simulated_before = _schedules(case, False, monkeypatch)
    assert ran == (case not in RING)
    assert simulated == simulated_before  # the same segments missed the cache
    for a, b in zip(compiled, interpreted, strict=True):
        assert (a.end_s, a.compute_s, a.comm_s, a.exposed_comm_s) == (b.end_s, b.compute_s, b.comm_s, b.exposed_comm_s)
        assert a.time_by_category == b.time_by_category
        assert np.array_equal(a.call_start, b.call_start) and np.array_equal(a.call_end, b.call_end)
        assert a.transfers == b.transfers
        assert np.array_equal(a.busy.comm_starts, b.busy.comm_starts)
        assert np.array_equal(a.busy.knots, b.busy.knots)
