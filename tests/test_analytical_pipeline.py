"""Pipeline schedules built by hand: the 1F1B bubble and the activations each stage keeps in flight.

Every stage is its own rank class on a pp axis; a forward takes TF and a backward TB on a 1 TFLOP/s
accelerator, p2p messages are empty and the network has no latency, so communication costs nothing and the
step is the textbook (m + p - 1)(TF + TB).
"""

import numpy as np
import pytest
from helpers import UNIT_ACCELERATOR

from dse.system import NetworkDim, SystemSpec
from dse.workload import (
    BLOCK_INPUT,
    Block,
    Call,
    Op,
    OpKind,
    Program,
    RankLayout,
    Tensor,
    TensorKind,
    Workload,
)
from simulators.analytical import AnalyticalCostModel

TF, TB = 1e-3, 2e-3
PARAMS, ACTIVATION = 10e9, 1e9
FWD, BWD, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = range(6)


def _blocks() -> list[Block]:
    def compute(name: str, seconds: float) -> Block:
        return Block(name, (Op(name, OpKind.COMPUTE, "gemm", flops=seconds * 1e12, deps=(BLOCK_INPUT,)),))

    def p2p(name: str, kind: OpKind, peer: int) -> Block:
        deps = (BLOCK_INPUT,) if kind is OpKind.SEND else ()
        return Block(name, (Op(name, kind, name, axis="pp", peer=peer, deps=deps),))

    return [
        compute("fwd", TF),
        compute("bwd", TB),
        p2p("send_act", OpKind.SEND, 1),
        p2p("recv_act", OpKind.RECV, -1),
        p2p("send_grad", OpKind.SEND, -1),
        p2p("recv_grad", OpKind.RECV, 1),
    ]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    warmup = min(stages - 1 - stage, micro_batches)
    order = [("F", i) for i in range(warmup)]
    for b in range(micro_batches):
        if warmup + b < micro_batches:
            order.append(("F", warmup + b))
        order.append(("B", b))
    return order


def gpipe(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


def stage_program(stage: int, stages: int, order: list[tuple[str, int]]) -> Program:
    first, last = stage == 0, stage == stages - 1
    program = Program(stage, f"stage{stage}")
    program.tensors.append(Tensor("weights", TensorKind.PARAMETER, PARAMS))
    forward: dict[int, int] = {}
    for phase, mb in order:
        if phase == "F":
            inputs = () if first else (program.add(Call(RECV_ACT, microbatch=mb, tag=mb)),)
            forward[mb] = program.add(Call(FWD, inputs=inputs, microbatch=mb))
            if not last:
                program.add(Call(SEND_ACT, inputs=(forward[mb],), microbatch=mb, tag=mb))
        else:
            grad = () if last else (program.add(Call(RECV_GRAD, microbatch=mb, tag=mb)),)
            backward = program.add(Call(BWD, inputs=(forward[mb], *grad), microbatch=mb))
            activation = Tensor(f"act{mb}", TensorKind.ACTIVATION, ACTIVATION, forward[mb], backward)
            program.tensors.append(activation)
            if not first:
                program.add(Call(SEND_GRAD, inputs=(backward,), microbatch=mb, tag=mb))
    return program


def simulate(stages: int, micro_batches: int, schedule=one_f_one_b):
    programs = [stage_program(s, stages, schedule(s, stages, micro_batches)) for s in range(stages)]
    layout = RankLayout((("pp", stages),))
    w = Workload("pipe", layout, _blocks(), programs, np.arange(stages), tokens=1, model_flops=1.0)
    accelerator = UNIT_ACCELERATOR
    network = [NetworkDim(topology="ring", npus=stages, bandwidth_GBps=100, latency_ns=0)]
    system = SystemSpec(name="unit", accelerator=accelerator, network=network)
    return AnalyticalCostModel().simulate(w, system)


def test_one_f_one_b_order():
    assert one_f_one_b(0, 4, 6) == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5),
        ("B", 2), ("B", 3), ("B", 4), ("B", 5),
    ]  # fmt: skip
    assert one_f_one_b(3, 4, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (4, 8), (4, 3)])
def test_one_f_one_b_step_time_and_bubble(stages, micro_batches):
    result = simulate(stages, micro_batches)
    assert result.step_time_s == pytest.approx((micro_batches + stages - 1) * (TF + TB), rel=1e-12)
    busy = micro_batches * (TF + TB)
    for cls in result.classes:
        assert cls.compute_s == pytest.approx(busy, rel=1e-12)
        assert cls.comm_s == 0.0
    bubble = 1 - busy / result.step_time_s
    assert bubble == pytest.approx((stages - 1) / (micro_batches + stages - 1), rel=1e-12)


def test_one_f_one_b_keeps_one_micro_batch_in_flight_per_later_stage():
    stages, micro_batches = 4, 8
    result = simulate(stages, micro_batches)
    for stage, cls in enumerate(result.classes):
        in_flight = min(stages - stage, micro_batches)
        assert cls.peak_memory_bytes == pytest.approx(PARAMS + in_flight * ACTIVATION, rel=1e-12)
        assert cls.memory_at_peak["parameter"] == PARAMS
        assert cls.memory_at_peak["activation"] == pytest.approx(in_flight * ACTIVATION, rel=1e-12)
        assert cls.memory_at_peak["temporary"] == 0.0


def test_gpipe_keeps_every_micro_batch():
    stages, micro_batches = 4, 6
    result = simulate(stages, micro_batches, schedule=gpipe)
    assert result.step_time_s == pytest.approx((micro_batches + stages - 1) * (TF + TB), rel=1e-12)
    assert result.peak_memory_bytes == pytest.approx(PARAMS + micro_batches * ACTIVATION, rel=1e-12)
