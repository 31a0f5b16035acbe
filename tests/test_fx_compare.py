"""The agreement harness (generators/fx/compare.py): the figures it reads from a workload, that a workload agrees
with itself exactly, that it flags a figure out of its bound, and the symbolic defects issue 35 fixed (the loss's
third all-reduce, a fused RoPE that keeps nothing), then fx against symbolic on a few small points with the bounds
of benchmarks/fx_agreement.py's real-size matrix: parameters, GEMM FLOPs and collective bytes equal, peak memory and
step time within 3 %."""

import pytest

from dse.modelstats import matmul_params, param_count
from dse.workload import OpKind
from generators.fx.compare import compare, figures, main, render
from generators.symbolic import SymbolicGenerator
from generators.symbolic.generator import _Builder
from tests.helpers import make_point

SHAPES = [{}, {"tp": 2, "sp": True, "dp": 2, "pp": 2}, {"dp": 4, "zero": 3}]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
def test_one_device_figures_are_the_models(model) -> None:
    """On one rank: every parameter, and GEMM FLOPs of 6 x tokens x the matmul parameters (norm weights multiply
    nothing), which is what torch's flop counter gives for the FX reference models (tests/test_fx_models.py)."""
    point = make_point(model, seq_len=256, global_batch=8)
    m = point.model
    (only,) = figures(SymbolicGenerator().generate(point), point).classes
    assert (only.name, only.ranks, only.parameters) == ("stage0", 1, param_count(m))
    assert only.gemm_flops == 6 * 8 * 256 * (matmul_params(m) - (2 * m.layers + 1) * m.hidden)
    assert dict(only.comm_bytes) == {}
    assert only.peak_memory_bytes > 16 * param_count(m)  # weights, gradients and fp32 Adam states at the least


@pytest.mark.parametrize(
    ("model", "shape"),
    [(m, s) for m in ("tiny-llama", "tiny-moe") for s in SHAPES] + [("tiny-moe", {"tp": 2, "dp": 4, "ep": 2})],
)
def test_a_generator_agrees_with_itself_exactly(model, shape) -> None:
    """Two workloads of the same point from two generator instances (the sanity check FX vs FX must pass too)."""
    point = make_point(model, seq_len=256, global_batch=8, **shape)
    a, b = (figures(SymbolicGenerator().generate(point), point) for _ in range(2))
    rows = compare(a, b)
    assert all(r.ok and r.difference == 0 for r in rows)
    checked = {r.figure for r in rows if r.tolerance is not None}
    assert {"parameters on a rank", "GEMM FLOPs", "peak memory bytes", "step time s"} <= checked
    if shape:
        assert any(r.figure.endswith(" bytes") and r.a > 0 for r in rows if r.figure != "peak memory bytes")


def test_it_flags_figures_beyond_their_tolerance() -> None:
    """A wider MLP (688 -> 700, +1.7 % of the layer's GEMMs, +1.7 % of its weights): parameters and GEMM FLOPs are
    off, and the table says so; the collectives' bytes (activations, unchanged) agree."""
    shape = {"tp": 2, "sp": True, "dp": 2}
    base = make_point("tiny-llama", seq_len=256, global_batch=8, **shape)
    wider = make_point({"base": "tiny-llama", "ffn": 700}, seq_len=256, global_batch=8, **shape)
    rows = {r.figure: r for r in compare(*(figures(SymbolicGenerator().generate(p), p) for p in (wider, base)))}
    assert not rows["parameters on a rank"].ok
    assert not rows["GEMM FLOPs"].ok
    assert 0.01 < rows["GEMM FLOPs"].difference < 0.02
    assert rows["all_gather bytes"].ok and rows["reduce_scatter bytes"].ok
    table = render(list(rows.values()), "wider", "base")
    assert "| stage0 | GEMM FLOPs |" in table and "| NO |" in table


def test_rank_classes_must_match() -> None:
    one = make_point("tiny-llama", seq_len=256, global_batch=8)
    two = make_point("tiny-llama", seq_len=256, global_batch=8, pp=2)
    with pytest.raises(ValueError, match="1 and 2 rank classes"):
        compare(*(figures(SymbolicGenerator().generate(p), p) for p in (one, two)))


def test_command_prints_the_table_and_exits_by_the_verdict(tmp_path, capsys) -> None:
    point = tmp_path / "point.yaml"
    point.write_text(
        "model: tiny-llama\nworkload: {seq_len: 256, global_batch: 8}\nparallel: {tp: 2, dp: 4}\nsystem: tiny-ring\n"
    )
    assert main([str(point), "--a", "symbolic", "--b", "symbolic"]) == 0
    out = capsys.readouterr().out
    assert "| rank class | figure | symbolic | symbolic |" in out and "| stage0 | all_reduce bytes |" in out
    assert main([str(point), "--a", "no-such-generator"]) == 2
    assert "unknown generator 'no-such-generator'" in capsys.readouterr().err


def test_the_loss_all_reduces_three_fp32_values_per_token() -> None:
    """Megatron's vocab-parallel cross-entropy over logits split by tp: the maximum, the target's logit and the sum
    of exponentials, one fp32 value per token each (b s = 256 tokens on a rank: 1 KiB each)."""
    point = make_point("tiny-llama", seq_len=256, global_batch=8, tp=2, dp=4)
    head = next(b for b in SymbolicGenerator().generate(point).blocks if b.name == "head.forward")
    reduces = [op for op in head.ops if op.kind is OpKind.COLLECTIVE]
    assert [(op.name, op.comm_bytes, op.axis) for op in reduces] == [
        (f"loss.{what}.all_reduce", 256 * 4, "tp") for what in ("max", "target", "sumexp")
    ]


def test_a_fused_rope_keeps_nothing() -> None:
    """A layer keeps, in bf16, per token: its input, the first norm's output, q, k and v, the attention output, the
    residual, the second norm's output, and the MLP's gate, up and product; not q and k before their rotation (a
    fused RoPE's backward rotates the gradient back from the table alone)."""
    point = make_point("tiny-llama", seq_len=256, global_batch=8)
    m = point.model
    builder = _Builder(point)
    builder.build()
    (traced,) = builder.layer_traces.values()
    kv = 2 * m.n_kv_heads * m.d_head
    assert traced.saved_bytes == 2 * 256 * (6 * m.hidden + kv + 3 * m.ffn)


FX = {"model.fx_factory": "fx_tiny_llama:llama"}
FX_POINTS = [
    ("tiny-llama", FX, {"tp": 2, "dp": 4, "sp": True}),
    ("tiny-llama", FX, {"tp": 2, "dp": 4, "sp": True, "recompute": "full"}),
    ("tiny-llama", FX, {"tp": 2, "dp": 2, "pp": 2, "sp": True, "zero": 3}),
]
"""Small points of benchmarks/fx_agreement.py's kinds, sharing one capture of each piece but the recomputed layer:
tp with sp, full recompute (its last GEMM and reduce-scatter run again), pipelining with ZeRO 3. At these sizes
kernel launches weigh more than at real sizes, so points without tp, whose kernel boundaries differ most, and the
MoE layers are left to the benchmark."""


@pytest.fixture(scope="module")
def fx_generator():
    pytest.importorskip("torch")
    from generators.fx.generator import FxGenerator

    return FxGenerator()


@pytest.mark.parametrize(("model", "overrides", "parallel"), FX_POINTS)
def test_fx_agrees_with_symbolic(fx_generator, model, overrides, parallel) -> None:
    point = make_point(model, seq_len=256, global_batch=16, overrides=overrides, **parallel)
    rows = compare(*(figures(g.generate(point), point) for g in (fx_generator, SymbolicGenerator())))
    assert [r for r in rows if not r.ok] == []
    assert any(r.figure == "GEMM FLOPs" and r.a > 0 for r in rows)


@pytest.mark.parametrize("fuse", [False, True])
def test_a_gather_reads_the_elements_it_picks(fuse) -> None:
    """The loss picks each token's target logit (`logits.gather(-1, targets)`): a kernel that reads the targets
    (64 int64) and one fp32 logit per token, not the rows of 1000 it picks from, alone or fused with what follows
    (which then reads nothing more from outside and writes its result)."""
    torch = pytest.importorskip("torch")
    from torch.fx.experimental.proxy_tensor import make_fx

    from generators.fx.lower import lower_forward

    logits = torch.empty(64, 1000, device="meta")
    targets = torch.empty(64, 1, dtype=torch.int64, device="meta")
    gm = make_fx(lambda x, i: (x.gather(-1, i) * 2.0,))(logits, targets)
    ops = lower_forward(gm, "loss", {}, (64, 1000), fuse).block.ops
    picked, indices = 64 * 4, 64 * 8
    expected = [indices + picked + picked] if fuse else [indices + picked + picked, 2 * picked]
    assert [op.bytes for op in ops] == expected
