"""A MoE written as users write it (tests/fx_zoo_moe.py: experts in an nn.ModuleList, routed by a `torch.where` loop
whose sizes depend on the data) captures under fixed-capacity routing (generators/fx/routing.py), its experts found
by structure (generators/fx/experts.py): at tp 1 as written, at tp 2 with sp and at ep 2 in the reference layout,
and through the generator at pp 2 and ZeRO-3. Experts 4, top_k 2, hidden 64, expert width 128, 2 x 64 tokens a
micro-batch: capacity = 128 x 2 / 4 = 64 slots an expert."""

import pytest

pytest.importorskip("torch")

import fx_zoo_moe
import torch
from helpers import make_point

from generators.fx.capture import capture_layer
from generators.fx.compare import figures
from generators.fx.experts import find_experts
from generators.fx.generator import FxGenerator
from generators.fx.routing import FixedCapacity, RoutingError
from generators.symbolic import SymbolicGenerator

EXPERTS, TOP_K, HIDDEN, WIDTH, BATCH, SEQ = 4, 2, 64, 128, 2, 64
TOKENS = BATCH * SEQ
CAPACITY = TOKENS * TOP_K // EXPERTS
ZOO = {
    "model.fx_factory": "fx_zoo_moe:factory",
    "model.hidden": HIDDEN,
    "model.heads": 4,
    "model.kv_heads": 2,
    "model.ffn": WIDTH,
    "model.moe.experts": EXPERTS,
    "model.moe.top_k": TOP_K,
    "model.moe.expert_ffn": WIDTH,
    "model.vocab": 512,
    "model.layers": 2,
}
SKEW = {"imbalance": 1.5, "source": "a skew for the test"}


def zoo_point(overrides=None, **parallel):
    return make_point(
        "tiny-moe", seq_len=SEQ, global_batch=8, micro_batch=BATCH, overrides=ZOO | (overrides or {}), **parallel
    )


def captured(**parallel):
    point = zoo_point(**parallel)
    p = point.parallel
    return capture_layer(fx_zoo_moe.factory, "zoo", point.model, point.workload, p.tp, p.dp, p.sp, ep=p.ep)


def expert_gemms(graph) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (input, weight) shapes of the forward's expert GEMMs: its mm on a capacity's rows, and its bmm."""
    out = []
    for node in graph.graph.nodes:
        if node.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
            a, b = (tuple(arg.meta["val"].shape) for arg in node.args)
            if node.target == torch.ops.aten.bmm.default or a[0] != TOKENS:
                out.append((a, b))
    return [g for g in out if g[1][-1] != EXPERTS]  # not the router


def flops(gemms) -> int:
    total = 0
    for a, b in gemms:
        total += 2 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)
    return total


@pytest.fixture(scope="module")
def generator() -> FxGenerator:
    return FxGenerator()


def test_the_moe_is_found_by_structure() -> None:
    with torch.device("meta"):
        block = fx_zoo_moe.factory(zoo_point().model, zoo_point().workload).layers[0]
    found = find_experts(block)
    assert (found.moe, found.experts, found.router) == ("moe", "moe.experts", "moe.gate")
    assert (found.count, found.hidden, found.width, found.gated, found.stacked) == (4, HIDDEN, WIDTH, True, False)


def test_at_tp1_the_users_loop_runs_every_expert_on_its_capacity(generator) -> None:
    """The user's own code: 4 experts x 3 matrices, each GEMM on CAPACITY rows (2 x 64 x 64 x 128 FLOPs), and
    every data-dependent index op a nonzero_static of that size; the model's parameters counted by hand."""
    layer = generator.layer(zoo_point()).captured
    attention = HIDDEN * HIDDEN * 2 + 2 * (2 * 16 * HIDDEN)  # wq, wo; wk, wv of 2 kv heads of 16
    block = 2 * HIDDEN + attention + HIDDEN * EXPERTS + EXPERTS * 3 * HIDDEN * WIDTH
    assert layer.parameters == 2 * block + 2 * 512 * HIDDEN + HIDDEN
    gemms = expert_gemms(layer.forward)
    assert len(gemms) == EXPERTS * 3
    assert flops(gemms) == EXPERTS * 3 * 2 * CAPACITY * HIDDEN * WIDTH
    sizes = {n.meta["val"].shape[0] for n in layer.forward.graph.nodes if "nonzero_static" in str(n.target)}
    assert sizes == {CAPACITY}


def test_at_tp2_with_sp_the_experts_width_is_split() -> None:
    """The reference layout: each rank holds every expert at half its width ([4, 64, 64] per matrix), runs them
    on the slots of both tp ranks' tokens (all-gathered), and the GEMM FLOPs are half of tp1's."""
    layer = captured(tp=2, sp=True, dp=2)
    gemms = expert_gemms(layer.forward)
    assert sorted(b for _, b in gemms) == [(EXPERTS, HIDDEN, WIDTH // 2)] * 2 + [(EXPERTS, WIDTH // 2, HIDDEN)]
    assert flops(gemms) == EXPERTS * 3 * 2 * CAPACITY * HIDDEN * WIDTH // 2
    kinds = {str(n.target).split(".")[1] for n in layer.forward.graph.nodes if "_c10d_functional" in str(n.target)}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= kinds


def test_at_ep2_each_rank_holds_half_the_experts_and_the_all_to_alls_are_symbolics() -> None:
    """ep 2 under a routing skew of 1.5: each rank holds 2 experts (2 x 3 x 64 x 128 weights), each padded to the
    busiest expert's load, 1.5 x 64 = 96 slots from each of the 2 ranks; the all-to-all bytes (and every other
    checked figure's parameters and GEMM FLOPs) are the symbolic generator's for the same point."""
    point = zoo_point({"workload.routing": SKEW}, dp=2, ep=2)
    skewed = FxGenerator()  # its capture would be reused for a point that differs only in the skew
    fx, symbolic = (figures(g.generate(point), point) for g in (skewed, SymbolicGenerator()))
    for a, b in zip(fx.classes, symbolic.classes, strict=True):
        assert a.comm_bytes["all_to_all"] == pytest.approx(b.comm_bytes["all_to_all"], rel=1e-9)
        assert a.comm_bytes["all_to_all"] > 0
        assert a.parameters == pytest.approx(b.parameters, rel=1e-9)
        assert a.gemm_flops == pytest.approx(b.gemm_flops, rel=1e-9)
    layer = skewed.layer(point).captured
    gemms = expert_gemms(layer.forward)
    assert sorted(b for _, b in gemms) == [(2, HIDDEN, WIDTH)] * 2 + [(2, WIDTH, HIDDEN)]
    assert {a for a, _ in gemms} == {(2, 2 * CAPACITY * 3 // 2, HIDDEN), (2, 2 * CAPACITY * 3 // 2, WIDTH)}


@pytest.mark.parametrize("parallel", [{"pp": 2}, {"dp": 2, "zero": 3}], ids=["pp2", "zero3"])
def test_the_generator_builds_its_steps(generator, parallel) -> None:
    """Through the generator at pp 2 and ZeRO-3 (one capture of the block serves both): the step's parameters and
    GEMM FLOPs are the symbolic generator's."""
    point = zoo_point(**parallel)
    fx, symbolic = (figures(g.generate(point), point) for g in (generator, SymbolicGenerator()))
    for a, b in zip(fx.classes, symbolic.classes, strict=True):
        assert a.parameters == pytest.approx(b.parameters, rel=1e-9)
        assert a.gemm_flops == pytest.approx(b.gemm_flops, rel=1e-9)


def test_a_mask_the_routing_cannot_size_is_named() -> None:
    mode = FixedCapacity()
    with mode:
        torch.topk(torch.empty(TOKENS, EXPERTS, device="meta"), TOP_K)
        assert mode.routing.rows(torch.empty(TOKENS, TOP_K, device="meta")) == CAPACITY
        assert mode.routing.rows(torch.empty(EXPERTS, device="meta")) == EXPERTS
        with pytest.raises(RoutingError, match=r"mask of shape \(3, 5\)"):
            torch.nonzero(torch.empty(3, 5, device="meta"))
