"""A GEMM priced by how its output tiles fill the SMs (tile and wave quantization), from the shape the symbolic
generator gives it."""

import pytest
from helpers import make_point

from dse.compute import compute_time, tile_share
from dse.point.points import build_point, expand
from dse.system import AcceleratorSpec
from dse.workload import Op, OpKind
from generators.symbolic import SymbolicGenerator

A100 = dict(
    name="a100-like",
    peak_tflops={"bf16": 312.0},
    hbm_GiB=80,
    hbm_bandwidth_GBps=2039,
    compute_efficiency={"gemm": 0.8},
    memory_efficiency=1.0,
    kernel_launch_us=0.0,
    gemm_half_efficiency_gflop=1.0,
    sm_count=108,
    gemm_tile=(256, 128),
)


def test_wave_quantization_closed_form():
    # 8192 x 2304 output in 256x128 tiles: 32 x 18 = 576 tiles on 108 SMs, 6 waves of which 5.33 are full.
    assert tile_share((1, 8192, 2304, 6144), 108, (256, 128)) == pytest.approx(576 / (6 * 108), rel=1e-12)
    # A whole number of waves fills every slot: 8192 x 3456 = 32 x 27 = 864 tiles = 8 waves of 108.
    assert tile_share((1, 8192, 3456, 4096), 108, (256, 128)) == pytest.approx(1.0, rel=1e-12)
    # A partial tile wastes its empty part: m = 100 fills 100/128 of a 128-row tile (the better way round: 54
    # tiles of 128x256, their k split in two to fill the 108 SMs).
    assert tile_share((1, 100, 256 * 54, 8192), 108, (256, 128)) == pytest.approx(100 / 128, rel=1e-12)


def test_tile_is_tried_both_ways_round():
    # 128 x 4096 with 256x128 tiles wastes half of each; the 128x256 way round fills them: 16 tiles on 108 SMs,
    # each of whose k is split 6 ways (108 // 16) while each split keeps >= 256 of k.
    share = tile_share((1, 128, 4096, 8192), 108, (256, 128))
    assert share == pytest.approx(128 * 4096 * 6 / (1 * 108 * 256 * 128), rel=1e-12)


def test_split_k_keeps_a_least_depth():
    # 1 tile, k = 512: at most 2 splits of 256, so 2 of 108 slots busy.
    assert tile_share((1, 256, 128, 512), 108, (256, 128)) == pytest.approx(2 / 108, rel=1e-12)


def test_shaped_gemm_priced_by_its_tiles_unshaped_by_the_half_efficiency_size():
    acc = AcceleratorSpec(**A100)
    shape = (1.0, 8192.0, 2304.0, 6144.0)
    flops = 2 * 8192 * 2304 * 6144
    shaped = Op("qkv", OpKind.COMPUTE, "gemm", flops=flops, gemm=shape)
    peak = 312e12 * 0.8
    assert compute_time(shaped, acc, "bf16") == pytest.approx(flops / (peak * 576 / 648), rel=1e-12)
    unshaped = Op("qkv", OpKind.COMPUTE, "gemm", flops=flops)
    assert compute_time(unshaped, acc, "bf16") == pytest.approx((flops + 1e9) / peak, rel=1e-12)


def test_generator_gives_each_gemm_its_local_shape():
    raw = {
        "model": "tiny-llama",
        "workload": {"seq_len": 256, "global_batch": 8, "micro_batch": 2},
        "parallel": {"tp": 2, "dp": 4},
        "system": "tiny-ring",
    }
    point = build_point(expand(raw), "test")
    m = point.model
    workload = SymbolicGenerator().generate(point)
    ops = {op.name: op for block in workload.blocks for op in block.ops}
    tokens = 2 * 256
    # column-parallel: the output width splits over tp; the forward, input-gradient and weight-gradient products
    assert ops["w1"].gemm == (1, tokens, m.ffn / 2, m.hidden)
    assert ops["w1.dgrad"].gemm == (1, tokens, m.hidden, m.ffn / 2)
    assert sorted(ops["w1.wgrad"].gemm[1:3]) == sorted((m.hidden, m.ffn / 2))
    assert ops["w1.wgrad"].gemm[3] == tokens
    for op in ops.values():
        if op.gemm is not None:
            batch, rows, cols, depth = op.gemm
            assert 2 * batch * rows * cols * depth == pytest.approx(op.flops, rel=1e-12), op.name


def _forward_ops(kernels: str, **parallel):
    point = make_point(
        "tiny-gpt",
        seq_len=256,
        global_batch=8,
        micro_batch=2,
        overrides={"model.dropout": True, "workload.kernels": kernels},
        **parallel,
    )
    workload = SymbolicGenerator().generate(point)
    block = next(b for b in workload.blocks if b.name == "layer.forward")
    return {op.name: op for op in block.ops}


def test_fused_kernels_run_bias_dropout_add_as_one_kernel():
    """Megatron's bias_dropout_add (and torch.compile's fusion of it): one kernel reads the branch and the
    residual and writes the sum and the 1-byte mask; the bias and the add move nothing of their own. Eager runs
    three kernels. A column-parallel bias is the GEMM's epilogue when fused."""
    tokens, h, item = 2 * 256, 256, 2
    x = tokens * h * item
    fused = _forward_ops("fused", dp=4)
    assert fused["residual2.dropout"].bytes == pytest.approx(3 * x + tokens * h, rel=1e-12)
    assert fused["residual2"].bytes == 0 and fused["w2.bias"].bytes == 0 and fused["w1.bias"].bytes == 0
    eager = _forward_ops("eager", dp=4)
    assert eager["residual2.dropout"].bytes == pytest.approx(2 * x + tokens * h, rel=1e-12)
    assert eager["residual2"].bytes == pytest.approx(3 * x, rel=1e-12)
    assert eager["w2.bias"].bytes > 0 and eager["w1.bias"].bytes > 0
    # Under SP the fused kernel runs on the sequence shard, after the reduce-scatter.
    sp = _forward_ops("fused", tp=2, dp=2, sp=True)
    assert sp["residual2.dropout"].bytes == pytest.approx((3 * x + tokens * h) / 2, rel=1e-12)
