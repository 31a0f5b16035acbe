"""The memory sweep on given call times: liveness, working memory, and what is live at the peak."""

from dse.workload import Block, Call, Op, OpKind, Program, Tensor, TensorKind
from simulators.analytical.memory import peak_memory

BLOCKS = [
    Block("plain", (Op("k", OpKind.COMPUTE, "gemm"),)),
    Block("scratchy", (Op("k", OpKind.COMPUTE, "gemm"),), temp_bytes=300.0),
]


def program(tensors: list[Tensor], blocks: list[int]) -> Program:
    return Program(0, "p", [Call(b) for b in blocks], tensors)


def test_working_memory_counts_as_temporary_at_the_peak():
    p = program(
        [
            Tensor("w", TensorKind.PARAMETER, 1000.0),
            Tensor("a", TensorKind.ACTIVATION, 100.0, producer=0, consumer=2),
            Tensor("g", TensorKind.GRADIENT, 50.0, producer=1),
        ],
        [0, 1, 0],
    )
    peak, at_peak = peak_memory(p, BLOCKS, call_start=[0.0, 1.0, 3.0], call_end=[1.0, 3.0, 4.0])
    assert peak == 1000.0 + 100.0 + 50.0 + 300.0
    assert at_peak == {
        "parameter": 1000.0,
        "gradient": 50.0,
        "optimizer_state": 0.0,
        "activation": 100.0,
        "kv_cache": 0.0,
        "temporary": 300.0,
    }


def test_a_tensor_freed_as_another_is_allocated_is_reused():
    p = program(
        [
            Tensor("a", TensorKind.ACTIVATION, 100.0, producer=0, consumer=0),
            Tensor("b", TensorKind.ACTIVATION, 100.0, producer=1, consumer=1),
        ],
        [0, 0],
    )
    peak, _ = peak_memory(p, BLOCKS, call_start=[0.0, 2.0], call_end=[2.0, 4.0])
    assert peak == 100.0


def test_overlapping_lifetimes_add_up():
    p = program(
        [
            Tensor("a", TensorKind.ACTIVATION, 100.0, producer=0, consumer=1),
            Tensor("b", TensorKind.KV_CACHE, 40.0, producer=1),
        ],
        [0, 0],
    )
    peak, at_peak = peak_memory(p, BLOCKS, call_start=[0.0, 2.0], call_end=[2.0, 4.0])
    assert peak == 140.0
    assert at_peak["kv_cache"] == 40.0


def test_nothing_allocated_is_zero():
    peak, at_peak = peak_memory(program([], [0]), BLOCKS, call_start=[0.0], call_end=[1.0])
    assert peak == 0.0
    assert set(at_peak.values()) == {0.0}
