"""Activation memory, pipeline schedules and inference modes of the symbolic generator against closed forms."""

from collections import Counter

import pytest
from helpers import make_point

from dse import plugins
from dse.errors import InfeasibleError
from dse.modelstats import matmul_params, model_flops
from dse.point.evaluate import evaluate
from dse.point.feasibility import check_feasible
from dse.workload import OpKind, TensorKind, expand
from generators.symbolic import SymbolicGenerator
from generators.symbolic.schedule import interleaved

GEN = SymbolicGenerator()
COST = plugins.cost_model("analytical")
S, B, H, A = 256, 2, 256, 8  # tiny-gpt: sequence, micro-batch, hidden, heads (4h GeLU MLP, LayerNorm)
KORTHIKANTI = {"dropout": True, "flash_attention": False}


def layer_activation_bytes(t: int, sp: bool, recompute: str) -> float:
    overrides = {f"model.{k}": v for k, v in KORTHIKANTI.items()}
    point = make_point(
        "tiny-gpt", micro_batch=B, global_batch=16, tp=t, dp=8 // t, sp=sp, recompute=recompute, overrides=overrides
    )
    workload = GEN.generate(point)
    return next(x.bytes for x in workload.programs[0].tensors if x.name == "layer0")


@pytest.mark.parametrize(
    ("t", "sp", "recompute", "per_sbh"),
    [
        (1, False, "none", 34 + 5 * A * S / H),  # no parallelism: sbh(34 + 5as/h)
        (4, False, "none", 10 + 24 / 4 + 5 * A * S / (H * 4)),  # TP: sbh(10 + 24/t + 5as/(ht))
        (4, True, "none", 34 / 4 + 5 * A * S / (H * 4)),  # TP+SP: sbh(34/t + 5as/(ht))
        (4, False, "selective", 10 + 24 / 4),  # TP + selective: sbh(10 + 24/t)
        (4, True, "selective", 34 / 4),  # TP+SP + selective: 34 sbh / t
        (4, False, "full", 2),  # full recompute: 2 sbh (the layer input)
    ],
)
def test_activation_memory_per_layer_matches_korthikanti_table_2(t, sp, recompute, per_sbh):
    assert layer_activation_bytes(t, sp, recompute) == pytest.approx(per_sbh * S * B * H)


def test_fused_attention_keeps_no_s_squared_term():
    point = make_point("tiny-gpt", micro_batch=B, global_batch=16, tp=4, dp=2, sp=True)
    workload = GEN.generate(point)
    saved = next(x.bytes for x in workload.programs[0].tensors if x.name == "layer0")
    assert saved == pytest.approx(32 / 4 * S * B * H)  # 34/t without the two 1-byte dropout masks


def peak_activations(point) -> float:
    return evaluate(point, GEN, COST).result.classes[0].memory_at_peak["activation"]


@pytest.mark.parametrize(("pp", "chunks"), [(2, 2), (4, 2), (4, 4)])
def test_interleaved_first_stage_holds_1_plus_p_minus_1_over_p_m_times_more(pp, chunks):
    """Korthikanti et al. 2022 sec. 4.2.3: the interleaved schedule multiplies the first stage's activations by
    1 + (p-1)/(p m), m the model chunks per stage; it also shrinks the bubble."""
    system = {"base": "tiny-ring", "network": {0: {"npus": 2}, 1: {"npus": pp}}}
    common = dict(global_batch=8 * pp, overrides={"model.layers": 2 * pp * chunks}, pp=pp, dp=2)
    plain = make_point("tiny-llama", system, **common)
    inter = make_point("tiny-llama", system, pp_schedule="interleaved", virtual_stages=chunks, **common)
    assert peak_activations(inter) / peak_activations(plain) == pytest.approx(1 + (pp - 1) / (pp * chunks))
    step = [evaluate(x, GEN, COST).metrics["step_time_s"] for x in (plain, inter)]
    assert step[1] < step[0]


def test_interleaved_schedule_runs_every_chunk_forward_and_backward_once():
    steps = interleaved(4, 1, 8, 3)
    assert Counter(steps) == Counter({(s, mb, c): 1 for s in "FB" for mb in range(8) for c in range(3)})
    # micro-batches enter in groups of p, chunk by chunk
    assert [x for x in steps if x[0] == "F"][:8] == [("F", mb % 4, mb // 4) for mb in range(8)]


def test_interleaved_pipeline_sends_wrap_from_the_last_stage_to_the_first():
    system = {"base": "tiny-ring", "network": {0: {"npus": 2}, 1: {"npus": 2}}}
    point = make_point("tiny-llama", system, global_batch=8, pp=2, dp=2, pp_schedule="interleaved", virtual_stages=2)
    workload = GEN.generate(point)
    m = point.micro_batches
    sends = Counter()
    for program in workload.programs:
        for flat in expand(workload, program):
            if flat.op.kind is OpKind.SEND:
                sends[(program.rank_class, flat.op.peer)] += 1
    # 4 virtual stages, 3 links each way per micro-batch. Stage 0 sends forward from virtual stages 0 and 2 and
    # backward from 2 (to 1); stage 1 forward from 1 to 2 (the wrap to stage 0) and backward from 3 and 1.
    assert sends == Counter({(0, 1): 3 * m, (1, -1): 3 * m})


def test_pipeline_1f1b_sends_one_activation_per_micro_batch_with_ep_and_cp():
    point = make_point("tiny-moe", global_batch=8, pp=2, cp=2, dp=2, ep=2)
    workload = GEN.generate(point)
    sizes = Counter()
    for program in workload.programs:
        for flat in expand(workload, program):
            if flat.op.kind in (OpKind.SEND, OpKind.RECV):
                sizes[flat.op.comm_bytes] += 1
    assert sizes == Counter({1 * 256 * 256 * 2 / 2: 4 * point.micro_batches})  # b s h bytes / cp


@pytest.mark.parametrize(
    ("model", "rel"),
    [("tiny-llama", 0.01), ("tiny-moe", 0.01), ("mamba-2.8b", 0.01), ("tiny-hybrid", 0.03)],
)
def test_prefill_is_one_forward_writing_the_kv_cache(model, rel):
    """2 N T + attention: N counts the SSM's conv, A, D and dt-bias weights, which act elementwise; in a
    256-wide model they are 2% of the parameters, in Mamba-2.8B 0.3%."""
    train = make_point(model, global_batch=8, tp=2, dp=4)
    prefill = make_point(model, global_batch=8, tp=2, dp=4, overrides={"workload.mode": "prefill"})
    workload = GEN.generate(prefill)
    names = {b.name for b in workload.blocks}
    assert not any(n.endswith(("backward", "grad_sync")) or n == "optimizer" for n in names)
    kinds = {t.kind for t in workload.programs[0].tensors}
    assert TensorKind.GRADIENT not in kinds and TensorKind.OPTIMIZER_STATE not in kinds
    scan = ("other",) if prefill.model.ssm else ()  # the selective scan's 9 FLOPs per channel and state
    categories = ("gemm", "attention", *scan)
    flops = sum(f.op.flops for f in expand(workload, workload.programs[0]) if f.op.category in categories)
    expected = model_flops(prefill.model, prefill.workload) / 8
    assert flops == pytest.approx(expected, rel=rel)
    assert model_flops(prefill.model, prefill.workload) == pytest.approx(model_flops(train.model, train.workload) / 3)


def test_decode_reads_a_kv_cache_of_the_context_and_generates_one_token():
    point = make_point("tiny-llama", seq_len=1024, global_batch=8, tp=2, dp=4, overrides={"workload.mode": "decode"})
    m = point.model
    workload = GEN.generate(point)
    cache = sum(t.bytes for t in workload.programs[0].tensors if t.kind is TensorKind.KV_CACHE)
    # K and V of every layer, for the 2 sequences of one DP rank, kv heads split over tp=2
    assert cache == pytest.approx(2 * m.layers * 2 * 1024 * m.n_kv_heads / 2 * m.d_head * 2)
    flops = sum(f.op.flops for f in expand(workload, workload.programs[0]) if f.op.category in ("gemm", "attention"))
    per_token = 2 * matmul_params(m) + 4 * m.layers * m.heads * m.d_head * 1024
    assert flops * 8 == pytest.approx(per_token * 8, rel=0.01)
    result = evaluate(point, GEN, COST)
    assert result.metrics["step_time_s"] > 0


def test_generation_does_not_grow_with_the_data_parallel_degree():
    """Symmetry: one program per pipeline stage, whatever the DP degree; only the rank map grows."""

    def shape(dp: int):
        system = {"base": "dgx-h100", "network": {1: {"npus": dp}}}
        point = make_point("llama3-70b", system, seq_len=4096, global_batch=8 * dp, tp=8, pp=8, dp=dp, sp=True)
        workload = GEN.generate(point)
        return len(workload.programs), len(workload.blocks), [len(p.calls) for p in workload.programs]

    assert shape(16) == shape(512) == shape(4096)


@pytest.mark.parametrize(
    "parallel",
    [
        dict(pp=2, cp=2, dp=2, recompute="selective", pp_schedule="interleaved", virtual_stages=2),
        dict(tp=2, pp=2, dp=2, sp=True, recompute="full"),
        dict(pp=2, dp=4, zero=3, recompute="full", pp_schedule="gpipe"),
    ],
    ids=["cp-regathers", "sp-full-recompute", "zero3-gathers"],
)
def test_a_pipeline_steps_work_starts_once_what_it_receives_has_arrived(parallel):
    """Megatron runs a micro-batch's forward or backward only after its receive has completed, and autograd
    reaches a module only once its output's gradient exists: so a recompute, a K/V regather or the step's first
    weight gather never runs ahead of the activation or gradient the step receives (they did: each op without a
    data dependency on the received tensor started as soon as its stream was free)."""
    from simulators.analytical.engine import schedule

    point = make_point(global_batch=16, system={"base": "dgx-h100", "network": {1: {"npus": 1}}}, **parallel)
    workload = GEN.generate(point)
    receives = {b for b, block in enumerate(workload.blocks) if [op.kind for op in block.ops] == [OpKind.RECV]}
    checked = 0
    for program, sched in zip(workload.programs, schedule(workload, point.system), strict=True):
        received_at = {}
        for c, call in enumerate(program.calls):
            if call.block in receives:
                received_at[c] = sched.call_end[c]
                continue
            for i in call.inputs:
                if i in received_at:
                    assert sched.call_start[c] >= received_at[i] - 1e-15, (
                        program.name,
                        c,
                        workload.blocks[call.block].name,
                    )
                    checked += 1
    assert checked >= 8  # every micro-batch's forward and backward on the stages that receive


def test_uneven_pipeline_stages_run_and_hold_the_layers_they_are_given():
    """first_stage_layers and last_stage_layers (Megatron's decoder_first/last_pipeline_num_layers) lighten the
    stages that also hold the embedding and the output layer: each stage runs its layers for every micro-batch and
    holds their weights, the middle one twice the first's layer."""
    system = {"base": "tiny-ring", "network": {0: {"npus": 2}, 1: {"npus": 3}}}
    point = make_point("tiny-llama", system, global_batch=8, pp=3, dp=2, first_stage_layers=1, last_stage_layers=1)
    assert point.parallel.stage_layers(point.model.layers) == [1, 2, 1]
    workload = GEN.generate(point)
    forwards = [
        sum(workload.blocks[call.block].name == "layer.forward" for call in program.calls)
        for program in workload.programs
    ]
    assert forwards == [1 * point.micro_batches, 2 * point.micro_batches, 1 * point.micro_batches]
    parameters = [
        sum(t.bytes for t in program.tensors if t.kind is TensorKind.PARAMETER) for program in workload.programs
    ]
    m = point.model
    embedding = m.vocab * m.hidden * m.dtype_bytes
    assert parameters[1] == 2 * (parameters[0] - embedding)


LLAMA3_405B = dict(global_batch=2048, seq_len=8192, tp=8, pp=16, dp=64)
DGX_1024 = {"base": "dgx-h100", "network": {1: {"npus": 1024}}}


def test_llama3_405b_runs_126_layers_on_16_stages_as_llama_3_did():
    """Llama 3 (Dubey et al. 2024, sec. 3.3.2) removed one layer each from the first and the last of 16 stages."""
    with pytest.raises(InfeasibleError, match=r"parallel\.pp=16 does not divide model\.layers=126"):
        check_feasible(make_point("llama3-405b", DGX_1024, **LLAMA3_405B))
    point = make_point("llama3-405b", DGX_1024, first_stage_layers=7, last_stage_layers=7, **LLAMA3_405B)
    check_feasible(point)
    assert point.parallel.stage_layers(126) == [7] + [8] * 14 + [7]


def test_an_interleaved_stage_splits_uneven_layers_over_its_chunks_the_first_taking_more():
    """3 and 5 layers over two chunks each: stage 0 runs chunks of 2 and 1 layers, stage 1 of 3 and 2, in the
    virtual-stage order of the model (chunk 0 of every stage, then chunk 1)."""
    system = {"base": "tiny-ring", "network": {0: {"npus": 2}, 1: {"npus": 2}}}
    kw = dict(global_batch=16, pp=2, dp=2, pp_schedule="interleaved", virtual_stages=2, first_stage_layers=3)
    point = make_point("tiny-hybrid", system, **kw)
    check_feasible(point)
    workload = GEN.generate(point)
    forwards = [
        sum(
            workload.blocks[call.block].name.endswith("forward") and "layer" in workload.blocks[call.block].name
            for call in program.calls
        )
        for program in workload.programs
    ]
    assert forwards == [3 * point.micro_batches, 5 * point.micro_batches]
    held = [{t.name for t in program.tensors if t.name.startswith("layer")} for program in workload.programs]
    assert held == [{"layer0", "layer1", "layer5"}, {"layer2", "layer3", "layer4", "layer6", "layer7"}]
    uneven = dict(first_stage_layers=7, last_stage_layers=7, **LLAMA3_405B)
    llama = make_point("llama3-405b", DGX_1024, pp_schedule="interleaved", virtual_stages=2, **uneven)
    check_feasible(llama)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (dict(pp=1, dp=8, first_stage_layers=2), r"needs a pipeline \(parallel.pp >= 2\)"),
        (dict(pp=2, dp=4, first_stage_layers=1, last_stage_layers=1), "must equal model.layers=4 with parallel.pp=2"),
        (dict(pp=4, dp=2, first_stage_layers=2), "leaves 2 of model.layers=4 for the other 3 stage"),
        (
            dict(pp=2, dp=4, first_stage_layers=1, pp_schedule="interleaved", virtual_stages=2, global_batch=16),
            r"parallel.virtual_stages=2 needs as many layers on every stage, not \[1, 3\]",
        ),
    ],
)
def test_uneven_stages_that_cannot_hold_the_model_say_which_field_to_change(parallel, message):
    with pytest.raises(InfeasibleError, match=message):
        check_feasible(make_point("tiny-llama", **parallel))
