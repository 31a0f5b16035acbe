"""The event simulation of disaggregated deployments (a prefill pool, KV transfers on links, a decode pool) and of
engines in lock-step waves, against hand-worked schedules and closed forms."""

from dataclasses import replace

import numpy as np
import pytest

from dse.serving.events import metrics, simulate, simulate_disaggregated
from dse.serving.shapes import Engine, IterationShape, Requests, chunk_pairs

ENGINE = Engine(
    engines=1,
    max_seqs=8,
    max_batched_tokens=2048,
    chunked_prefill=True,
    prefill_chunk=1024,
    kv_capacity_tokens=1 << 20,
    kv_block_tokens=16,
)
PREFILL = replace(ENGINE, role="prefill")
DECODE = replace(ENGINE, role="decode")
P, X, D = 0.05, 0.02, 0.01
"""Seconds of a prefill iteration, a KV transfer and a decode iteration where they are constant."""
IDLE = IterationShape(0, 0, 0, 0, 0, 0)


def unused(shape: IterationShape) -> float:
    raise AssertionError("engines in waves are priced by the WaveTime only")


def stream(arrival_s, isl, osl) -> Requests:
    n = len(arrival_s)
    return Requests(np.asarray(arrival_s, float), np.broadcast_to(isl, n).copy(), np.broadcast_to(osl, n).copy())


def recorded(seconds: float, shapes: list[IterationShape]):
    """An IterationTime of constant `seconds` that keeps the shapes it prices."""
    return lambda shape: shapes.append(shape) or seconds


def linear(shape: IterationShape) -> float:
    """Seconds linear in every sum of the shape, with coefficients that keep the terms apart."""
    return (
        1e-3
        + 1e-4 * shape.decode_seqs
        + 1e-5 * shape.tokens
        + 1e-7 * shape.decode_kv_tokens
        + 1e-9 * shape.prefill_pairs
    )


def test_one_request_is_prefill_then_transfer_then_decode():
    """A 100-token prompt in one prefill iteration, its KV cache X on the link, then 5 decode iterations at contexts
    100..104 (the first gives the first token): TTFT = P + X + D, E2E = TTFT + 4 D. Sequences are held during the
    prefill and the decodes, not the transfer."""
    prefills, decodes = [], []
    stats = simulate_disaggregated(
        stream([0.0], 100, 5),
        PREFILL,
        DECODE,
        recorded(P, prefills),
        recorded(D, decodes),
        lambda isl: X,
        warmup_share=0,
    )
    assert stats.ttft_s[0] == pytest.approx(P + X + D)
    assert stats.e2e_s[0] == pytest.approx(P + X + 5 * D)
    assert stats.tpot_s[0] == pytest.approx(D)
    assert (stats.prefill_s[0], stats.transfer_s[0]) == pytest.approx((P, X))
    assert [(s.prefill_tokens, s.prefill_pairs, s.decode_seqs) for s in prefills] == [(100, chunk_pairs(100, 0), 0)]
    assert [(s.decode_seqs, s.decode_kv_tokens, s.prefill_tokens) for s in decodes] == [
        (1, 100 + k, 0) for k in range(5)
    ]
    assert stats.iterations == 6
    assert stats.running_mean == pytest.approx((P + 5 * D) / (P + X + 5 * D))
    found = metrics(stats, gpus=2)
    assert (found["prefill_mean_s"], found["kv_transfer_mean_s"]) == pytest.approx((P, X))
    assert found["tokens_per_s_per_gpu"] == pytest.approx(5 / (P + X + 5 * D) / 2)


@pytest.mark.parametrize(("engines_per_link", "transfers"), [(2, [X, 2 * X]), (1, [X, X])])
def test_transfers_queue_on_a_shared_link(engines_per_link, transfers):
    """Two prompts done together on two prefill engines: on one link the second transfer waits for the first (FIFO);
    on a link each they move together. Each then decodes alone on one of two decode engines."""
    stats = simulate_disaggregated(
        stream([0.0, 0.0], 100, 3),
        replace(PREFILL, engines=2),
        replace(DECODE, engines=2),
        lambda shape: P,
        lambda shape: D,
        lambda isl: X,
        warmup_share=0,
        engines_per_link=engines_per_link,
    )
    np.testing.assert_allclose(stats.transfer_s, transfers)
    np.testing.assert_allclose(stats.ttft_s, P + np.array(transfers) + D)
    np.testing.assert_allclose(stats.e2e_s, P + np.array(transfers) + 3 * D)


def test_kv_cache_arriving_mid_iteration_joins_at_the_next():
    """A decodes on from P + X; B arrives at 2.5 D on the other prefill engine and link, so its KV cache lands at
    P + X + 2.5 D, mid A's 3rd iteration: it joins A's batch at the 4th (TTFT P + X + 1.5 D), however far A could
    run on alone."""
    decodes: list[IterationShape] = []
    stats = simulate_disaggregated(
        stream([0.0, 2.5 * D], 100, 10),
        replace(PREFILL, engines=2),
        DECODE,
        lambda s: P,
        recorded(D, decodes),
        lambda isl: X,
        warmup_share=0,
    )
    np.testing.assert_allclose(stats.ttft_s, [P + X + D, P + X + 1.5 * D])
    np.testing.assert_allclose(stats.e2e_s, [P + X + 10 * D, P + X + 10.5 * D])
    assert [(s.decode_seqs, s.decode_kv_tokens) for s in decodes[2:5]] == [(1, 102), (2, 203), (2, 205)]


@pytest.mark.parametrize("chunked", [True, False])
def test_low_load_matches_a_hand_computation(chunked):
    """Requests far apart (no queue) of random lengths, priced by `linear`: each one's prompt in chunks of 1024 (the
    last shorter; unchunked, whole), its KV cache 1 ms + 1 us per token on the link, then osl decode iterations at
    contexts isl..isl + osl - 1, the first giving the first token."""
    rng = np.random.default_rng(3)
    isl, osl = rng.integers(1, 3000, 40), rng.integers(1, 60, 40)
    prefill, decode = (replace(engine, chunked_prefill=chunked) for engine in (PREFILL, DECODE))
    stats = simulate_disaggregated(
        Requests(np.arange(40.0), isl, osl), prefill, decode, linear, linear, lambda n: 1e-3 + 1e-6 * n, warmup_share=0
    )
    for i, (n, m) in enumerate(zip(isl.tolist(), osl.tolist(), strict=True)):
        chunks = [(min(1024, n - done), done) for done in range(0, n, 1024)] if chunked else [(n, 0)]
        prefill = sum(linear(IterationShape(0, 0, 0, c, chunk_pairs(c, done), 1)) for c, done in chunks)
        transfer = 1e-3 + 1e-6 * n
        decode = [linear(IterationShape(1, 1, n + k, 0, 0, 0)) for k in range(m)]
        assert stats.prefill_s[i] == pytest.approx(prefill, rel=1e-12)
        assert stats.transfer_s[i] == pytest.approx(transfer, rel=1e-12)
        assert stats.ttft_s[i] == pytest.approx(prefill + transfer + decode[0], rel=1e-12)
        assert stats.e2e_s[i] == pytest.approx(prefill + transfer + sum(decode), rel=1e-12)


def test_closed_loop_serves_clients_over_residence():
    """2 clients, a prefill engine and a link each, one decode engine: both requests move in step, each cycle
    P + X + 10 D long, so the deployment serves 2 / (P + X + 10 D) requests/s, holding 2 sequences but during the
    transfer."""
    residence = P + X + 10 * D
    stats = simulate_disaggregated(
        stream(np.zeros(40), 64, 10),
        replace(PREFILL, engines=2),
        DECODE,
        lambda shape: P,
        lambda shape: D,
        lambda isl: X,
        clients=2,
    )
    found = metrics(stats, gpus=3)
    assert found["requests_per_s"] == pytest.approx(2 / residence, rel=1e-12)
    assert found["concurrency_mean"] == pytest.approx(2 * (P + 10 * D) / residence, rel=1e-12)
    np.testing.assert_allclose(stats.e2e_s, residence)


def test_preemption_on_a_decode_engine_recomputes_there():
    """Two 4-token prompts of 6 output tokens arrive together (no transfer time) at a decode engine of 4 blocks of
    4 tokens: each is admitted with 2 blocks (prompt + first token) and decodes from context 4; at the 6th decode
    (context 9) A needs a third block and B (admitted last) is preempted with 5 tokens generated. A finishes after 6
    iterations; then B prefills its 4 + 5 tokens there and that iteration gives its 6th token."""
    decodes: list[IterationShape] = []
    decode = replace(DECODE, max_seqs=2, kv_capacity_tokens=16, kv_block_tokens=4)
    stats = simulate_disaggregated(
        stream([0.0, 0.0], 4, 6),
        PREFILL,
        decode,
        lambda shape: P,
        recorded(D, decodes),
        lambda isl: 0.0,
        warmup_share=0,
    )
    assert stats.preemptions == 1
    np.testing.assert_allclose(stats.ttft_s, [P + D, P + D])
    np.testing.assert_allclose(stats.e2e_s, [P + 6 * D, P + 7 * D])
    assert [(s.decode_seqs, s.decode_kv_tokens, s.prefill_tokens) for s in decodes] == [
        (2, 8, 0),
        (2, 10, 0),
        (2, 12, 0),
        (2, 14, 0),
        (2, 16, 0),
        (1, 9, 0),
        (0, 0, 9),
    ]


def test_decode_admission_holds_the_prompt_and_first_token():
    """Two 4-token prompts of 2 output tokens at a decode engine of 2 blocks of 4 tokens: A is admitted with both
    (prompt + first token, 5 tokens) and B waits for A's 2 iterations, without a preemption."""
    decode = replace(DECODE, max_seqs=2, kv_capacity_tokens=8, kv_block_tokens=4)
    stats = simulate_disaggregated(
        stream([0.0, 0.0], 4, 2), PREFILL, decode, lambda shape: P, lambda shape: D, lambda isl: 0.0, warmup_share=0
    )
    assert stats.preemptions == 0
    np.testing.assert_allclose(stats.ttft_s, [P + D, P + 3 * D])
    np.testing.assert_allclose(stats.e2e_s, [P + 2 * D, P + 4 * D])


def test_reserving_decode_engine_admits_what_it_can_hold_whole():
    """The same two requests on a decode engine that reserves prompt + output (3 blocks each) of its 4: B waits
    for A's 6 iterations, then decodes its own 6."""
    decode = replace(DECODE, max_seqs=2, kv_capacity_tokens=16, kv_block_tokens=4, reserve=True)
    stats = simulate_disaggregated(
        stream([0.0, 0.0], 4, 6), PREFILL, decode, lambda shape: P, lambda shape: D, lambda isl: 0.0, warmup_share=0
    )
    assert stats.preemptions == 0
    np.testing.assert_allclose(stats.ttft_s, [P + D, P + 7 * D])
    np.testing.assert_allclose(stats.e2e_s, [P + 6 * D, P + 12 * D])


def test_wave_prices_members_together_and_idle_members_as_zeros():
    """One request on a wave of two engines: every iteration prices the busy member's shape with the idle one's all
    zeros, and lasts what the wave's price says (here 3 D, whatever the shapes)."""
    waves: list[list[IterationShape]] = []
    engine = replace(ENGINE, engines=2, wave=2)
    stats = simulate(
        stream([0.0], 100, 4),
        engine,
        lambda shape: D,
        warmup_share=0,
        wave=lambda shapes: waves.append(shapes) or 3 * D,
    )
    assert stats.ttft_s[0] == pytest.approx(3 * D)
    assert stats.e2e_s[0] == pytest.approx(12 * D)
    assert [shapes[1] for shapes in waves] == [IDLE] * 4
    assert [(s.prefill_tokens, s.decode_seqs, s.decode_kv_tokens) for s, _ in waves] == [
        (100, 0, 0),
        (0, 1, 101),
        (0, 1, 102),
        (0, 1, 103),
    ]
    assert stats.iterations == 8  # the idle member's dummy iterations too
    assert stats.running_mean == pytest.approx(1.0)


def test_a_wave_member_waits_for_its_group():
    """B arrives at 1.5 W while A's wave iteration runs: it goes to the idle member, which cannot start until the
    wave ends at 2 W (TTFT 1.5 W); engines stepping alone start it at once (TTFT W)."""
    W = 2 * D
    requests = stream([0.0, 1.5 * W], 100, 4)
    waved = simulate(requests, replace(ENGINE, engines=2, wave=2), lambda s: W, warmup_share=0, wave=lambda s: W)
    alone = simulate(requests, replace(ENGINE, engines=2), lambda s: W, warmup_share=0)
    np.testing.assert_allclose(waved.ttft_s, [W, 1.5 * W])
    np.testing.assert_allclose(waved.e2e_s, [4 * W, 4.5 * W])
    np.testing.assert_allclose(alone.ttft_s, [W, W])


def test_decode_pool_in_waves():
    """Two requests on two prefill engines reach a decode pool of one wave of two together; the wave's time is the
    larger member's context in ms: contexts 100.. and 200.. give iterations of 200, 201, 202 ms."""
    stats = simulate_disaggregated(
        stream([0.0, 0.0], [100, 200], 3),
        replace(PREFILL, engines=2),
        replace(DECODE, engines=2, wave=2),
        lambda shape: P,
        unused,
        lambda isl: X,
        warmup_share=0,
        decode_wave=lambda shapes: 1e-3 * max(s.decode_kv_tokens for s in shapes),
    )
    np.testing.assert_allclose(stats.ttft_s, P + X + 0.2)
    np.testing.assert_allclose(stats.e2e_s, P + X + 0.603)


def test_bad_pools_are_refused():
    requests = stream([0.0], 10, 10)
    with pytest.raises(ValueError, match=r"engine\.engines \(3\) must be a multiple of engine\.wave \(2\)"):
        simulate(requests, replace(ENGINE, engines=3, wave=2), linear, wave=lambda shapes: D)
    with pytest.raises(ValueError, match=r"engine\.wave is 2: pass the WaveTime"):
        simulate(requests, replace(ENGINE, engines=2, wave=2), linear)
    with pytest.raises(ValueError, match=r"engine\.role must be 'both'"):
        simulate(requests, PREFILL, linear)
    with pytest.raises(ValueError, match=r"decode\.role must be 'decode'"):
        simulate_disaggregated(requests, PREFILL, ENGINE, linear, linear, lambda isl: X)
    with pytest.raises(ValueError, match="engines_per_link must be at least 1"):
        simulate_disaggregated(requests, PREFILL, DECODE, linear, linear, lambda isl: X, engines_per_link=0)


def test_requests_too_big_for_either_pool_are_dropped():
    """A decode engine of 512 tokens drops the request of 300 + 300 tokens; a prefill engine of 256 the 300-token
    prompt."""
    stats = simulate_disaggregated(
        Requests(np.arange(3.0), np.array([100, 300, 300]), np.array([10, 10, 300])),
        replace(PREFILL, kv_capacity_tokens=512),
        replace(DECODE, kv_capacity_tokens=512),
        linear,
        linear,
        lambda isl: X,
        warmup_share=0,
    )
    assert (stats.rejected, len(stats.e2e_s)) == (1, 2)
    stats = simulate_disaggregated(
        Requests(np.arange(2.0), np.array([100, 300]), np.array([10, 10])),
        replace(PREFILL, kv_capacity_tokens=256),
        DECODE,
        linear,
        linear,
        lambda isl: X,
        warmup_share=0,
    )
    assert (stats.rejected, len(stats.e2e_s)) == (1, 1)
