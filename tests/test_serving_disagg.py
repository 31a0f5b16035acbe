"""Disaggregated serving and DP+EP waves, pinned by closed forms: the KV hand-off on a stated link, the pools'
capacities and balanced split at fixed stage times, the steady state at low load and in a closed loop, and a
wave's all-to-all sized to its largest member with a dummy batch for an idle one."""

import math

import pytest
from helpers import make_point

from dse import plugins
from dse.serving import disaggregated
from dse.serving.disaggregated import Pool, Pools
from dse.serving.iteration import DUMMY_BATCH, nearest, pricer
from dse.serving.pools import deployment
from dse.serving.shapes import Engine, IterationShape
from dse.serving.steady import Load
from dse.serving.transfer import KVLink, kv_bytes_per_token

SERVE = {"workload.mode": "serve", "workload.seq_len": None, "workload.global_batch": None}
H200_NODE = {"base": "dgx-h200", "network": {1: {"npus": 1}}}


def disaggregated_point(prefill_tp: int, prefill_dp: int, decode_tp: int, decode_dp: int, **serving):
    section = {
        "isl": 4000,
        "osl": 500,
        "rate_per_s": 1.0,
        "kind": "disaggregated",
        "decode": {"tp": decode_tp, "dp": decode_dp},
        **serving,
    }
    overrides = {**SERVE, "workload.serving": section}
    return make_point("llama3-70b", H200_NODE, overrides=overrides, tp=prefill_tp, dp=prefill_dp)


def test_kv_hand_off_of_a_prompt_on_nvlink():
    """Llama-3-70B keeps 2 x 8 KV heads x 128 x 2 bytes x 80 layers = 327,680 bytes per token; a TP2 prefill GPU
    sends half of a 4,000-token prompt's 1.31 GB, a TP4 decode GPU receives a quarter, over H200 NVLink at 450 GB/s x
    0.82 after 700 ns, less what the instances' own collectives take of it. The decode side's share comes from the
    generated step's memory, the closed form from the model: the two agree."""
    point = disaggregated_point(2, 2, 4, 1)
    assert kv_bytes_per_token(point.model, 2) == 2 * 8 * 128 * 2 * 80
    generator, cost_model = plugins.generator("symbolic"), plugins.cost_model("analytical")
    built = deployment(point, generator, cost_model)
    assert built.decode.kv_bytes_per_token() == pytest.approx(327_680 / 4, rel=1e-9)
    link = built.pools.link
    assert link.bytes_per_token == 327_680 / 2 and link.layers == 0
    # Both instances' tensor-parallel all-reduces cross the same NVLink ports: the hand-off gets what the busier
    # leaves (the prefill instance's at its full token budget, or the decode instance's at its full batch).
    prefill = built.prefill.step("prefill", 1, 8192).result
    decode = built.decode.step("decode", 256, nearest(4000 + 250)).result
    busy = max(r.comm_time_s / r.step_time_s for r in (prefill, decode))
    assert link.contention == pytest.approx(busy) and 0.0 < busy < 0.5
    line_rate = 450e9 * 0.82 * (1 - busy)
    assert link.seconds(4000) == pytest.approx(700e-9 + 4000 * 327_680 / 2 / line_rate, rel=1e-9)
    assert built.pools.links == 2  # one per prefill instance


def test_layer_streamed_hand_off_shows_what_outlasts_the_prefill():
    link = KVLink(bandwidth_Bps=1e9, latency_s=0.0, bytes_per_token=1e3, layers=4)  # 1 ms per 1,000 tokens
    assert link.seconds(1000, prefill_s=0.0) == pytest.approx(1e-3)
    assert link.seconds(1000, prefill_s=1.0) == pytest.approx(1e-3 / 4)  # one layer's share after the last layer
    assert link.seconds(1000, prefill_s=0.8e-3) == pytest.approx(1e-3 - 0.8e-3 * 3 / 4)


def fixed_pools(t_prefill: float, t_decode: float, hand_off: float) -> Pools:
    """Two prefill engines whose iterations take t_prefill at any shape, four decode engines at t_decode, one
    hand-off link per prefill engine taking `hand_off`."""
    common = {"max_batched_tokens": 8192, "chunked_prefill": True, "prefill_chunk": 8192, "kv_block_tokens": 16}
    prefill = Engine(engines=2, max_seqs=64, kv_capacity_tokens=10**7, role="prefill", **common)
    decode = Engine(engines=4, max_seqs=32, kv_capacity_tokens=10**7, role="decode", **common)
    link = KVLink(bandwidth_Bps=1.0, latency_s=hand_off, bytes_per_token=0.0, layers=0)
    return Pools(
        Pool(prefill, lambda shape: t_prefill if shape.tokens else 0.0, 2),
        Pool(decode, lambda shape: t_decode if shape.tokens else 0.0, 4),
        link,
        links=2,
    )


def test_pool_capacities_and_the_balanced_split_at_fixed_stage_times():
    """A prefill engine fills its 8,192-token budget with 2.048 prompts of 4,000 per 0.5 s iteration; a decode
    engine holds its 32 seats for 500 iterations of 20 ms, after the arrival's wait for half the iteration in
    flight; a link moves one prompt per 0.1 s."""
    pools, load = fixed_pools(0.5, 0.02, 0.1), Load(4000, 500, rate_per_s=1.0)
    capacity = disaggregated.capacities(pools, load)
    assert capacity["prefill"] == pytest.approx(2 * 8192 / 4000 / 0.5)
    assert capacity["decode"] == pytest.approx(4 * 32 / (500 * 0.02 + 0.01))
    assert capacity["transfer"] == pytest.approx(2 / 0.1)
    # per GPU: prefill 8.192 / 2, decode 12.8 / 4; the decode pool's share that equalises them
    share = disaggregated.balanced_decode_share(capacity, 2, 4)
    per_prefill, per_decode = 8.192 / 2, 128 / 10.01 / 4
    assert share == pytest.approx(per_prefill / (per_prefill + per_decode))
    gpus = 6
    assert per_prefill * gpus * (1 - share) == pytest.approx(per_decode * gpus * share)
    state = disaggregated.steady_state(pools, load)
    assert state.bottleneck == "prefill"


def test_low_load_latency_is_prefill_then_hand_off_then_the_first_decode_iteration():
    pools = fixed_pools(0.5, 0.02, 0.1)
    load = Load(4000, 500, rate_per_s=1e-6)
    state = disaggregated.steady_state(pools, load)
    assert state.prefill_s == pytest.approx(0.5, rel=1e-5)
    assert state.transfer_s == pytest.approx(0.1, rel=1e-5)
    assert state.ttft_s == pytest.approx(0.5 + 0.1 + 0.02, rel=1e-5)
    assert state.tpot_s == pytest.approx(0.02)


def test_closed_loop_keeps_its_clients_in_flight():
    pools = fixed_pools(0.5, 0.02, 0.1)
    load = Load(4000, 500, concurrency=20)
    state = disaggregated.steady_state(pools, load)
    residence = state.ttft_s + (load.osl - 1) * state.tpot_s
    assert state.requests_per_s * residence == pytest.approx(20, rel=1e-6)
    assert state.requests_per_s < min(disaggregated.capacities(pools, load).values())
    many = disaggregated.steady_state(pools, Load(4000, 500, concurrency=10_000))
    assert many.requests_per_s == pytest.approx(min(disaggregated.capacities(pools, load).values()), rel=1e-5)


def test_a_wave_is_sized_to_its_largest_member_and_an_idle_member_runs_a_dummy_batch():
    """tiny-moe with its 8 experts over ep = 2 attention data-parallel ranks (TP 1 each)."""
    point = make_point(
        "tiny-moe",
        overrides={**SERVE, "workload.serving": {"isl": 64, "osl": 16, "concurrency": 8}},
        dp=8,
        ep=2,
    )
    prices = pricer(point, plugins.generator("symbolic"), plugins.cost_model("analytical"))
    busy, idle = IterationShape(8, 8, 8 * 64, 0, 0), IterationShape(0, 0, 0, 0, 0)
    assert prices.all_to_all(8) > prices.all_to_all(1) > 0
    assert prices.wave_time([busy, busy]) == pytest.approx(prices.time(busy))
    own = max(prices.time(busy) - prices.all_to_all(8), prices.time(DUMMY_BATCH) - prices.all_to_all(1))
    assert prices.wave_time([busy, idle]) == pytest.approx(own + prices.all_to_all(8))
    assert prices.wave_time([idle, idle]) == pytest.approx(prices.time(DUMMY_BATCH))
    small = IterationShape(1, 1, 64, 0, 0)
    sized = prices.time(small) - prices.all_to_all(1) + prices.all_to_all(8)
    assert prices.wave_time([small, busy]) >= sized > prices.time(small)
    assert math.isclose(prices.wave_time([small, busy]), max(sized, prices.time(busy)))
