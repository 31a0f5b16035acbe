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
from generators.symbolic.schedule import Placement, chunk_order, interleaved
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


def timed_step(point: DesignPoint, seconds: dict[str, float], exact: bool = False) -> float:
    """Step time of the point when the layer blocks named in `seconds` take that long and every other block
    nothing (with `exact`, priced by the reference rules instead of the fast path)."""
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
    return AnalyticalCostModel(exact=exact).simulate(workload, system).step_time_s


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


def dualpipev_point(
    pp: int, microbatches: int, schedule: str = "dualpipev", overrides: dict | None = None, **parallel
) -> DesignPoint:
    """tiny-llama on pp ranks (times tp and dp), one layer per DualPipeV virtual stage (two per rank)."""
    ranks = pp * parallel.get("tp", 1) * parallel.get("dp", 1)
    system = {"base": "tiny-ring", "network": {0: {"npus": ranks}, 1: {"npus": 1}}}
    overrides = {"model.layers": 2 * pp} | (overrides or {})
    batch = microbatches * parallel.get("dp", 1)
    point = make_point(
        "tiny-llama", system, global_batch=batch, pp=pp, pp_schedule=schedule, overrides=overrides, **parallel
    )
    check_feasible(point)
    return point


def test_dualpipev_places_the_chunks_in_a_v():
    """Rank s holds virtual stages s and 2p-1-s: the first rank both ends (embedding and head), the last rank the
    middle two; interleaved placement is unchanged (virtual stage v on rank v % p)."""
    v = Placement(4, 2, True)
    assert [v.vstage(s, c) for c in (0, 1) for s in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert [v.holder(vstage) for vstage in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert [Placement(4, 2, False).holder(vstage)[0] for vstage in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    point = dualpipev_point(4, 8)
    workload = SymbolicGenerator().generate(point)
    for stage, program in enumerate(workload.programs):
        names = {workload.blocks[call.block].name for call in program.calls}
        assert ("embed.forward" in names, "head.forward" in names) == ((stage == 0,) * 2)
        layers = {call.layer for call in program.calls if workload.blocks[call.block].name == "layer.forward"}
        assert layers == {stage, 7 - stage}


@pytest.mark.parametrize("pp", [2, 4])
def test_dualpipev_forwards_go_through_the_virtual_stages_in_order(pp):
    """Each micro-batch's forward of layer v (virtual stage v) runs on the rank holding v and reads the output of
    layer v - 1: received from that rank (a send and a receive with one tag between the two), or on the last rank,
    from its own other chunk, without a transfer."""
    microbatches = 2 * pp + 1
    workload = SymbolicGenerator().generate(dualpipev_point(pp, microbatches))
    holder = Placement(pp, 2, True).holder
    programs = workload.programs
    name = {i: block.name for i, block in enumerate(workload.blocks)}
    forward = {
        (call.layer, call.microbatch): (stage, i)
        for stage, program in enumerate(programs)
        for i, call in enumerate(program.calls)
        if name[call.block] == "layer.forward"
    }
    sends = {
        call.tag: (stage, stage + workload.blocks[call.block].ops[0].peer, call.inputs)
        for stage, program in enumerate(programs)
        for call in program.calls
        if name[call.block].startswith("send")
    }
    for mb in range(microbatches):
        for vstage in range(1, 2 * pp):
            stage, i = forward[(vstage, mb)]
            assert stage == holder(vstage)[0]
            source_stage, source_call = forward[(vstage - 1, mb)]
            (read,) = programs[stage].calls[i].inputs
            if source_stage == stage:
                assert read == source_call and vstage == pp
                continue
            recv = programs[stage].calls[read]
            assert name[recv.block].startswith("recv")
            assert sends[recv.tag] == (source_stage, stage, (source_call,))


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (2, 7), (4, 8), (4, 11), (8, 16), (8, 32)])
@pytest.mark.parametrize(("tf", "tb", "tw"), [(1e-3, 1e-3, 1e-3), (1.5e-3, 1.2e-3, 0.9e-3)])
def test_dualpipev_leaves_half_the_zero_bubble_h1_bubble(pp, microbatches, tf, tb, tw):
    """DualPipeV with its forward-and-backward pairs run one after the other, T_F, T_B, T_W a chunk's (here one
    layer's) forward, input-gradient and weight-gradient times: with T_W <= T_B <= T_F every rank is busy for
    2m (T_F + T_B + T_W) and the step is longer by (p-1)(T_F + T_B - T_W), ZB-H1's bubble over chunks of half a
    stage, so half of ZB-H1's on the same ranks. The closed form was found with a standalone list scheduler of
    dualpipev.py's order (p = 2..8, m = 2p..6p), not derived step by step; it fails when T_B > T_F (next test)."""
    seconds = {"layer.forward": tf, "layer.backward": tb, "layer.backward.weight": tw}
    step = timed_step(dualpipev_point(pp, microbatches), seconds)
    assert step == pytest.approx(2 * microbatches * (tf + tb + tw) + (pp - 1) * (tf + tb - tw), rel=1e-12)
    zero_bubble = timed_step(dualpipev_point(pp, microbatches, "zb_h1"), seconds)
    assert zero_bubble - 2 * microbatches * (tf + tb + tw) == pytest.approx(2 * (pp - 1) * (tf + tb - tw), rel=1e-9)


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize(("tf", "tb", "tw"), [(1.2e-3, 1.5e-3, 0.9e-3), (1e-3, 2e-3, 1e-3)])
def test_dualpipev_with_longer_backwards_beats_1f1b_and_zero_bubble_h1(pp, tf, tb, tw):
    """With T_B > T_F the drain's backwards set the pace and the bubble has no clean closed form (it grows past
    (p-1)(T_F + T_B - T_W) from p = 4 or 8 on): the fast path equals the reference rules, and the step stays below
    ZB-H1's and 1F1B's on the same ranks."""
    point, microbatches = dualpipev_point(pp, 2 * pp + 3), 2 * pp + 3
    seconds = {"layer.forward": tf, "layer.backward": tb, "layer.backward.weight": tw}
    step = timed_step(point, seconds)
    assert step == pytest.approx(timed_step(point, seconds, exact=True), rel=1e-12)
    assert step >= 2 * microbatches * (tf + tb + tw) + (pp - 1) * (tf + tb - tw) - 1e-12
    assert step < timed_step(dualpipev_point(pp, microbatches, "zb_h1"), seconds)
    unsplit = {"layer.forward": tf, "layer.backward": tb + tw}
    assert step < timed_step(dualpipev_point(pp, microbatches, "1f1b"), unsplit)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize(
    "parallel",
    [{}, {"tp": 2, "sp": True}, {"overlap_p2p_comm": False}, {"zero": 1, "dp": 2}],
    ids=["plain", "tp2-sp", "blocking-p2p", "zero1-dp2"],
)
def test_dualpipev_runs_without_deadlock(pp, parallel):
    """A tiny model priced in full (transfers, head, optimizer): the step ends, the fast path matches the
    reference rules, and every rank runs each micro-batch's forward and backward of its two layers."""
    point = dualpipev_point(pp, 2 * pp + 1, **parallel)
    workload = SymbolicGenerator().generate(point)
    fast = AnalyticalCostModel().simulate(workload, point.system)
    exact = AnalyticalCostModel(exact=True).simulate(workload, point.system)
    assert 0 < fast.step_time_s == pytest.approx(exact.step_time_s, rel=1e-2)
    for program in workload.programs:
        runs = [(workload.blocks[c.block].name, c.microbatch) for c in program.calls]
        for kind in ("layer.forward", "layer.backward", "layer.backward.weight"):
            assert sorted(mb for name, mb in runs if name == kind) == sorted(list(range(2 * pp + 1)) * 2)


def test_dualpipev_ties_the_embedding_and_head_on_the_first_rank():
    """With tied embeddings both ends sit on rank 0, so they share one table (vocab x hidden bf16 fewer parameter
    bytes there) and no rank exchanges its gradient, as 1F1B's first and last ranks do."""
    tied = {"model.tied_embeddings": True}

    def parameters(point: DesignPoint) -> tuple[list[float], bool]:
        workload = SymbolicGenerator().generate(point)
        held = [next(t.bytes for t in program.tensors if t.name == "parameter") for program in workload.programs]
        return held, any(block.name == "tied_grad_sync" for block in workload.blocks)

    (first, second), exchanged = parameters(dualpipev_point(2, 4, overrides=tied))
    assert ([first + 1024 * 256 * 2, second], exchanged) == parameters(dualpipev_point(2, 4))
    assert parameters(dualpipev_point(2, 4, "1f1b", overrides=tied))[1]


@pytest.mark.parametrize(
    ("kwargs", "overrides", "message"),
    [
        (dict(pp=1, dp=4), {}, "needs parallel.pp >= 2"),
        (dict(pp=2, dp=2), {"model.layers": 6}, r"needs 2\*parallel.pp = 4 virtual stages to divide model.layers=6"),
        (dict(pp=4, dp=1), {"model.layers": 8}, r"needs at least 2\*parallel.pp = 8 micro-batches per step, not 4"),
        (dict(pp=2, dp=2), {"workload.mode": "prefill"}, "pp_schedule=dualpipev is a training schedule"),
        (dict(pp=2, dp=2, zero=3), {}, "pp_schedule=dualpipev with parallel.zero=3 is not modelled"),
        (dict(pp=2, dp=2, first_stage_layers=1), {}, "remove parallel.first_stage_layers"),
    ],
)
def test_dualpipev_refusals_name_the_field_and_the_fix(kwargs, overrides, message):
    system = {"base": "tiny-ring", "network": {0: {"npus": kwargs["pp"] * kwargs["dp"]}, 1: {"npus": 1}}}
    point = make_point("tiny-llama", system, global_batch=4, pp_schedule="dualpipev", overrides=overrides, **kwargs)
    with pytest.raises(InfeasibleError, match=message):
        check_feasible(point)


def test_one_stage_holding_every_interleaved_chunk_sends_to_itself():
    """pp = 1 with interleaved chunks: the stage passes each chunk's output to its next chunk through a send to
    itself, which the engine pairs with its own receive (only a V placement hands its middle chunks over without
    a transfer). The one-stage schedule runs, with one self-send per chunk boundary and micro-batch each way."""
    point = make_point("tiny-llama", dp=8, global_batch=16, pp_schedule="interleaved", virtual_stages=2)
    assert not Placement.of(point).handed(0, 1)
    workload = SymbolicGenerator().generate(point)
    sends = [c for c in workload.programs[0].calls if workload.blocks[c.block].ops[0].kind is OpKind.SEND]
    assert len(sends) == 2 * point.micro_batches
    assert AnalyticalCostModel().simulate(workload, point.system).step_time_s > 0
