"""Whole training steps of models written from scratch in plain torch.nn (tests/fx_zoo_dense.py: a GPT-2 with a
fused QKV, GeLU MLP, learned positions and a tied head; a parallel block with multi-query attention and one shared
norm) through the fx generator, at tp 1, tp 2 with sp, pp 2 and ZeRO 3 (the MoE's are tests/test_fx_moe_routing.py):
the parameters are the module's exactly, the step's GEMM FLOPs over all ranks are the hand formula (6 x tokens x
matmul weights: forward, input and weight gradients; a replicated key/value head's on each tp rank), and the fx
workload agrees with the symbolic generator's (parameters on a rank, GEMM FLOPs, every collective's bytes exact;
peak memory within the compare's bound)."""

import pytest

pytest.importorskip("torch")

from helpers import make_point

from dse.modelstats import param_count
from generators.fx.compare import compare, figures
from generators.fx.generator import FxGenerator
from generators.symbolic import SymbolicGenerator

SEQ, BATCH = 128, 8
TOKENS = SEQ * BATCH
H, V, LAYERS = 256, 1024, 4  # tiny-gpt's and tiny-llama's
GPT2 = {
    "factory": "fx_zoo_dense:gpt2",
    "model": "tiny-gpt",
    "overrides": {},
    # token and position tables, per layer: two LayerNorms (weight, bias), c_attn 3h x h + 3h, c_proj, c_fc 4h x h
    # + 4h, c_proj back; the final LayerNorm; the head is the token table (tied)
    "parameters": V * H
    + 1024 * H
    + LAYERS * (2 * 2 * H + 3 * H * H + 3 * H + H * H + H + 2 * 1024 * H + 1024 + H)
    + 2 * H,
    "matmul": LAYERS * (4 * H * H + 2 * H * 1024) + V * H,
    "replicated": 0,
}
MQA = {
    "factory": "fx_zoo_dense:parallel_mqa",
    "model": "tiny-llama",
    "overrides": {"model.kv_heads": 1, "model.parallel_block": "shared_norm"},
    # the token table, per layer one RMSNorm, q (8 heads of 32) and one key and one value head, o, a SwiGLU of 688;
    # the final RMSNorm and the untied head
    "parameters": V * H + LAYERS * (H + H * H + 2 * H * 32 + H * H + 3 * H * 688) + H + V * H,
    "matmul": LAYERS * (H * H + 2 * H * 32 + H * H + 3 * H * 688) + V * H,
    # the one key and value head is replicated on every tp rank (Megatron's layout), its projections run on each
    "replicated": LAYERS * 2 * H * 32,
}
LAYOUTS = {"tp1": {}, "tp2-sp": {"tp": 2, "sp": True}, "pp2": {"pp": 2}, "zero3": {"dp": 2, "zero": 3}}


@pytest.fixture(scope="module")
def generators() -> tuple[FxGenerator, SymbolicGenerator]:
    """One of each for the module: the pp 2 and ZeRO 3 points reuse the tp 1 captures (a capture depends on tp,
    sp and the micro-batch, not on pp or ZeRO)."""
    return FxGenerator(), SymbolicGenerator()


@pytest.mark.parametrize("model", [GPT2, MQA], ids=["gpt2", "parallel-mqa"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_scratch_models_step_is_its_modules(generators, model, layout) -> None:
    fx, symbolic = generators
    dp = layout.get("dp", 1)
    point = make_point(
        model=model["model"],
        seq_len=SEQ,
        global_batch=BATCH,
        overrides={"model.fx_factory": model["factory"], **model["overrides"]},
        **{"dp": dp, **layout},
    )
    assert param_count(point.model) == model["parameters"]
    ours, theirs = figures(fx.generate(point), point), figures(symbolic.generate(point), point)
    copies = layout.get("tp", 1) - 1
    assert sum(c.gemm_flops * c.ranks for c in ours.classes) == 6 * TOKENS * (
        model["matmul"] + copies * model["replicated"]
    )
    if layout == {}:
        assert [c.parameters for c in ours.classes] == [model["parameters"]]
    rows = [r for r in compare(ours, theirs) if r.figure != "step time s"]  # at these sizes launches decide it
    exact = [r for r in rows if r.figure in ("parameters on a rank", "GEMM FLOPs") or r.figure.endswith(" bytes")]
    assert all(r.a == pytest.approx(r.b, rel=1e-9) for r in exact if r.figure != "peak memory bytes"), exact
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
