"""The fx generator on the dense LLaMA points it used to refuse, each against the symbolic generator with issue 22's
tolerances (generators/fx/compare.py): tensor parallelism beyond the key/value heads (replicated heads), selective
recompute (Megatron's core attention, torchtitan's per-op policy), and the embedding and the head captured from the
model's own code rather than synthesised."""

from collections import Counter

import pytest

pytest.importorskip("torch")

from helpers import make_point

from dse.spec import DesignPoint
from dse.workload import Block, OpKind, Workload
from generators.fx.compare import Row, compare, figures
from generators.fx.ends import EPILOGUE, PROLOGUE
from generators.fx.generator import PLAIN_LAYER, FxGenerator
from generators.symbolic import SymbolicGenerator
from generators.symbolic.generator import _Builder

SEQ = 256


@pytest.fixture(scope="module")
def generator() -> FxGenerator:
    return FxGenerator()


def block(workload: Workload, name: str) -> Block:
    return next(b for b in workload.blocks if b.name == name)


def gemm_shapes(b: Block) -> Counter:
    """The GEMMs of a block by their batch and their sizes m, n, k in order (a weight gradient's m and n are the
    two generators' transposes of each other)."""
    return Counter((op.gemm[0], *sorted(op.gemm[1:])) for op in b.ops if op.gemm is not None)


def agreement(generator: FxGenerator, point: DesignPoint) -> tuple[dict[str, Row], Workload, Workload]:
    """The compare harness's rows for the point's one rank class and the step (by figure), and the fx and symbolic
    workloads; every figure within its bound but the step time, which at these sizes kernel launches decide (the
    two generators draw kernel boundaries differently): benchmarks/fx_agreement.py checks it at real sizes."""
    ours, theirs = generator.generate(point), SymbolicGenerator().generate(point)
    rows = {r.figure: r for r in compare(figures(ours, point), figures(theirs, point))}
    off = [r for r in rows.values() if not r.ok and r.figure != "step time s"]
    assert not off, off
    return rows, ours, theirs


@pytest.mark.parametrize(
    ("model", "parallel", "seq_len"),
    [
        ("tiny-llama", {"tp": 8}, SEQ),  # 4 kv heads, each on 2 ranks
        ("tiny-llama", {"tp": 8, "dp": 2, "sp": True}, SEQ),
        ("llama3-8b", {"tp": 16, "sp": True}, 1024),  # 8 kv heads, each on 2 ranks
    ],
)
def test_tp_beyond_the_kv_heads_replicates_them(generator, model, parallel, seq_len):
    """Each rank holds one key/value head (its wk and wv GEMMs h -> d_head, the symbolic generator's GEMMs shape
    for shape); the replicas' weight gradients are the ranks' own, no collective beyond the tp plan's, so the
    bytes per collective kind are the symbolic ones exactly; parameters per rank exact, peak memory within 5 %."""
    point = make_point(model, system="dgx-h100", seq_len=seq_len, **parallel)
    m = point.model
    assert parallel["tp"] > m.n_kv_heads
    rows, ours, theirs = agreement(generator, point)
    for name in ("layer.forward", "layer.backward"):
        assert gemm_shapes(block(ours, name)) == gemm_shapes(block(theirs, name))
    # forward GEMMs h -> d_head: wk and wv (and wq when a rank has one query head)
    forward = Counter(op.gemm[2:] for op in block(ours, "layer.forward").ops if op.gemm is not None)
    assert forward[(m.d_head, m.hidden)] == 2 + (m.heads // parallel["tp"] == 1)
    assert rows["GEMM FLOPs"].difference == pytest.approx(0, abs=1e-12)
    comm = [r for r in rows.values() if r.figure.endswith(" bytes") and r.figure != "peak memory bytes"]
    assert comm and all(r.a == r.b for r in comm if r.figure != "all_reduce bytes")


def symbolic_saved_bytes(point: DesignPoint) -> float:
    """The activations a symbolic layer keeps from its forward for its backward."""
    builder = _Builder(point)
    builder.build()
    (traced,) = builder.layer_traces.values()
    return traced.saved_bytes


def flops(b: Block, category: str) -> float:
    return sum(op.flops for op in b.ops if op.category == category)


RECOMPUTED = [{"tp": 2, "dp": 2, "sp": True}, {"tp": 2, "dp": 2}, {"tp": 1, "dp": 2}]


@pytest.mark.parametrize("parallel", RECOMPUTED)
@pytest.mark.parametrize("recompute", ["selective", "selective_op"])
def test_selective_recompute_agrees_with_symbolic(generator, parallel, recompute):
    """The backward's GEMMs (with those it runs again: selective_op recomputes wk and w3, whose outputs it drops and
    backward reads, and wo for the residual the second norm's backward reads) and its attention (selective runs it
    again) are the symbolic ones exactly, as are the collectives (selective_op regathers, and without SP all-reduces
    wo's output again); peak memory within 5 %."""
    point = make_point(seq_len=SEQ, recompute=recompute, **parallel)
    _, ours, theirs = agreement(generator, point)
    for name in ("layer.forward", "layer.backward"):
        for category in ("gemm", "attention"):
            assert flops(block(ours, name), category) == pytest.approx(flops(block(theirs, name), category), rel=1e-12)
    plain = generator.generate(make_point(seq_len=SEQ, **parallel))
    attention_again = recompute == "selective"
    forward_attention = flops(block(ours, "layer.forward"), "attention")
    extra = flops(block(ours, "layer.backward"), "attention") - flops(block(plain, "layer.backward"), "attention")
    assert extra == (forward_attention if attention_again else 0.0)
    assert (flops(block(ours, "layer.backward"), "gemm") > flops(block(plain, "layer.backward"), "gemm")) == (
        recompute == "selective_op"
    )


def test_recompute_every_second_layer_runs_the_others_plain(generator):
    """recompute_every 2: every second layer's backward is the capture without recompute (no attention run again),
    the others the selective one; the step agrees with symbolic."""
    point = make_point(seq_len=SEQ, tp=2, dp=2, sp=True, recompute="selective", recompute_every=2)
    _, ours, _ = agreement(generator, point)
    plain = block(ours, "layer.backward.unrecomputed")
    recomputed = block(ours, "layer.backward")
    assert flops(recomputed, "attention") == 1.5 * flops(plain, "attention")
    assert generator._piece(point, PLAIN_LAYER).forward.saved_bytes > generator.layer(point).forward.saved_bytes


def test_selective_recompute_keeps_what_symbolic_keeps(generator):
    """Saved activations. selective keeps no attention output: the plain layer keeps it once in both generators
    (fx forms the copy laid out for the output projection again in backward, as a flash kernel's output needs no
    copy), and each drops it (fx up to the RoPE table's slice for the sequence, s x d_head / 2 complex64, which the
    partitioner keeps under checkpointing in some layouts rather than slice it again).
    selective_op keeps the symbolic layer's bytes exactly with SP and
    without tp; without SP torch's partitioner also keeps the last matmul's output (torchtitan's policy says save
    it), which backward never reads: one b s h tensor more than symbolic, as a real torchtitan run under
    torch.compile holds it."""
    sp, no_sp, one = RECOMPUTED
    for parallel in RECOMPUTED:
        base, selective = (make_point(seq_len=SEQ, recompute=r, **parallel) for r in ("none", "selective"))
        context = SEQ * base.model.hidden * 2 / parallel["tp"]
        dropped = generator.layer(base).forward.saved_bytes - generator.layer(selective).forward.saved_bytes
        rope_slice = SEQ * base.model.d_head / 2 * 8
        assert context - rope_slice <= dropped <= context
        assert symbolic_saved_bytes(base) - symbolic_saved_bytes(selective) == context
    for parallel in (sp, one):
        per_op = make_point(seq_len=SEQ, recompute="selective_op", **parallel)
        assert generator.layer(per_op).forward.saved_bytes == symbolic_saved_bytes(per_op)
    per_op = make_point(seq_len=SEQ, recompute="selective_op", **no_sp)
    last_matmul = SEQ * per_op.model.hidden * 2
    assert generator.layer(per_op).forward.saved_bytes == symbolic_saved_bytes(per_op) + last_matmul


def comm(b: Block) -> dict[str, float]:
    """Bytes per collective kind of a block."""
    out: dict[str, float] = {}
    for op in b.ops:
        if op.kind is OpKind.COLLECTIVE:
            out[op.category] = out.get(op.category, 0.0) + op.comm_bytes
    return out


@pytest.mark.parametrize(
    ("model", "parallel", "seq_len"),
    [
        ("tiny-llama", {"dp": 2}, SEQ),
        ("tiny-llama", {"tp": 2, "dp": 2, "sp": True}, SEQ),
        ("llama3-8b", {"dp": 2}, 1024),
        ("llama3-8b", {"tp": 2, "dp": 2, "sp": True}, 1024),
    ],
)
def test_embedding_and_head_are_captured(generator, model, parallel, seq_len):
    """The embedding and the head are the model's own code, captured: the vocabulary-parallel lookup with its
    reduce-scatter (SP) and in backward its all-gather; the final norm, the gather of its output, the output
    projection (its GEMMs the symbolic ones exactly, forward and backward) and the vocab-parallel cross-entropy
    with its three per-token all-reduces, the symbolic ones. Step figures within their bounds."""
    point = make_point(model, system="dgx-h100", seq_len=seq_len, **parallel)
    _, ours, theirs = agreement(generator, point)
    for name, piece in (("embed", "prologue"), ("head", "epilogue")):
        for way in ("forward", "backward"):
            captured, synthesised = block(ours, f"{name}.{way}"), block(theirs, f"{name}.{way}")
            assert all(op.name.startswith(f"{piece}.{way}.") for op in captured.ops)
            assert flops(captured, "gemm") == pytest.approx(flops(synthesised, "gemm"), rel=1e-12)
            assert comm(captured) == comm(synthesised)
    assert flops(block(ours, "head.forward"), "gemm") == 2 * seq_len * point.model.hidden * point.model.vocab / (
        point.parallel.tp
    )


def test_a_head_of_the_models_own_is_what_is_captured(generator):
    """A model whose head soft-caps its logits (tests/fx_tiny_llama.py: softcapped): the captured head runs the
    cap (a division, a tanh and a product per logit, forward and again in backward) that the symbolic head has
    not; its GEMMs are the same."""
    plain, capped = (
        make_point(seq_len=SEQ, overrides={"model.fx_factory": f"fx_tiny_llama:{name}"}, tp=2, dp=2, sp=True)
        for name in ("llama", "softcapped")
    )
    heads = [block(generator.generate(p), "head.forward") for p in (plain, capped)]
    logits = SEQ * plain.model.vocab / 2
    assert flops(heads[1], "gemm") == flops(heads[0], "gemm")
    extra = sum(op.flops for op in heads[1].ops) - sum(op.flops for op in heads[0].ops)
    assert extra >= 3 * logits


def test_larger_micro_batches_scale_the_ends_too(generator):
    """Beyond micro-batch 3 the embedding and the head are the lines through their captures at 2 and 3, as the
    layer is: each op and the temporaries as a capture at that micro-batch gives them."""
    point = make_point(seq_len=SEQ, micro_batch=4, tp=2, dp=2, sp=True)
    for piece in (PROLOGUE, EPILOGUE):
        scaled, captured = generator._piece(point, piece), FxGenerator()._captured(point, 4, piece)
        assert scaled.forward == captured.forward and scaled.backward == captured.backward
