"""Serving points priced by the steady state: its closed forms (memory-bound decode, KV capacity, compute-bound
prefill), its load behaviour, and the spec's refusals."""

from pathlib import Path

import pytest

from dse import plugins
from dse.errors import InfeasibleError, SpecError
from dse.modelstats import param_count
from dse.point.evaluate import evaluate
from dse.point.points import build_point, expand
from dse.search.decoding import vary
from dse.search.space import load_study
from dse.serving.deployment import ServingResult
from dse.serving.iteration import pricer

GENERATOR, COST_MODEL = plugins.generator("symbolic"), plugins.cost_model("analytical")
ROOFLINE = {"base": "h100-sxm", "kernel_source": "roofline", "kernel_launch_us": 0.0}
"""The H100 priced in closed form: every kernel at max(FLOPs / (peak x share), bytes / (bandwidth x share)), no
launch cost."""


def serve_point(serving: dict, tp: int = 1, dp: int = 1, model: str = "llama3-8b", accelerator=None):
    raw = {
        "model": model,
        "workload": {"mode": "serve", "serving": serving},
        "parallel": {"tp": tp, "dp": dp},
        "system": {
            "name": "one-switch",
            "accelerator": accelerator or ROOFLINE,
            "network": [{"topology": "switch", "npus": tp * dp, "bandwidth_GBps": 450, "latency_ns": 1000}],
        },
    }
    return build_point(expand(raw), "test")


def metrics_of(point) -> dict:
    return evaluate(point, GENERATOR, COST_MODEL).metrics


def test_decode_at_batch_one_reads_the_weights_and_the_cache_at_the_hbm_bandwidth():
    """One client: every iteration decodes one token, reading every weight but the input embedding's (a lookup of
    one row) and the request's KV cache once; the activations it also moves are under 1% of that."""
    isl, osl = 4096, 64
    point = serve_point({"isl": isl, "osl": osl, "concurrency": 1})
    found = metrics_of(point)
    prices = pricer(point, GENERATOR, COST_MODEL)
    accelerator = point.system.accelerator
    kv_per_token = 2 * 32 * 8 * 128 * 2  # k and v, 32 layers, 8 KV heads of 128, bf16
    weights = (param_count(point.model) - point.model.vocab * point.model.hidden) * 2
    context = isl + osl / 2  # the steady state's mean context
    expected = (weights + kv_per_token * context) / (accelerator.hbm_bandwidth * accelerator.memory_efficiency)
    assert prices.kv_bytes_per_token() == kv_per_token
    assert found["tpot_mean_s"] == pytest.approx(expected, rel=0.02)
    assert found["tokens_per_s_per_user"] == pytest.approx(1 / found["tpot_mean_s"])


def test_kv_capacity_is_what_the_weights_and_the_largest_iteration_leave_of_the_engines_memory():
    point = serve_point({"isl": 1024, "osl": 128, "concurrency": 8, "kv_cache": {"memory_fraction": 0.8}}, tp=2)
    result = evaluate(point, GENERATOR, COST_MODEL).result
    assert isinstance(result, ServingResult)
    prices = pricer(point, GENERATOR, COST_MODEL)
    hbm = point.system.accelerator.hbm_bytes
    weights = prices.weight_bytes()
    assert weights == pytest.approx(param_count(point.model) * 2 / 2, rel=0.01)  # tp 2 halves all but the norms
    working = prices.working_bytes(8192)
    kv_per_token = 2 * 32 * (8 // 2) * 128 * 2  # tp 2 holds half the KV heads
    assert result.kv_capacity_tokens == int((0.8 * hbm - weights - working) / kv_per_token)
    assert 1e5 < result.kv_capacity_tokens < 1e6  # 58 GiB of an 80 GiB H100's 0.8 at 64 KiB a token


def test_fp8_kv_cache_holds_twice_the_tokens_and_halves_decode_attention():
    serving = {"isl": 8192, "osl": 4096, "concurrency": 16}
    bf16 = evaluate(serve_point(serving), GENERATOR, COST_MODEL)
    fp8 = evaluate(serve_point({**serving, "kv_cache": {"dtype": "fp8"}}), GENERATOR, COST_MODEL)
    assert fp8.result.kv_capacity_tokens == pytest.approx(2 * bf16.result.kv_capacity_tokens, abs=2)
    # 16 contexts of ~10k tokens: 21 GB of bf16 cache beside 15 GB of weights read per step
    assert fp8.metrics["tpot_mean_s"] < 0.75 * bf16.metrics["tpot_mean_s"]


def test_a_long_prompt_is_compute_bound():
    """One 32k-token prompt alone: its TTFT is its FLOPs at the GEMM and attention shares of peak (the matmuls'
    2 N s, the causal scores' 2 x 2 L s^2 / 2 (n d)), within the few percent the norms and elementwise kernels add."""
    isl = 32768
    point = serve_point({"isl": isl, "osl": 2, "concurrency": 1, "scheduler": {"max_batched_tokens": isl}})
    found = metrics_of(point)
    a, m = point.system.accelerator, point.model
    peak = a.peak_flops("bf16")
    matmul = 2 * (param_count(m) - m.vocab * m.hidden) * isl  # the input embedding is a lookup
    scores = 2 * 2 * m.layers * isl * (isl + 1) / 2 * m.heads * m.d_head
    expected = matmul / (peak * a.compute_efficiency["gemm"]) + scores / (peak * a.compute_efficiency["attention"])
    assert found["ttft_mean_s"] == pytest.approx(expected, rel=0.05)


def test_more_clients_trade_per_user_speed_for_throughput_until_the_engine_is_full():
    rows = [metrics_of(serve_point({"isl": 1024, "osl": 256, "concurrency": c})) for c in (1, 8, 64, 256)]
    per_gpu = [r["tokens_per_s_per_gpu"] for r in rows]
    per_user = [r["tokens_per_s_per_user"] for r in rows]
    assert per_gpu == sorted(per_gpu) and per_gpu[-1] > 20 * per_gpu[0]
    assert per_user == sorted(per_user, reverse=True)
    assert [r["concurrency_mean"] for r in rows] == [1, 8, 64, 256]
    # Little's law: clients = requests/s x time in the system
    assert rows[2]["requests_per_s"] * rows[2]["e2e_mean_s"] == pytest.approx(64, rel=0.01)


def test_an_open_loop_at_low_rate_sees_one_request_at_a_time_and_a_rate_beyond_capacity_is_infeasible():
    alone = metrics_of(serve_point({"isl": 1024, "osl": 128, "concurrency": 1}))
    light = metrics_of(serve_point({"isl": 1024, "osl": 128, "rate_per_s": 0.01}))
    assert light["tpot_mean_s"] == pytest.approx(alone["tpot_mean_s"], rel=0.01)
    assert light["ttft_mean_s"] == pytest.approx(alone["ttft_mean_s"], rel=0.01)
    assert light["requests_per_s"] == pytest.approx(0.01)
    with pytest.raises(InfeasibleError, match="beyond what the deployment sustains"):
        metrics_of(serve_point({"isl": 1024, "osl": 128, "rate_per_s": 1000}))


def test_instances_multiply_throughput_and_an_slo_gives_goodput_or_none():
    one = metrics_of(serve_point({"isl": 512, "osl": 128, "concurrency": 16}))
    two = metrics_of(serve_point({"isl": 512, "osl": 128, "concurrency": 32}, dp=2))
    assert two["tokens_per_s"] == pytest.approx(2 * one["tokens_per_s"])
    assert two["tokens_per_s_per_gpu"] == pytest.approx(one["tokens_per_s_per_gpu"])
    bound = one["tpot_p99_s"]
    met = metrics_of(serve_point({"isl": 512, "osl": 128, "concurrency": 16, "slo": {"tpot_p99_s": bound * 1.01}}))
    missed = metrics_of(serve_point({"isl": 512, "osl": 128, "concurrency": 16, "slo": {"tpot_p99_s": bound * 0.9}}))
    assert met["goodput_requests_per_s"] == met["requests_per_s"] and met["slo_excess"] <= 0
    assert missed["goodput_requests_per_s"] == 0 and missed["slo_excess"] == pytest.approx(1 / 0.9 - 1)


def test_speculative_decoding_gains_its_expected_tokens_per_step():
    plain = metrics_of(serve_point({"isl": 1024, "osl": 256, "concurrency": 1}))
    mtp = metrics_of(
        serve_point({"isl": 1024, "osl": 256, "concurrency": 1, "speculative": {"draft_tokens": 1, "acceptance": 0.8}})
    )
    # 1.8 tokens per step, each step verifying 2 tokens: at batch 1 about the cost of one (memory-bound)
    assert plain["tpot_mean_s"] / mtp["tpot_mean_s"] == pytest.approx(1.8, rel=0.03)


@pytest.mark.parametrize(
    ("serving", "message"),
    [
        ({"isl": 10, "osl": 10}, "give serving.rate_per_s"),
        ({"isl": 10, "osl": 10, "rate_per_s": 1, "concurrency": 2}, "one of them"),
        ({"osl": 10, "concurrency": 2}, "serving.isl is missing"),
        ({"isl": 10, "osl": 10, "concurrency": 2, "slo": {"ttft_p95_s": 1}}, "not a latency metric"),
        ({"isl": 10, "osl": 10, "concurrency": 2, "scheduler": {"prefill_chunk": 9000}}, "exceeds"),
        ({"isl": 10, "osl": 10, "concurrency": 2, "arrival": "uniform"}, "only takes effect with a rate"),
    ],
)
def test_a_serving_section_that_would_be_ignored_or_is_incomplete_is_refused_naming_the_field(serving, message):
    with pytest.raises(SpecError, match=message):
        serve_point(serving)


def test_step_fields_are_refused_under_serve_and_serving_under_other_modes():
    base = {"model": "tiny-llama", "parallel": {}, "system": "tiny-ring"}
    serving = {"isl": 8, "osl": 8, "concurrency": 1}
    with pytest.raises(SpecError, match=r"workload\.seq_len would be ignored under mode serve"):
        build_point(expand({**base, "workload": {"mode": "serve", "seq_len": 8, "serving": serving}}), "t")
    with pytest.raises(SpecError, match=r"workload\.serving only takes effect with mode serve"):
        build_point(
            expand({**base, "workload": {"mode": "decode", "seq_len": 8, "global_batch": 8, "serving": serving}}),
            "t",
        )


def test_the_event_simulation_agrees_with_the_steady_state_at_low_load_and_queues_as_load_rises():
    """Poisson arrivals at a twentieth of the deployment's capacity: requests rarely meet, so the simulated mean
    TTFT and TPOT are the steady state's; near capacity the simulation's p99 TTFT shows the queue the closed form
    leaves out."""
    serving = {"isl": 512, "osl": 32}
    light = {**serving, "rate_per_s": 2.0}
    steady = metrics_of(serve_point(light, dp=2))
    events = metrics_of(serve_point({**light, "depth": "events", "requests": 400}, dp=2))
    assert events["ttft_mean_s"] == pytest.approx(steady["ttft_mean_s"], rel=0.05)
    assert events["tpot_mean_s"] == pytest.approx(steady["tpot_mean_s"], rel=0.05)
    assert events["requests_per_s"] == pytest.approx(2.0, rel=0.15)
    capacity = metrics_of(serve_point({**serving, "max_rate": True, "slo": {"e2e_mean_s": 60.0}}, dp=2))
    busy = {**serving, "rate_per_s": 0.9 * capacity["max_rate_per_s"], "depth": "events", "requests": 400}
    queued = metrics_of(serve_point(busy, dp=2))
    assert queued["ttft_p99_s"] > 3 * events["ttft_p99_s"]


@pytest.mark.parametrize("study", sorted((Path(__file__).parents[1] / "studies" / "serving").glob("*.yaml")))
def test_the_shipped_serving_studies_load(study):
    """Every shipped serving study loads and its points price inference: deployments under a load, or (STAGE's
    split) the prefill and decode steps apart."""
    spec = load_study(study)
    points = [point for _, _, point in vary(spec) if not isinstance(point, str)]
    assert points and all(point.workload.mode in ("serve", "prefill", "decode") for point in points)


def test_reserving_admission_never_preempts_and_seats_fewer():
    """A cache of about 40 requests' prompts: vLLM's growing admission seats more and preempts as outputs grow;
    TensorRT-LLM's reserving admission holds prompt + output from the start, seats fewer and preempts none. The
    steady state seats the reserving engine at its cache over prompt + output + half a block."""
    serving = {"isl": 1024, "osl": 1024, "concurrency": 64, "kv_cache": {"memory_fraction": 0.31}}
    events = {**serving, "depth": "events", "requests": 256}
    reserve = {"scheduler": {"admission": "reserve"}}
    grow, held = metrics_of(serve_point(events)), metrics_of(serve_point({**events, **reserve}))
    assert grow["preemptions"] > 0 and held["preemptions"] == 0
    assert held["concurrency_mean"] < grow["concurrency_mean"]
    steady = metrics_of(serve_point({**serving, **reserve}))
    seats = steady["kv_capacity_tokens"] / (1024 + 1024 + 16 / 2)
    assert 1 < seats < 64 and steady["concurrency_mean"] == pytest.approx(seats)
