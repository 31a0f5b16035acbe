"""The fx generator's decode steps (issue 32): each block's forward over one new token per sequence, appending its
keys and values to a KV cache of seq_len tokens and attending over all of it, captured from the reference model's
own decoding code (gpt-fast's `forward(tokens, input_pos)`), priced as the symbolic generator's decode steps, and
the serving steps of an fx serving point built from them.

A capture costs about a second on this machine (a decode step takes four: its layer at contexts 1 and 2, its
embedding and its head), so the tests share one generator: the serving point's decode steps (tp 1) are captured
once and compared step by step; a tensor-parallel step, a MoE step and a Hugging Face step are captured beside."""

import pytest

pytest.importorskip("torch")

from helpers import make_point

from dse import plugins
from dse.point.evaluate import evaluate
from dse.point.points import build_point, expand
from dse.serving.iteration import pricer
from dse.serving.steps import step_point
from dse.spec import DesignPoint
from dse.workload import Block, Workload
from generators.fx.capture import CaptureError
from generators.fx.generator import FxGenerator

SERVING = {"isl": 64, "osl": 16, "concurrency": 4, "scheduler": {"max_batched_tokens": 64, "max_num_seqs": 64}}
"""The largest iteration is one 64-token prompt, so that its prefill step is the one the prompts' attention is
priced from too (the default budget of 8192 tokens would capture a prefill step of that length for nothing else)."""
DECODE_STEPS = ((1, 1), (1, 64), (1, 1024), (64, 1))
"""(batch, context) of the decode steps that point prices: the weights, the prompts' context, the KV probe, and the
64-token iteration's token-linear part (`dse.serving.iteration`)."""
COST_MODEL = plugins.cost_model("analytical")
DECODE = {"workload.mode": "decode"}
D_HEAD, KV_HEADS, LAYERS = 32, 4, 4
"""tiny-llama's head width, key/value heads and layers."""


@pytest.fixture(scope="module")
def generators() -> dict:
    return {"fx": plugins.generator("fx"), "symbolic": plugins.generator("symbolic")}


def serving_point() -> DesignPoint:
    raw = {"model": "tiny-llama", "workload": {"mode": "serve", "serving": SERVING}, "parallel": {"dp": 8}}
    return build_point(expand({**raw, "system": "tiny-ring"}), "serving point")


@pytest.fixture(scope="module")
def served(generators) -> dict:
    """The serving point evaluated with each generator, and the pricer that holds its priced steps."""
    point = serving_point()
    return {
        name: (evaluate(point, generator, COST_MODEL).metrics, pricer(point, generator, COST_MODEL))
        for name, generator in generators.items()
    }


def test_a_serving_point_runs_where_its_decode_steps_captures_are():
    """A study's executor groups points by the generator's affinity: a serving point's is its steps' (one
    micro-batch of the instance), so the points that share captures share a process."""
    point = serving_point()
    assert FxGenerator.affinity(point) == FxGenerator.affinity(step_point(point, "decode", 1, 1))


def test_a_serving_point_prices_its_iterations_from_fx_steps(served):
    """TPOT (its decode iterations) and TTFT (its prefill) within 10% of the symbolic generator's, from the same
    steps: decode at batch 1 and contexts 1, 64 and 1024, the 64-token iteration's token-linear part, a prefill."""
    (fx, fx_steps), (symbolic, symbolic_steps) = served["fx"], served["symbolic"]
    assert fx_steps.steps == symbolic_steps.steps == len(DECODE_STEPS) + 1  # and one prefill
    for metric in ("tpot_mean_s", "ttft_mean_s"):
        assert fx[metric] == pytest.approx(symbolic[metric], rel=0.10), metric


def test_its_decode_steps_agree_with_the_symbolic_generators(served):
    """Every decode step the serving point priced (scaled along the batch and the context from captures at batches
    1-3 and contexts 1-2): step time and attention time within 10%, the KV cache and the weights to the byte."""
    fx, symbolic = served["fx"][1], served["symbolic"][1]
    for key in DECODE_STEPS:
        ours, theirs = fx.step("decode", *key), symbolic.step("decode", *key)
        assert ours.time_s == pytest.approx(theirs.time_s, rel=0.10), key
        assert ours.attention_s == pytest.approx(theirs.attention_s, rel=0.10), key
        for kind in ("kv_cache", "parameter"):
            assert ours.memory(kind) == theirs.memory(kind) > 0, (key, kind)
    assert fx.step("decode", 1, 1024).memory("kv_cache") == LAYERS * 2 * 1024 * KV_HEADS * D_HEAD * 2


def attention_and_appends(workload: Workload) -> tuple:
    layer = next(b for b in workload.blocks if b.name == "layer.forward")
    (attention,) = [op for op in layer.ops if op.category == "attention"]
    return attention, [op for op in layer.ops if op.name.startswith("layer.forward.index_copy")]


def test_a_tensor_parallel_decode_step_splits_the_cache_with_the_heads(generators):
    """tp 2: each rank appends to and reads its 2 of the 4 key/value heads for its 4 query heads; the append moves
    the new token's keys (or values) and their position, not the cache; the step agrees with symbolic's."""
    batch, context = 2, 64
    p = make_point(seq_len=context, micro_batch=batch, global_batch=2 * batch, overrides=DECODE, tp=2, dp=2)
    workload = generators["fx"].generate(p)
    attention, appends = attention_and_appends(workload)
    assert attention.attention[:5] == (1, context, D_HEAD, False, False)
    assert attention.attention[5:] == (batch, 4, 2)
    new = batch * 2 * D_HEAD * 2  # one token of 2 heads per sequence, bf16
    assert [op.bytes for op in appends] == [8 + 2 * new] * 2
    ours, theirs = (COST_MODEL.simulate(w, p.system) for w in (workload, generators["symbolic"].generate(p)))
    assert ours.step_time_s == pytest.approx(theirs.step_time_s, rel=0.10)
    for kind in ("kv_cache", "parameter"):
        assert ours.classes[0].memory_at_peak[kind] == theirs.classes[0].memory_at_peak[kind]
    assert ours.classes[0].memory_at_peak["kv_cache"] == LAYERS * 2 * batch * context * 2 * D_HEAD * 2


def test_hugging_faces_static_cache_is_captured_as_the_steps_cache(generators):
    """LlamaForCausalLM decoding through its StaticCache (allocated before the capture with the rank's heads, so
    that the block appends to it in place) at tp 2: one query attending over the cache, the two appends (and the
    cache's position counter) as three small kernels, the rank's share of the cache as the step's state."""
    pytest.importorskip("transformers")
    batch, context = 1, 2
    p = make_point(seq_len=context, micro_batch=batch, global_batch=batch, overrides=DECODE, tp=2)
    hf = p.model_copy(update={"model": p.model.model_copy(update={"fx_factory": "hf"})})
    layer = generators["fx"].layer(hf).forward
    (attention,) = [op for op in layer.block.ops if op.category == "attention"]
    assert attention.attention == (1, context, D_HEAD, False, False, batch, 4, 2)
    new = batch * 2 * D_HEAD * 2  # one token of 2 heads per sequence, bf16
    assert sorted(op.bytes for op in layer.block.ops if op.category == "other") == [0, 8 + 2 * new, 8 + 2 * new]
    assert layer.state_bytes == 2 * batch * context * 2 * D_HEAD * 2  # k and v of 2 heads


def test_a_model_without_a_decoding_call_is_refused_in_one_line():
    """tests/fx_tiny_llama.py's model takes tokens alone: no capture is attempted."""
    p = make_point(seq_len=64, overrides={**DECODE, "model.fx_factory": "fx_tiny_llama:llama"})
    with pytest.raises(CaptureError, match=r"does not take a decoding step's \(tokens, input_pos\)") as caught:
        FxGenerator().generate(p)
    assert "\n" not in str(caught.value)


def test_a_mixture_of_experts_decode_step_routes_the_balanced_share(generators):
    """tiny-moe (8 experts, top-2) at 16 sequences: scaled from captures at 4 and 8 sequences, where the experts'
    capacity ceil(tokens x 2 / 8) is exact, so the experts' GEMMs are the symbolic generator's balanced share to the
    FLOP (from captures at 2 and 3 it would stay at one slot each); attention, the KV cache and the weights as
    symbolic's. The step is 11% shorter: the captured routing's gathers fuse into its neighbouring kernels (18
    kernels a layer) where symbolic runs a dispatch and a combine kernel of their own (21), at tiny-ring's 4 us a
    launch."""
    p = make_point("tiny-moe", seq_len=64, micro_batch=16, global_batch=32, overrides=DECODE, tp=1, dp=2)
    ours, theirs = generators["fx"].generate(p), generators["symbolic"].generate(p)

    def moe_layer(workload: Workload) -> Block:
        return next(b for b in workload.blocks if b.name == "layer.attn.moe.forward")

    gemm_flops = [sum(op.flops for op in moe_layer(w).ops if op.category == "gemm") for w in (ours, theirs)]
    assert gemm_flops[0] == pytest.approx(gemm_flops[1], rel=1e-9)
    fx, symbolic = (COST_MODEL.simulate(w, p.system) for w in (ours, theirs))
    assert fx.classes[0].time_by_category["attention"] == pytest.approx(
        symbolic.classes[0].time_by_category["attention"]
    )
    for kind in ("kv_cache", "parameter"):
        assert fx.classes[0].memory_at_peak[kind] == symbolic.classes[0].memory_at_peak[kind]
    fewer = len(moe_layer(theirs).ops) - len(moe_layer(ours).ops)
    assert fewer == 3
    launches = LAYERS * fewer * p.system.accelerator.kernel_launch_us * 1e-6
    assert fx.step_time_s + launches == pytest.approx(symbolic.step_time_s, rel=0.02)
