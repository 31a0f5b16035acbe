"""Tensor-parallel plans derived from a model's structure (generators/fx/plans.py), on models whose module names no
plan is keyed by (tests/fx_zoo_dense.py): a GPT-2 (fused QKV with bias, GeLU MLP, learned positions, tied head) and a
parallel block with multi-query attention (one norm feeding a fused QKV of 8 + 2 x 1 heads and a SwiGLU MLP, their
outputs summed before the residual). Each layer is captured at tp 2 with and without sp, and its parameters per rank,
GEMM FLOPs and collectives checked against the hand formulas; and a user's plan over the derived one."""

import pytest

pytest.importorskip("torch")

import fx_zoo_dense
import torch
from helpers import make_point

from dse.errors import SpecError
from dse.workload import Collective, OpKind
from generators.fx import plans
from generators.fx.capture import CapturedLayer, capture_layer
from generators.fx.ends import EPILOGUE, PROLOGUE, capture_end
from generators.fx.factories import resolve
from generators.fx.lower import lower_backward, lower_forward

SEQ, TP = 128, 2
H, FFN = 256, 1024  # tiny-gpt's
HEADS, D = 8, 32
LLAMA_FFN = 688  # tiny-llama's
ACTIVATION = SEQ * H * 2
"""Bytes of the micro-batch's b x s x h bf16 activation."""
GPT2 = ("fx_zoo_dense:gpt2", "tiny-gpt", {})
MQA = ("fx_zoo_dense:parallel_mqa", "tiny-llama", {"model.kv_heads": 1, "model.parallel_block": "shared_norm"})


def point(case: tuple, sp: bool, plan: dict | None = None):
    factory, model, overrides = case
    overrides = {"model.fx_factory": factory, **overrides} | ({"model.fx_plan": plan} if plan else {})
    return make_point(model=model, seq_len=SEQ, overrides=overrides, tp=TP, dp=1, sp=sp)


def captured(case: tuple, sp: bool, plan: dict | None = None) -> CapturedLayer:
    p = point(case, sp, plan)
    name = p.model.fx_factory
    return capture_layer(resolve(name), name, p.model, p.workload, TP, 1, sp)


def figures(layer: CapturedLayer) -> dict[str, object]:
    """Per rank: the parameter elements the forward reads (its inputs but the block's input and the per-position
    table), GEMM FLOPs forward and backward, the collectives by kind each way, all of one size."""
    placeholders = [n.meta["val"] for n in layer.forward.graph.nodes if n.op == "placeholder"]
    placeholders = [t for t in placeholders if isinstance(t, torch.Tensor)]  # not the process group
    inputs = [t for t in placeholders if tuple(t.shape) == layer.input_shape or tuple(t.shape) == (SEQ, D)]
    out: dict[str, object] = {"parameters": sum(t.numel() for t in placeholders) - sum(t.numel() for t in inputs)}
    forward = lower_forward(layer.forward, "f", layer.axes, layer.input_shape, True).block
    backward = lower_backward(layer.backward, layer.forward, "b", layer.axes, layer.input_shape, True).block
    for way, block in (("forward", forward), ("backward", backward)):
        collectives = [op for op in block.ops if op.kind is OpKind.COLLECTIVE]
        out[f"{way} gemm"] = sum(op.flops for op in block.ops if op.category == "gemm")
        out[f"{way} collectives"] = {kind: sum(op.category == kind for op in collectives) for kind in Collective}
        out[f"{way} sizes"] = {op.comm_bytes for op in collectives}
        assert {op.axis for op in collectives} <= {"tp"}
    return out


def counts(**kinds: int) -> dict[Collective, int]:
    return {kind: kinds.get(kind.name.lower(), 0) for kind in Collective}


@pytest.fixture(scope="module")
def gpt2() -> dict[bool, dict[str, object]]:
    return {sp: figures(captured(GPT2, sp)) for sp in (False, True)}


@pytest.fixture(scope="module")
def mqa() -> dict[bool, dict[str, object]]:
    return {sp: figures(captured(MQA, sp)) for sp in (False, True)}


def test_gpt2_splits_its_fused_qkv_and_gelu_mlp_as_megatron_does(gpt2):
    """c_attn and c_fc column-parallel (weights and biases halved), c_proj's row-parallel (weights halved, biases
    whole), the LayerNorms whole; per layer 2 all-reduces each way, or with sp 2 all-gathers and 2 reduce-scatters
    forward and in backward the inputs gathered again for the weight gradients; GEMMs 2 x tokens x in x out per
    Linear over tp, the backward's twice the forward's."""
    split = 3 * H * H + 3 * H + H * H + H * FFN + FFN + FFN * H
    whole = 2 * H + 4 * H  # the row-parallel biases, two LayerNorms' weights and biases
    gemm = 2 * SEQ * (H * 3 * H + H * H + 2 * H * FFN) // TP
    for fig in gpt2.values():
        assert fig["parameters"] == split // TP + whole
        assert fig["forward gemm"] == gemm and fig["backward gemm"] == 2 * gemm
        assert fig["forward sizes"] == fig["backward sizes"] == {ACTIVATION}
    assert gpt2[False]["forward collectives"] == gpt2[False]["backward collectives"] == counts(all_reduce=2)
    assert gpt2[True]["forward collectives"] == counts(all_gather=2, reduce_scatter=2)
    assert gpt2[True]["backward collectives"] == counts(all_gather=4, reduce_scatter=2)


def test_a_parallel_block_with_one_kv_head_reduces_its_branches_sum_once(mqa):
    """The fused QKV gives each rank 4 query heads and the one key and value head (replicated), the norm's output
    is gathered once for both branches and their partial sums meet before one reduction (GPT-NeoX's and PaLM's
    parallel block): half the collectives of a sequential block."""
    qkv = (HEADS // TP + 2) * D * H
    split = HEADS * D * H + 3 * H * LLAMA_FFN
    gemm = 2 * SEQ * (qkv + split // TP)
    for fig in mqa.values():
        assert fig["parameters"] == qkv + split // TP + H
        assert fig["forward gemm"] == gemm and fig["backward gemm"] == 2 * gemm
        assert fig["forward sizes"] == fig["backward sizes"] == {ACTIVATION}
    assert mqa[False]["forward collectives"] == mqa[False]["backward collectives"] == counts(all_reduce=1)
    assert mqa[True]["forward collectives"] == counts(all_gather=1, reduce_scatter=1)
    assert mqa[True]["backward collectives"] == counts(all_gather=2, reduce_scatter=1)


def test_learned_positions_meet_a_sequence_parallel_embedding():
    """GPT-2's ends at tp 2 with sp: the token embedding vocab-parallel and reduce-scattered over the sequence, the
    position embedding's output cut to the rank's sequence shard (locally: no collective), the tied head
    column-parallel over the vocabulary (its GEMM 2 x tokens x h x vocab / tp)."""
    p = point(GPT2, True)
    name = p.model.fx_factory
    prologue = capture_end(PROLOGUE, resolve(name), name, p.model, p.workload, TP, 1, True)
    epilogue = capture_end(EPILOGUE, resolve(name), name, p.model, p.workload, TP, 1, True)
    assert prologue.input_shape == (1, SEQ) and epilogue.input_shape == (1, SEQ // TP, H)
    forward = lower_forward(prologue.forward, "p", prologue.axes, prologue.input_shape, True).block
    backward = lower_backward(prologue.backward, prologue.forward, "p", prologue.axes, (1, SEQ), True).block
    assert [op.category for op in forward.ops if op.kind is OpKind.COLLECTIVE] == [Collective.REDUCE_SCATTER]
    # backward: the token embedding's output gradient gathered (its reduce-scatter's); the positions' cut is local
    gathered = [(op.category, op.comm_bytes) for op in backward.ops if op.kind is OpKind.COLLECTIVE]
    assert gathered == [(Collective.ALL_GATHER, ACTIVATION)]
    head = lower_forward(epilogue.forward, "e", epilogue.axes, epilogue.input_shape, True).block
    assert sum(op.flops for op in head.ops if op.category == "gemm") == 2 * SEQ * H * 1024 // TP


def test_a_users_plan_replaces_the_derived_style_of_the_modules_it_names():
    """The MLP left unsharded by the point's model.fx_plan: one all-reduce a layer (the attention's), the MLP's GEMMs
    whole."""
    plan = {"layers.*.mlp.c_fc": "replicate", "*.mlp.c_proj": "replicate"}
    fig = figures(captured(GPT2, False, plan))
    assert fig["forward collectives"] == counts(all_reduce=1)
    assert fig["forward gemm"] == 2 * SEQ * ((H * 3 * H + H * H) // TP + 2 * H * FFN)


def test_a_user_plan_naming_no_module_is_refused_in_one_line():
    with pytest.raises(SpecError, match=r"^model.fx_plan: 'layers\.\*\.attn\.qkv' names no module of GPT2 \(its"):
        captured(GPT2, False, {"layers.*.attn.qkv": "colwise"})


def test_a_typo_in_a_style_names_the_field_and_the_styles():
    with pytest.raises(SpecError, match=r"field 'model\.fx_plan\.\*': Input should be 'colwise', 'rowwise'"):
        point(GPT2, False, {"*": "colwse"})


def test_the_factory_modules_plan_is_amended_by_the_points(monkeypatch):
    monkeypatch.setattr(fx_zoo_dense, "TP_PLAN", {"*.c_fc": "replicate", "*.mlp.c_proj": "replicate"}, raising=False)
    spec = point(GPT2, False, {"*.c_fc": "colwise"}).model
    assert plans.user_plan(spec, fx_zoo_dense.gpt2) == {"*.c_fc": "colwise", "*.mlp.c_proj": "replicate"}
    monkeypatch.setattr(fx_zoo_dense, "TP_PLAN", {"*.c_fc": "colwse"})
    with pytest.raises(SpecError, match=r"^fx_zoo_dense.TP_PLAN: .* each one of colwise, rowwise, sequence_parallel"):
        plans.user_plan(spec, fx_zoo_dense.gpt2)
