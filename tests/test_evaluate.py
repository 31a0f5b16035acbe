"""A generated workload priced end to end: overlap is computed, not assumed, and metrics are consistent."""

import pytest
from helpers import make_point

from dse import plugins
from dse.point.evaluate import evaluate

GEN = plugins.generator("symbolic")
COST = plugins.cost_model("analytical")


def test_data_parallel_gradient_sync_hides_under_backward_compute():
    result = evaluate(make_point("tiny-llama", seq_len=512, global_batch=8, dp=8), GEN, COST)
    assert result.metrics["comm_time_s"] > 0
    assert 0 < result.metrics["overlap_ratio"] <= 1
    exposed = result.metrics["comm_time_s"] * (1 - result.metrics["overlap_ratio"])
    assert result.metrics["exposed_comm_time_s"] == pytest.approx(exposed)


def test_tensor_parallel_forward_all_reduces_are_exposed():
    """Forward TP all-reduces sit on the critical path; only backward ones hide, under the weight-gradient GEMMs
    that do not need them (Megatron's asynchronous input-gradient all-reduce)."""
    m = evaluate(make_point("tiny-llama", seq_len=512, global_batch=8, tp=8), GEN, COST).metrics
    assert m["comm_time_s"] > 0
    assert 0 < m["overlap_ratio"] < 0.5
    assert m["exposed_comm_time_s"] > 0.5 * m["comm_time_s"]


def test_metrics_agree_with_each_other():
    point = make_point(
        "llama3-8b",
        {"base": "dgx-h100", "network": {1: {"npus": 2}}},
        seq_len=4096,
        global_batch=32,
        tp=4,
        pp=2,
        dp=2,
        sp=True,
        zero=1,
    )
    m = evaluate(point, GEN, COST).metrics
    assert m["tokens_per_s_per_gpu"] == pytest.approx(32 * 4096 / m["step_time_s"] / 16)
    peak = point.system.accelerator.peak_flops("bf16") * 16
    assert m["mfu"] == pytest.approx(m["model_flops"] / (m["step_time_s"] * peak))
    assert 0.1 < m["mfu"] < 0.8
    assert m["fits_memory"] == (m["peak_memory_bytes"] <= point.system.accelerator.hbm_bytes)
    assert m["step_time_s"] >= m["compute_time_s"]


def test_more_micro_batches_shrink_the_pipeline_bubble():
    def step(global_batch: int) -> float:
        point = make_point("tiny-llama", seq_len=512, global_batch=global_batch, pp=4, dp=2)
        return evaluate(point, GEN, COST).metrics["step_time_s"] / global_batch

    assert step(64) < step(8)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("sp", [False, True])
def test_every_strategy_generates_and_recompute_trades_flops_for_memory(zero, sp):
    """Every ZeRO stage x SP x recompute combination on a 3D-parallel point: more recompute, more FLOPs and
    fewer saved activations."""
    flops, activations = [], []
    for recompute in ("none", "selective", "full"):
        point = make_point(
            "tiny-llama", seq_len=512, global_batch=16, tp=2, pp=2, dp=2, sp=sp, zero=zero, recompute=recompute
        )
        result = evaluate(point, GEN, COST)
        flops.append(sum(c.time_by_category["gemm"] + c.time_by_category["attention"] for c in result.result.classes))
        activations.append(result.result.classes[0].memory_at_peak["activation"])
    assert flops[0] < flops[1] < flops[2]
    assert activations[0] > activations[1] > activations[2] > 0
