"""Fused attention priced by its kernel's measured table (workload.attention_kernel): the interpolation, the priced
time in closed form, the shapes the generator gives its attention ops, and the field at the CLI and in studies."""

import math

import pytest
from helpers import make_point, run_cli

from dse.compute import ComputeModel
from dse.kernels import attention_table, kernel_tflops
from dse.search.decoding import decode
from dse.search.space import load_study
from dse.workload import AttentionShape, Op, OpKind
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel

H100 = {"base": "dgx-h100", "network": {1: {"npus": 1}}}
GEN = SymbolicGenerator()


def h100(**accelerator):
    system = H100 | ({"accelerator": accelerator} if accelerator else {})
    return make_point("tiny-llama", system=system, dp=8).system.accelerator


def attention_op(shape: AttentionShape, flops: float = 1e12, density: float = 0.5) -> Op:
    return Op("attn", OpKind.COMPUTE, "attention", flops=flops, density=density, attention=shape)


@pytest.mark.parametrize("kernel", ["fa2", "fa3", "cudnn"])
def test_the_interpolation_returns_the_tables_own_figures_at_its_points(kernel):
    table = h100().attention_kernels.table(kernel)
    checked = 0
    for causal, curves in ((True, table.causal), (False, table.noncausal)):
        for backward, rows in ((False, curves.fwd), (True, curves.bwd)):
            for head_dim, seq, tflops in rows:
                assert kernel_tflops(table, AttentionShape(seq, seq, head_dim, causal, backward)) == tflops
                checked += 1
    assert checked == 2 * 3 * 6 + 2 * 6  # forward: 2 masks x 3 head dims x 6 lengths; backward: unmasked, 2 x 6


def test_between_and_beyond_the_measured_sizes():
    """Log-linear in seq_len, linear in head dim, clamped outside; a call of another shape at sqrt(queries * keys);
    the causal backward the paper does not show is the unmasked one times the forwards' ratio."""
    table = h100().attention_kernels.fa2
    fwd = {(h, s): t for h, s, t in table.causal.fwd}

    def at(queries, keys, head_dim=128, causal=True, backward=False):
        return kernel_tflops(table, AttentionShape(queries, keys, head_dim, causal, backward))

    assert at(math.sqrt(4096 * 8192), math.sqrt(4096 * 8192)) == pytest.approx((fwd[128, 4096] + fwd[128, 8192]) / 2)
    assert at(4096, 16384) == fwd[128, 8192]  # a query chunk against every key: the square of the same area
    assert at(131072, 131072) == fwd[128, 16384]  # beyond 16k: the flattened curve's last figure
    assert at(128, 128) == fwd[128, 512]
    assert at(8192, 8192, head_dim=96) == pytest.approx((fwd[64, 8192] + fwd[128, 8192]) / 2)
    assert at(8192, 8192, head_dim=512) == fwd[256, 8192]
    unmasked_bwd = {(h, s): t for h, s, t in table.noncausal.bwd}
    unmasked_fwd = {(h, s): t for h, s, t in table.noncausal.fwd}
    ratio = fwd[128, 2048] / unmasked_fwd[128, 2048]
    assert at(2048, 2048, backward=True) == pytest.approx(unmasked_bwd[128, 2048] * ratio)


def test_longer_sequences_and_wider_heads_reach_more_of_peak():
    table = h100().attention_kernels.fa2
    for backward in (False, True):
        rates = [kernel_tflops(table, AttentionShape(s, s, 128, True, backward)) for s in (512, 1024, 4096, 16384)]
        assert rates == sorted(rates) and rates[-1] > 1.5 * rates[0]
    assert kernel_tflops(table, AttentionShape(4096, 4096, 128, True, False)) > kernel_tflops(
        table, AttentionShape(4096, 4096, 64, True, False)
    )


@pytest.mark.parametrize(("kernel", "tflops"), [("fa2", 333), ("fa3", 602), ("cudnn", 529), ("auto", 333)])
def test_a_fused_attention_op_at_a_table_point_takes_its_flops_over_the_table_rate(kernel, tflops):
    """Causal forward, head dim 128, 8k tokens (fig. 5's bars): the executed FLOPs (half the conventional count)
    over the bar's TFLOP/s, plus the launch; a 500 W cap's clock share stretches the math by 1/0.87."""
    op = attention_op(AttentionShape(8192, 8192, 128, True, False))
    accelerator = h100()
    seconds, source = ComputeModel(accelerator, "bf16", attention_kernel=kernel).price(op)
    launch = accelerator.kernel_launch_us * 1e-6
    assert source == "kernel_table"
    assert seconds == pytest.approx(0.5e12 / (tflops * 1e12) + launch, rel=1e-12)
    capped, _ = ComputeModel(h100(clock_share=0.87), "bf16", attention_kernel=kernel).price(op)
    assert capped == pytest.approx(0.5e12 / (tflops * 1e12 * 0.87) + launch, rel=1e-12)


def test_without_a_table_or_a_shape_the_flat_efficiency_prices_attention():
    a100 = make_point("tiny-llama", system={"base": "dgx-a100", "network": {1: {"npus": 1}}}, dp=8).system.accelerator
    assert attention_table(a100, "auto", "bf16") is None
    assert attention_table(h100(), "auto", "fp8") is None  # the benchmarks ran BF16
    op = attention_op(AttentionShape(8192, 8192, 128, True, False))
    seconds, source = ComputeModel(a100, "bf16").price(op)
    flat = 0.5e12 / (a100.peak_flops("bf16") * a100.compute_efficiency["attention"])
    assert (seconds, source) == (pytest.approx(flat + a100.kernel_launch_us * 1e-6, rel=1e-12), "roofline")
    shapeless = Op("attn", OpKind.COMPUTE, "attention", flops=1e12, density=0.5)
    assert ComputeModel(h100(), "bf16").price(shapeless)[1] == "roofline"


def attention_ops(workload):
    return [op for block in workload.blocks for op in block.ops if op.category == "attention"]


def test_the_generator_gives_every_fused_attention_op_its_shape():
    """Local query and key lengths, the head dim, the mask and the pass, forward and backward, and the call's
    sequences, query heads and key/value heads on one rank; a context-parallel all-gather attends a query chunk
    over every key."""
    p = make_point("tiny-llama", seq_len=1024, global_batch=8, tp=2, cp=2, dp=2, recompute="full")
    shapes = {op.attention for op in attention_ops(GEN.generate(p))}
    d, n, g = p.model.d_head, p.model.heads / 2, p.model.kv_heads / 2
    assert shapes == {AttentionShape(512, 1024, d, True, backward, 1, n, g) for backward in (False, True)}


def test_ring_steps_off_the_diagonal_run_half_the_block_unmasked():
    """Zigzag ring attention: the diagonal step is a causal kernel over the chunk held, the other steps run half
    of the query x key block without a mask (the executed FLOPs are the same: density 0.5 of the full block)."""
    p = make_point("tiny-llama", seq_len=1024, global_batch=8, tp=2, cp=2, dp=2, cp_algorithm="ring")
    forward = {op.name: op for op in attention_ops(GEN.generate(p)) if not op.attention.backward}
    d, n, g = p.model.d_head, p.model.heads / 2, p.model.kv_heads / 2
    steps = sorted(name for name in forward if ".step" in name)
    assert [forward[name].attention for name in steps] == [
        AttentionShape(512, 512, d, True, False, 1, n, g),
        AttentionShape(512, 256, d, False, False, 1, n, g),
    ]
    assert {forward[name].density for name in steps} == {0.5}


def test_a_replayed_trace_gives_its_own_sizes():
    """The shapes are recorded numbers: a later point of the same structure replays them on its own lengths."""
    for seq in (512, 2048):
        p = make_point("tiny-llama", seq_len=seq, global_batch=8, tp=2, dp=4)
        assert {op.attention.queries for op in attention_ops(GEN.generate(p))} == {seq}


def write_point(tmp_path, system: str, kernel: str, model: str = "llama3-8b"):
    path = tmp_path / "point.yaml"
    path.write_text(
        f"model: {model}\n"
        f"workload: {{seq_len: 8192, global_batch: 64, attention_kernel: {kernel}}}\n"
        "parallel: {tp: 8, dp: 8}\n"
        f"system: {{base: {system}}}\n"
    )
    return path


def test_fa3_on_an_a100_is_refused_in_one_line(tmp_path):
    code, out, err = run_cli("evaluate", str(write_point(tmp_path, "dgx-a100", "fa3")))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "workload.attention_kernel=fa3" in err and "Hopper" in err and "a100-80gb" in err


def test_a_kernel_for_unfused_attention_is_an_error(tmp_path):
    path = write_point(tmp_path, "dgx-h100", "fa3", model="{base: llama3-8b, flash_attention: false}")
    code, _, err = run_cli("check", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'workload.attention_kernel'" in err and "model.flash_attention: true" in err


def test_the_kernel_moves_the_step_and_a_study_can_search_it(tmp_path):
    study = tmp_path / "study.yaml"
    study.write_text(
        "name: kernels\nobjectives: {step_time: minimize}\ntrials: 4\nsampler: grid\n"
        "base:\n  model: llama3-8b\n  workload: {seq_len: 16384, global_batch: 8}\n"
        "  parallel: {tp: 8}\n  system: {base: dgx-h100, network: {1: {npus: 1}}}\n"
        "space:\n  workload.attention_kernel: {choices: [auto, fa2, fa3, cudnn]}\n"
    )
    spec = load_study(study)
    cost = AnalyticalCostModel()
    steps = {}
    for kernel in ("auto", "fa2", "fa3", "cudnn"):
        point = decode(spec, {"workload.attention_kernel": kernel})
        assert not isinstance(point, str)
        steps[kernel] = cost.simulate(GEN.generate(point), point.system).step_time_s
    assert steps["auto"] == steps["fa2"]
    assert steps["fa3"] < steps["cudnn"] < steps["fa2"]


def test_the_compute_model_prices_attention_by_the_kernel_table_at_the_clock_share():
    op = attention_op(AttentionShape(8192, 8192, 128, True, False))
    accelerator = h100(clock_share=0.87)
    expected = 0.5e12 / (602e12 * 0.87) + accelerator.kernel_launch_us * 1e-6
    assert ComputeModel(accelerator, "bf16", attention_kernel="fa3").price(op) == (
        pytest.approx(expected),
        "kernel_table",
    )
