"""The compiled reference scheduler (`compiled_engine`, `engine_kernel`) gives the interpreted one's schedules to the
bit: every field of every class, on every case of the fast path's tests (pipeline schedules, ZeRO 1-3, recompute,
tp, sp, cp with ring attention, ep, every model family), with its layer runs issued op by op (fast-forward off)."""

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical.call_layout import ranks
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.engine import schedule
from simulators.analytical.plans import Planner
from tests.helpers import make_point
from tests.test_analytical_fastpath import CASES


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_and_interpreted_reference_agree_to_the_bit(case):
    point = make_point(**CASES[case])
    workload = SymbolicGenerator().generate(point)
    scheduler = CompiledScheduler(workload, point.system, fast_forward=False)  # on: test_fast_forward.py
    compiled = scheduler.run()
    interpreted = schedule(workload, point.system, timeline=False)
    # Categories are numbered as plans are first built, which differs (the interpreted engine builds them call by
    # call): a transfer's category is compared by name.
    names = list(scheduler._planner.categories)
    reference = Planner(workload, point.system, fuse=True)
    for index, program in enumerate(workload.programs):
        for call in program.calls:
            reference.plan(call.block, index)
    reference_names = list(reference.categories)
    for a, b in zip(compiled, interpreted, strict=True):
        assert (a.end_s, a.compute_s, a.comm_s, a.exposed_comm_s) == (b.end_s, b.compute_s, b.comm_s, b.exposed_comm_s)
        assert a.time_by_category == b.time_by_category
        assert np.array_equal(a.call_start, b.call_start) and np.array_equal(a.call_end, b.call_end)
        assert [(c, names[k], s) for c, k, s in a.transfers.rows()] == [
            (c, reference_names[k], s) for c, k, s in b.transfers.rows()
        ]


def test_mailboxes_rank_their_codes_by_table_and_by_sort():
    """`call_layout.ranks` numbers values by their rank among the distinct ones, by a table or (values too spread,
    or not known to be in range) by sorting."""
    rng = np.random.default_rng(36)
    for spread in (1, 50, 2_000, 10**9):
        code = rng.integers(0, spread, 300)
        want = np.unique(code, return_inverse=True)[1]
        for size in (spread, -1):
            assert np.array_equal(ranks(code, size), want), (spread, size)
    assert len(ranks(np.zeros(0, dtype=np.int64), -1)) == 0
