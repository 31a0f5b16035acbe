"""The calls' side of the steady check, compiled (`steady._twin_calls`), against numpy, on the programs of pipeline
schedules with and without steady forms."""

import numpy as np
import pytest

from generators.symbolic import SymbolicGenerator
from simulators.analytical import steady
from simulators.analytical.calls import call_array
from tests.helpers import make_point
from tests.test_analytical_batch import CASES


def _twins(microbatch: np.ndarray, block: np.ndarray, period: int) -> tuple:
    """`steady._twins` in numpy: the distance is the calls of `period` micro-batches, from the middle outwards."""
    count = int(microbatch.max()) + 1 if len(microbatch) else 0
    sizes = np.bincount(microbatch[microbatch >= 0], minlength=count)
    middle = max(0, count // 2 - period)
    for j in sorted(range(count - 2 * period + 1), key=lambda j: abs(j - middle)):
        distance = int(sizes[j : j + period].sum())
        if distance == 0 or distance != sizes[j + period : j + 2 * period].sum():
            continue
        here, there = slice(0, len(block) - distance), slice(distance, len(block))
        twin = (block[here] == block[there]) & (microbatch[here] >= 0)
        twin &= microbatch[there] == microbatch[here] + period
        if not twin.any():
            continue
        edges = np.flatnonzero(np.diff(np.concatenate(([0], twin.astype(np.int8), [0]))))
        lo, hi = max(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True), key=lambda run: run[1] - run[0])
        return distance, twin, (lo + hi) // 2
    return ()


@pytest.mark.parametrize("case", sorted(CASES))
def test_twins_are_the_numpy_ones(case):
    workload = SymbolicGenerator().generate(make_point(**CASES[case]))
    forms = [] if workload.steady is None else [workload.steady.programs]
    for programs in [*forms, workload.programs]:
        for program in programs:
            for period in (1, 2, 4):
                expected = _twins(call_array(program, "microbatch"), call_array(program, "block"), period)
                found = steady._twins(program, period)
                assert (found == ()) == (expected == ())
                if expected:
                    assert found[0] == expected[0] and found[2] == expected[2]
                    assert np.array_equal(found[1], expected[1])
