"""The calls' side of the steady check, compiled (`steady._twin_calls`, `steady._reach_of`), against the numpy they
replaced, on the programs of pipeline schedules with and without steady forms."""

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import steady
from simulators.analytical.calls import call_array
from simulators.analytical.steady import call_reach
from tests.helpers import make_point
from tests.test_analytical_batch import CASES


def _twins(microbatch: np.ndarray, block: np.ndarray, period: int) -> tuple:
    """The numpy search `steady._twins` made before it was compiled."""
    count = int(microbatch.max()) + 1 if len(microbatch) else 0
    middle = max(0, count // 2 - period)
    for j in sorted(range(count - period), key=lambda j: abs(j - middle)):
        a, b = np.flatnonzero(microbatch == j), np.flatnonzero(microbatch == j + period)
        if len(a) and len(a) == len(b) and np.array_equal(block[a], block[b]) and np.ptp(b - a) == 0:
            distance = int(b[0] - a[0])
            here, there = slice(0, len(block) - distance), slice(distance, len(block))
            twin = (block[here] == block[there]) & (microbatch[here] >= 0)
            twin &= microbatch[there] == microbatch[here] + period
            edges = np.flatnonzero(np.diff(np.concatenate(([0], twin.astype(np.int8), [0]))))
            lo, hi = max(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True), key=lambda run: run[1] - run[0])
            return distance, twin, (lo + hi) // 2
    return ()


@pytest.mark.parametrize("case", sorted(CASES))
def test_twins_and_reach_are_the_numpy_ones(case):
    workload = SymbolicGenerator().generate(make_point(**CASES[case]))
    forms = [] if workload.steady is None else [workload.steady.programs]
    for programs in [*forms, workload.programs]:
        for program in programs:
            reach = [c - min(call.inputs) if call.inputs else 0 for c, call in enumerate(program.calls)]
            assert call_reach(program).tolist() == reach
            assert steady._reach(program).tolist() == reach
            for period in (1, 2, 4):
                expected = _twins(call_array(program, "microbatch"), call_array(program, "block"), period)
                found = steady._twins(program, period)
                assert (found == ()) == (expected == ())
                if expected:
                    assert found[0] == expected[0] and found[2] == expected[2]
                    assert np.array_equal(found[1], expected[1])
