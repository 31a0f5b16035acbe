"""The compiled memory sweep (`memory._sweep`) against `Liveness`'s numpy sweep, bit for bit: instants closer than
a nanosecond are one, frees go before allocations at an instant, ties keep event order."""

import numpy as np
import pytest

from dse.workload import TENSOR_KINDS, Block, Call, Op, OpKind, Program, Tensor
from simulators.analytical.memory import Liveness, peak_memory, working_bytes


def _random_case(seed: int) -> tuple[Program, list[Block], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    calls = int(rng.integers(1, 60))
    blocks = [
        Block(f"b{i}", (Op("k", OpKind.COMPUTE, "gemm"),), temp_bytes=float(rng.choice([0.0, 0.0, 300.5, 7.0])))
        for i in range(4)
    ]
    # Calls one after another, some touching, some a fraction of a nanosecond apart, a few out of order.
    gaps = rng.choice([0.0, 0.0, 1e-10, 3e-10 * rng.random(), 1e-3], size=calls)
    lengths = rng.choice([0.0, 1e-3, 2.5e-3, 1e-11], size=calls)
    start = np.cumsum(gaps + np.concatenate(([0.0], lengths[:-1])))
    if calls > 3 and seed % 3 == 0:
        start[[1, calls - 2]] = start[[calls - 2, 1]]
    end = start + lengths
    tensors = []
    for t in range(int(rng.integers(0, 80))):
        producer = int(rng.integers(-1, calls))
        consumer = int(rng.integers(max(producer, 0), calls)) if rng.random() < 0.8 else None
        size = float(rng.choice([0.0, 1.0, 64.0, 1000.25, float(rng.integers(1, 10**9))]))
        kind = TENSOR_KINDS[int(rng.integers(0, len(TENSOR_KINDS)))]
        tensors.append(Tensor(f"t{t}", kind, size, None if producer < 0 else producer, consumer))
    program = Program(0, "p", [Call(int(rng.integers(0, 4))) for _ in range(calls)], tensors)
    return program, blocks, start, end


@pytest.mark.parametrize("seed", range(300))
def test_the_compiled_sweep_equals_liveness_bit_for_bit(seed):
    program, blocks, start, end = _random_case(seed)
    events = Liveness.of(program, blocks)
    expected = events.peak(events.times(start, end))
    peak, at_peak = peak_memory(program, blocks, start, end)
    assert peak == expected[0]
    assert list(at_peak.items()) == list(expected[1].items())


def test_a_timeline_that_is_not_finite_takes_liveness_path():
    program, blocks, start, end = _random_case(7)
    start[0] = np.nan
    events = Liveness.of(program, blocks)
    expected = events.peak(events.times(start, end))
    assert peak_memory(program, blocks, start, end) == expected


@pytest.mark.parametrize("size", [np.nan, np.inf, -1.0])
def test_a_size_that_is_not_finite_or_is_negative_takes_liveness_path(size):
    program, blocks, start, end = _random_case(5)
    program.tensors[3] = program.tensors[3]._replace(bytes=size)
    events = Liveness.of(program, blocks)
    np.testing.assert_equal(peak_memory(program, blocks, start, end), events.peak(events.times(start, end)))


def test_working_memory_read_once_sweeps_as_read_per_program():
    program, blocks, start, end = _random_case(11)
    assert peak_memory(program, blocks, start, end, working_bytes(blocks)) == peak_memory(program, blocks, start, end)
