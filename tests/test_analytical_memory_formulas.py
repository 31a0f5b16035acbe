"""Peak memory of generated workloads against the published formulas.

ZeRO (Rajbhandari et al. 2020): mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter; with data-parallel
degree N, per GPU stage 0 holds 16 Psi, stage 1 4 Psi + 12 Psi/N, stage 2 2 Psi + 14 Psi/N, stage 3 16 Psi/N.

Activations (Korthikanti et al. 2022, table 2; bytes per layer, 16-bit): no parallelism sbh(34 + 5as/h), TP
sbh(10 + 24/t + 5as/(ht)), TP+SP 34 sbh/t, full recompute 2 sbh. The generator uses fused (flash) attention and
no dropout, so the terms that apply are: no 5as/h terms (no s x s softmax or dropout outputs are kept; flash
keeps Q, K, V and the output O, which the formula already counts as the projections' inputs), and no dropout
masks (the formula's 2 sbh: one after attention, one after the MLP). What remains is 32 sbh, (8 + 24/t) sbh and
32 sbh/t. Selective recompute (Megatron: recompute the attention core) keeps Q, K, V but not O here, since the
recomputed flash forward yields it again: 30 sbh/t with SP. Full recompute keeps the layer input: 2 sbh.
With `dropout: true` and `flash_attention: false` the model is Korthikanti's own, and every term of table 2
applies exactly (the last test).
"""

import pytest

from generators.symbolic import SymbolicGenerator, count_parameters
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.engine import schedule
from tests.helpers import make_point

S, H = 256, 256
"""tiny-gpt: hidden 256, 8 heads, FFN 4h, LayerNorm, GeLU; sequence 256, micro-batch 1."""


def _simulate(**parallel):
    dp = parallel.pop("dp", 8 // parallel.get("tp", 1))
    point = make_point(model="tiny-gpt", seq_len=S, global_batch=dp, micro_batch=1, dp=dp, **parallel)
    workload = SymbolicGenerator().generate(point)
    return point, workload, AnalyticalCostModel().simulate(workload, point.system)


@pytest.mark.parametrize(
    ("zero", "formula"),
    [
        (0, lambda psi, n: 16 * psi),
        (1, lambda psi, n: 4 * psi + 12 * psi / n),
        (2, lambda psi, n: 2 * psi + 14 * psi / n),
        (3, lambda psi, n: 16 * psi / n),
    ],
)
def test_model_states_follow_the_zero_formulas(zero, formula):
    point, _, result = _simulate(dp=8, zero=zero)
    psi = count_parameters(point)
    held = result.classes[0].memory_at_peak
    states = held["parameter"] + held["gradient"] + held["optimizer_state"]
    assert states == pytest.approx(formula(psi, 8), rel=1e-9)


@pytest.mark.parametrize(
    ("parallel", "sbh_bytes"),
    [
        ({}, 32),
        ({"tp": 2}, 8 + 24 / 2),
        ({"tp": 4}, 8 + 24 / 4),
        ({"tp": 2, "sp": True}, 32 / 2),
        ({"tp": 4, "sp": True}, 32 / 4),
        ({"tp": 2, "sp": True, "recompute": "selective"}, 30 / 2),
        ({"tp": 2, "recompute": "full"}, 2),
    ],
)
def test_activations_per_layer_follow_korthikanti(parallel, sbh_bytes):
    _, workload, _ = _simulate(**parallel)
    (layer0,) = [t for t in workload.programs[0].tensors if t.name == "layer0"]
    assert layer0.bytes == pytest.approx(sbh_bytes * S * 1 * H, rel=1e-12)


def test_the_peak_holds_every_layer_of_a_single_micro_batch():
    """One micro-batch, one stage: backward starts with all four layers' activations live."""
    _, workload, result = _simulate(tp=2, sp=True)
    per_layer = 16 * S * H
    kept = [t.bytes for t in workload.programs[0].tensors if t.kind.value == "activation"]
    activation = result.classes[0].memory_at_peak["activation"]
    assert 4 * per_layer <= activation <= sum(kept)


A = 8
"""tiny-gpt's heads."""


@pytest.mark.parametrize(
    ("parallel", "sbh_bytes"),
    [
        ({}, 34 + 5 * A * S / H),
        ({"tp": 2}, 10 + 24 / 2 + 5 * A * S / (H * 2)),
        ({"tp": 4}, 10 + 24 / 4 + 5 * A * S / (H * 4)),
        ({"tp": 2, "sp": True}, 34 / 2 + 5 * A * S / (H * 2)),
        ({"tp": 4, "sp": True}, 34 / 4 + 5 * A * S / (H * 4)),
        ({"tp": 2, "recompute": "selective"}, 10 + 24 / 2),
        ({"tp": 2, "sp": True, "recompute": "selective"}, 34 / 2),
        ({"tp": 2, "recompute": "full"}, 2),
    ],
)
def test_with_dropout_and_unfused_attention_every_term_of_table_2_applies(parallel, sbh_bytes):
    """Korthikanti's setting exactly (dropout after attention and both residual branches, softmax kept)."""
    dp = 8 // parallel.get("tp", 1)
    model = {"base": "tiny-gpt", "dropout": True, "flash_attention": False}
    point = make_point(model=model, seq_len=S, global_batch=dp, micro_batch=1, dp=dp, **parallel)
    workload = SymbolicGenerator().generate(point)
    (layer0,) = [t for t in workload.programs[0].tensors if t.name == "layer0"]
    assert layer0.bytes == pytest.approx(sbh_bytes * S * H, rel=1e-12)


@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
def test_first_stage_holds_the_korthikanti_interleaving_factor(schedule, virtual):
    """On the simulated timeline, stage 0 of p=4 stages (16 layers, 8 micro-batches) peaks at L layers'
    activations under 1F1B, and (1 + (p-1)/(p v)) times that with v interleaved chunks (Korthikanti sec. 4.2.3)."""
    dgx = {"base": "dgx-h100", "network": {1: {"npus": 2}}}
    extra = {"virtual_stages": virtual} if schedule == "interleaved" else {}
    model = {"base": "tiny-llama", "layers": 16}
    point = make_point(model=model, pp=4, dp=4, global_batch=32, pp_schedule=schedule, system=dgx, **extra)
    workload = SymbolicGenerator().generate(point)
    result = AnalyticalCostModel().simulate(workload, point.system)
    (per_layer,) = {t.bytes for t in workload.programs[0].tensors if t.name.startswith("layer")}
    factor = 1 + (4 - 1) / (4 * virtual) if virtual > 1 else 1.0
    assert result.classes[0].memory_at_peak["activation"] == pytest.approx(factor * 16 * per_layer, rel=1e-12)


def _llama_layer(recompute: str):
    """tiny-llama (h 256, 8 heads of 32, 4 kv heads, SwiGLU width 688), one sequence of S tokens per rank."""
    point = make_point(model="tiny-llama", seq_len=S, global_batch=8, dp=8, recompute=recompute)
    workload = SymbolicGenerator().generate(point)
    (layer0,) = [t for t in workload.programs[0].tensors if t.name == "layer0"]
    (backward,) = [b for b in workload.blocks if b.name == "layer.backward"]
    return point.model, layer0.bytes, sum(op.flops for op in backward.ops if op.category == "gemm")


def test_per_op_selective_checkpointing_keeps_every_other_matmul_and_attention():
    """torchtitan's `op` policy saves the layer input and the outputs of wq, wv, attention, w1 and w2 (matmuls 1,
    3, 5, 7; 2, 4 and 6 are recomputed), and recomputes wk, wo and w3 in backward. Compiled (fused kernels), the
    backward keeps only what it reads: w2's output feeds only the residual add, whose gradient reads no values."""
    m, saved, backward_flops = _llama_layer("selective_op")
    _, _, plain_flops = _llama_layer("none")
    n_d, g_d = m.heads * m.d_head, m.n_kv_heads * m.d_head
    kept = m.hidden + n_d + g_d + n_d + m.ffn
    assert saved == pytest.approx(2 * S * kept, rel=1e-12)
    assert backward_flops - plain_flops == pytest.approx(2 * S * m.hidden * (g_d + n_d + m.ffn), rel=1e-12)


def test_zero3_prefetches_one_layer_ahead():
    """FSDP's prefetch: a module's weights are gathered once the module before it may start and freed when it
    ends, so at most two modules' gathered weights are live at once, forward and backward alike."""
    point = make_point(model={"base": "tiny-llama", "layers": 12}, seq_len=S, global_batch=8, dp=8, zero=3)
    workload = SymbolicGenerator().generate(point)
    (timeline,) = schedule(workload, point.system)
    weights = [t for t in workload.programs[0].tensors if t.name.endswith(".weights")]
    # every layer forward and backward, the head once (kept gathered from its forward to its backward), and the
    # embedding forward (its backward reads no weights)
    assert len(weights) == 2 * 12 + 1 + 1
    events = sorted(
        [(timeline.call_start[t.producer], 1) for t in weights] + [(timeline.call_end[t.consumer], -1) for t in weights]
    )
    live = [sum(step for _, step in events[: i + 1]) for i in range(len(events))]
    assert max(live) == 2


def test_recompute_every_second_layer_recomputes_half_the_layers():
    """Layer-level selective checkpointing (torchtitan's option '2', the FSDP blog's p = 1/2): layers 1 and 3 of
    four recompute (keeping Korthikanti's 2 sbh), layers 0 and 2 keep everything (32 sbh); only the recomputing
    layers' backward runs the forward again."""
    point = make_point(model="tiny-gpt", seq_len=S, global_batch=8, dp=8, recompute="full", recompute_every=2)
    workload = SymbolicGenerator().generate(point)
    saved = {t.name: t.bytes for t in workload.programs[0].tensors if t.name.startswith("layer")}
    sbh = {"layer0": 32, "layer1": 2, "layer2": 32, "layer3": 2}
    assert saved == pytest.approx({name: n * S * H for name, n in sbh.items()})
    blocks = workload.blocks
    flops = {blocks[c.block].name: sum(op.flops for op in blocks[c.block].ops) for c in workload.programs[0].calls}
    forward, plain, again = flops["layer.forward"], flops["layer.backward.unrecomputed"], flops["layer.backward"]
    assert again - plain == pytest.approx(forward, rel=1e-12)


def test_cross_entropy_keeps_fp32_log_probabilities():
    """The loss runs in fp32: the head keeps 4 bytes per logit for backward (and the final norm's input and
    output for the LM head's backward), not the bf16 logits."""
    point = make_point(model="tiny-gpt", seq_len=S, global_batch=8, dp=8)
    workload = SymbolicGenerator().generate(point)
    (head,) = [t for t in workload.programs[0].tensors if t.name == "head"]
    vocab = point.model.vocab
    assert head.bytes == pytest.approx(S * (4 * vocab + 2 * 2 * H), rel=1e-12)
