"""The compiled memory sweep on a generator's programs (tensors in a TensorTable, calls in a CallShape), whose
moments and last order it keeps on the shape: bit for bit `Liveness`'s numpy sweep, on the first timeline and on
later ones that keep, break or tie the kept order, with tensors of no bytes and several calls at one instant."""

import numpy as np
import pytest

from dse.workload import (
    TENSOR_KIND_CODE,
    TENSOR_KINDS,
    Block,
    Call,
    CallShape,
    Op,
    OpKind,
    Program,
    TableTensors,
    Tensor,
    TensorKind,
    TensorTable,
    table_parts,
)
from simulators.analytical.memory import Liveness, peak_memory


def _program(rng: np.random.Generator, shape: CallShape, table: TensorTable) -> Program:
    own = [
        Tensor("parameter", TensorKind.PARAMETER, float(rng.choice([0.0, 5.0e9]))),
        Tensor("gradient", TensorKind.GRADIENT, 5.0e9, producer=0 if len(shape.calls) > 1 else None),
    ]
    sizes = rng.choice([0.0, 1.0, 0.1, 1e17, 1000.25, rng.random() * 1e9], size=len(table.names))
    return Program(0, "p", shape.program_calls(), TableTensors(own, table, sizes.astype(float)), shape)


def _shape_and_table(rng: np.random.Generator) -> tuple[CallShape, TensorTable]:
    calls = int(rng.integers(2, 50))
    shape = CallShape(tuple(Call(int(rng.integers(0, 4))) for _ in range(calls)))
    rows = int(rng.integers(0, 70))
    producer = rng.integers(0, calls, size=rows)
    consumer = np.minimum(producer + rng.integers(0, 6, size=rows), calls - 1)
    kinds = tuple(TENSOR_KINDS[int(k)] for k in rng.integers(0, len(TENSOR_KINDS), size=rows))
    table = TensorTable(
        tuple(f"t{i}" for i in range(rows)),
        kinds,
        producer.astype(np.intp),
        consumer.astype(np.intp),
        np.array([TENSOR_KIND_CODE[k] for k in kinds], dtype=np.intp),
    )
    return shape, table


def _timeline(rng: np.random.Generator, calls: int) -> tuple[np.ndarray, np.ndarray]:
    """Calls one after another, most touching (one ends as the next starts), some a fraction of a nanosecond
    apart, some overlapping as two streams do; or on a coarse grid, several starting and ending at one instant."""
    if rng.random() < 0.3:
        start = np.sort(rng.integers(0, max(calls // 3, 1), size=calls)) * 1e-3
        return start, start + rng.choice([1e-3, 2e-3], size=calls)
    gaps = rng.choice([0.0, 0.0, 0.0, 1e-10, 1e-3, -1e-3], size=calls)
    lengths = rng.choice([1e-3, 2.5e-3, 2e-3, 1e-11], size=calls)
    start = np.maximum(np.cumsum(gaps + np.concatenate(([0.0], lengths[:-1]))), 0.0)
    return start, start + lengths


def _blocks(rng: np.random.Generator) -> list[Block]:
    return [
        Block(f"b{i}", (Op("k", OpKind.COMPUTE, "gemm"),), temp_bytes=float(rng.choice([0.0, 300.5, 7.0])))
        for i in range(4)
    ]


def _same(program: Program, blocks: list[Block], start: np.ndarray, end: np.ndarray) -> None:
    events = Liveness.of(program, blocks)
    expected = events.peak(events.times(start, end))
    peak, at_peak = peak_memory(program, blocks, start, end)
    assert peak == expected[0]
    assert list(at_peak.items()) == list(expected[1].items())


@pytest.mark.parametrize("seed", range(150))
def test_every_point_of_a_shape_sweeps_as_liveness_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    shape, table = _shape_and_table(rng)
    for _ in range(4):  # later points of the shape: new sizes, working memory and timelines
        program, blocks = _program(rng, shape, table), _blocks(rng)
        start, end = _timeline(rng, len(shape.calls))
        _same(program, blocks, start, end)
        _same(program, blocks, start[::-1].copy(), end[::-1].copy())  # far from the kept order
        _same(program, blocks, start, end)
    assert ("memory.moments", table) in shape.memo


def test_negative_sizes_and_edited_programs_take_other_paths_with_the_same_figures():
    rng = np.random.default_rng(1)
    shape, table = _shape_and_table(rng)
    program, blocks = _program(rng, shape, table), _blocks(rng)
    start, end = _timeline(rng, len(shape.calls))
    parts = table_parts(program.tensors)
    assert parts is not None
    program.tensors = TableTensors(parts[0], table, -parts[2])
    _same(program, blocks, start, end)
    program.calls.append(Call(0))  # edited: the shape no longer holds the calls
    _same(program, blocks, np.append(start, end[-1]), np.append(end, end[-1] + 1.0))
