"""Pipeline schedules as the frameworks run them, generated and priced, against their closed-form bubbles.

An idealised point isolates the schedule: every block but the layers' forwards and backwards (embedding, head,
optimizer, pipeline transfers) costs nothing, on a network without latency, and each model chunk holds one
identical layer. A stage is then busy for its chunks' forwards and backwards and idle only where its schedule
makes it wait, so the step must be exactly the textbook one: interleaved 1F1B with v chunks per stage runs
m v + p - 1 chunk slots, a bubble of (p - 1) / (v m) of the busy time (Narayanan et al. 2021).
"""

from dataclasses import replace

import pytest
from helpers import UNIT_ACCELERATOR, make_point

from dse.errors import InfeasibleError
from dse.point.feasibility import check_feasible
from dse.spec import DesignPoint
from dse.system import NetworkDim, SystemSpec
from dse.workload import BLOCK_INPUT, Block, Op, OpKind
from generators.symbolic import SymbolicGenerator
from generators.symbolic.schedule import chunk_order, interleaved
from simulators.analytical import AnalyticalCostModel

CATEGORIES = ("gemm", "attention", "elementwise", "norm", "embedding", "optimizer", "other")
ACCELERATOR = UNIT_ACCELERATOR.model_copy(update={"compute_efficiency": dict.fromkeys(CATEGORIES, 1.0)})


def pipeline_point(pp: int, virtual: int, microbatches: int, group: int | None = None) -> DesignPoint:
    schedule = {"pp_schedule": "interleaved", "virtual_stages": virtual} if virtual > 1 else {}
    point = make_point(
        "tiny-llama",
        {"base": "tiny-ring", "network": {0: {"npus": pp}, 1: {"npus": 1}}},
        global_batch=microbatches,
        pp=pp,
        overrides={"model.layers": pp * virtual},
        **schedule,
        **({"microbatch_group": group} if group else {}),
    )
    check_feasible(point)
    return point


def idealised_step(point: DesignPoint) -> tuple[float, list[float]]:
    """Step time and per-stage busy time of the point with only its layers' compute priced."""
    workload = SymbolicGenerator().generate(point)
    free = [
        block
        if block.name.startswith("layer.")
        else Block(block.name, tuple(replace(op, flops=0.0, bytes=0.0, comm_bytes=0.0) for op in block.ops))
        for block in workload.blocks
    ]
    key = f"idealised {point.parallel.pp} {point.parallel.virtual_stages} {point.micro_batches}"
    workload = replace(workload, blocks=free, point_key=key)
    network = [NetworkDim(topology="ring", npus=point.parallel.pp, bandwidth_GBps=100, latency_ns=0)]
    system = SystemSpec(name="ideal", accelerator=ACCELERATOR, network=network)
    result = AnalyticalCostModel().simulate(workload, system)
    return result.step_time_s, [c.compute_s for c in result.classes]


def test_micro_batches_go_through_the_chunks_in_megatrons_groups():
    # Megatron-core's own example (get_schedule_table, PP2 N3 M5 VP2): micro-batches 0 1 2 0 1 2 3 4 3 4 over
    # chunks 0 0 0 1 1 1 0 0 1 1; the last group takes what is left
    assert chunk_order(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]


@pytest.mark.parametrize(("stages", "chunks", "group"), [(4, 2, 4), (4, 3, 5), (8, 4, 8)])
def test_a_stage_warms_up_with_megatrons_count_of_forwards(stages, chunks, group):
    for stage in range(stages):
        steps = interleaved(stages, stage, 4 * group, chunks, group)
        warmup = next(i for i, step in enumerate(steps) if step[0] == "B") - 1
        assert warmup == (stages - stage - 1) * 2 + (chunks - 1) * group


CASES = [(p, v, m, None) for p in (2, 4) for v in (1, 2, 4, 8) for m in (p, 8 * p)]
# m not a multiple of p: Megatron needs a group whose last one holds 0 or at least p micro-batches
CASES += [(2, v, 5, 3) for v in (2, 4, 8)] + [(4, v, 9, 5) for v in (2, 4, 8)] + [(4, 2, 35, 9), (4, 4, 28, 8)]
CASES += [(4, 1, 9, None), (2, 1, 5, None)]


@pytest.mark.parametrize(("pp", "virtual", "microbatches", "group"), CASES)
def test_the_idle_time_is_the_closed_form_bubble(pp, virtual, microbatches, group):
    step, busy = idealised_step(pipeline_point(pp, virtual, microbatches, group))
    assert max(busy) - min(busy) < 1e-12 * step
    assert step == pytest.approx(max(busy) * (1 + (pp - 1) / (virtual * microbatches)), rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(global_batch=9), "set parallel.microbatch_group: 5"),
        (dict(global_batch=9, microbatch_group=4), "leaves a last group of 1 < parallel.pp=4"),
        (dict(global_batch=8, microbatch_group=9), "parallel.microbatch_group=9 is over the 8 micro-batches"),
        (dict(global_batch=8, microbatch_group=2), "parallel.microbatch_group=2 is under parallel.pp=4"),
        (dict(global_batch=2), "needs at least parallel.pp=4 micro-batches per step, not 2"),
        (dict(global_batch=8, microbatch_group=4, virtual_stages=1), "applies to interleaved 1F1B"),
    ],
)
def test_megatrons_refusals_of_micro_batch_groups_name_the_field(kwargs, message):
    kwargs = {"virtual_stages": 2} | kwargs
    point = make_point(
        "tiny-llama",
        {"base": "tiny-ring", "network": {0: {"npus": 4}, 1: {"npus": 1}}},
        pp=4,
        pp_schedule="interleaved",
        overrides={"model.layers": 8},
        **kwargs,
    )
    with pytest.raises(InfeasibleError, match=message):
        check_feasible(point)


def timed_step(point: DesignPoint, seconds: dict[str, float]) -> float:
    """Step time of the point when the layer blocks named in `seconds` take that long and every other block
    nothing."""
    workload = SymbolicGenerator().generate(point)
    blocks = [
        Block(b.name, (Op(b.name, OpKind.COMPUTE, "gemm", flops=seconds[b.name] * 1e12, deps=(BLOCK_INPUT,)),))
        if b.name in seconds
        else Block(b.name, tuple(replace(op, flops=0.0, bytes=0.0, comm_bytes=0.0) for op in b.ops))
        for b in workload.blocks
    ]
    workload = replace(workload, blocks=blocks, point_key=f"timed {sorted(seconds.items())} {point.micro_batches}")
    network = [NetworkDim(topology="ring", npus=point.parallel.pp, bandwidth_GBps=100, latency_ns=0)]
    system = SystemSpec(name="ideal", accelerator=ACCELERATOR, network=network)
    return AnalyticalCostModel().simulate(workload, system).step_time_s


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 2), (4, 4), (4, 9), (4, 32), (8, 8), (8, 24)])
@pytest.mark.parametrize(("tf", "tb", "tw"), [(1e-3, 1e-3, 1e-3), (1.2e-3, 1.5e-3, 0.9e-3)])
def test_zero_bubble_h1_leaves_the_papers_bubble(pp, microbatches, tf, tb, tw):
    """Qi et al. 2023 sec. 3.1: ZB-H1's bubble is (p-1)(T_F + T_B - T_W), against 1F1B's (p-1)(T_F + T_B + T_W)
    with the same backward unsplit."""
    common = dict(global_batch=microbatches, pp=pp, overrides={"model.layers": pp})
    system = {"base": "tiny-ring", "network": {0: {"npus": pp}, 1: {"npus": 1}}}
    zb = make_point("tiny-llama", system, pp_schedule="zb_h1", **common)
    plain = make_point("tiny-llama", system, **common)
    check_feasible(zb)
    seconds = {"layer.forward": tf, "layer.backward": tb, "layer.backward.weight": tw}
    assert timed_step(zb, seconds) == pytest.approx(
        microbatches * (tf + tb + tw) + (pp - 1) * (tf + tb - tw), rel=1e-12
    )
    unsplit = {"layer.forward": tf, "layer.backward": tb + tw}
    assert timed_step(plain, unsplit) == pytest.approx((microbatches + pp - 1) * (tf + tb + tw), rel=1e-12)


def test_zero_bubble_splits_each_backward_into_input_and_weight_gradients():
    """The weight half is the weight-gradient GEMMs and the sequence-parallel regathers only they read; nothing
    is lost or counted twice."""
    kwargs = dict(tp=2, pp=2, dp=2, sp=True, global_batch=8)
    split = {b.name: b for b in SymbolicGenerator().generate(make_point(pp_schedule="zb_h1", **kwargs)).blocks}
    whole = {b.name: b for b in SymbolicGenerator().generate(make_point(**kwargs)).blocks}
    for name in ("layer.backward", "head.backward"):
        b, w = split[name], split[f"{name}.weight"]
        assert {op.name for op in w.ops} == {op.name for op in whole[name].ops if op.name.endswith(".wgrad")} | {
            op.name for op in w.ops if op.name.endswith(".regather") and op.kind is OpKind.COLLECTIVE
        }
        assert all(not op.name.endswith(".wgrad") for op in b.ops)
        assert sorted(op.name for op in (*b.ops, *w.ops)) == sorted(op.name for op in whole[name].ops)
        assert sum(op.flops for op in (*b.ops, *w.ops)) == pytest.approx(sum(op.flops for op in whole[name].ops))
    assert "embed.backward.weight" not in split  # no input gradient: its backward stays whole


def test_zero_bubble_h1_is_refused_for_inference():
    point = make_point(pp=2, dp=4, pp_schedule="zb_h1", overrides={"workload.mode": "prefill"})
    with pytest.raises(InfeasibleError, match="pp_schedule=zb_h1 is a training schedule"):
        check_feasible(point)


def test_zero_bubble_h1_holds_what_the_weight_gradients_read_until_they_run():
    """A tiny-llama layer's weight-gradient GEMMs read the inputs of its seven projections (the two norms' outputs,
    the attention output, the SwiGLU output: s b (3h + f)) and their output gradients (q, k, v, o, gate, up,
    down: s b (h + 2 kv + h + 2 f + h)), bf16: those stay from the input-gradient half to the weight-gradient
    half; the rest of the saved activations goes with the input-gradient half, as under 1F1B."""
    s, h, kv, f = 256, 256, 128, 688

    def layer0(schedule: str) -> dict[tuple[str, str], float]:
        """Micro-batch 0's layer-0 tensors on the first stage: bytes by name and the block that frees them."""
        workload = SymbolicGenerator().generate(make_point(pp=2, dp=4, pp_schedule=schedule))
        program = workload.programs[0]
        return {
            (t.name, workload.blocks[program.calls[t.consumer].block].name): t.bytes
            for t in program.tensors
            if t.name.startswith("layer0") and program.calls[t.producer].microbatch == 0
        }

    whole = layer0("1f1b")[("layer0", "layer.backward")]
    for_weight = 2 * s * (3 * h + f)
    assert layer0("zb_h1") == {
        ("layer0", "layer.backward"): whole - for_weight,
        ("layer0", "layer.backward.weight"): for_weight,
        ("layer0.wgrad_inputs", "layer.backward.weight"): 2 * s * (3 * h + 2 * kv + 2 * f),
    }
