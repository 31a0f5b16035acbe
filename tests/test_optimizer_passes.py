"""The memory-bound passes over the gradients before Adam: fp16's unscale and inf check, gradient-norm clipping
(`workload.grad_clip`), against their closed forms."""

import pytest
from helpers import make_point, run_cli

from dse.compute import compute_time
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel


def _optimizer_ops(point):
    workload = SymbolicGenerator().generate(point)
    block = next(b for b in workload.blocks if b.name == "optimizer")
    return {op.name: op for op in block.ops}, workload


def test_clipping_reads_the_shard_for_its_norm_then_scales_it_in_fp32():
    """Each rank's norm reads its fp32 gradient shard (4 bytes an element) and the scaling reads and writes it (8);
    the shard is what Adam updates (ADAM_BYTES = 28 bytes an element), and both run before Adam."""
    point = make_point(dp=2, zero=1)
    ops, _ = _optimizer_ops(point)
    elems = ops["adam"].bytes / 28
    assert ops["grad_norm"].bytes == pytest.approx(4 * elems, rel=1e-12)
    assert ops["grad_clip"].bytes == pytest.approx(8 * elems, rel=1e-12)
    assert ops["adam"].deps == (list(ops).index("grad_clip"),)
    assert "grad_unscale" not in ops
    off, _ = _optimizer_ops(make_point(dp=2, zero=1, overrides={"workload.grad_clip": False}))
    assert set(off) == {"adam"} | {name for name in off if name.startswith("params.")}


def test_fp16_unscales_before_the_norm_and_the_step_grows_by_the_passes():
    point = make_point(dp=2, zero=1, overrides={"model.dtype": "fp16"})
    ops, workload = _optimizer_ops(point)
    elems = ops["adam"].bytes / 28
    assert ops["grad_unscale"].bytes == pytest.approx(8 * elems, rel=1e-12)
    assert list(ops)[:3] == ["grad_unscale", "grad_norm", "grad_clip"]
    # the optimizer ends the step on the compute stream: turning clipping off saves exactly its two kernels
    off = make_point(dp=2, zero=1, overrides={"model.dtype": "fp16", "workload.grad_clip": False})
    cost = AnalyticalCostModel(exact=True)
    saved = (
        cost.simulate(workload, point.system).step_time_s
        - cost.simulate(SymbolicGenerator().generate(off), off.system).step_time_s
    )
    accelerator = point.system.accelerator
    expected = sum(compute_time(ops[name], accelerator, "fp16") for name in ("grad_norm", "grad_clip"))
    assert saved == pytest.approx(expected, rel=1e-9)


def test_grad_clip_outside_training_is_an_error(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "model: tiny-llama\nworkload: {mode: prefill, seq_len: 256, global_batch: 8, grad_clip: false}\n"
        "parallel: {dp: 8}\nsystem: tiny-ring\n"
    )
    code, out, err = run_cli("check", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "workload.grad_clip" in err and "workload.mode: train" in err
