"""The serving event simulation against closed forms and hand-worked schedules, and against a plain re-statement of
its scheduler that steps every sequence every iteration (the module advances decoding sequences in aggregate)."""

import math
from collections import deque
from dataclasses import replace

import numpy as np
import pytest

from dse.serving.events import EventStats, metrics, simulate
from dse.serving.shapes import Engine, IterationShape, Requests, chunk_pairs

ROOMY = Engine(
    engines=1,
    max_seqs=1,
    max_batched_tokens=2048,
    chunked_prefill=True,
    prefill_chunk=1024,
    kv_capacity_tokens=1 << 20,
    kv_block_tokens=16,
)
D = 0.01


def constant(shape: IterationShape) -> float:
    return D


def linear(shape: IterationShape) -> float:
    """Seconds linear in every sum of the shape, with coefficients that keep the terms apart."""
    return (
        1e-3
        + 1e-4 * shape.decode_seqs
        + 1e-5 * shape.tokens
        + 1e-7 * shape.decode_kv_tokens
        + 1e-9 * shape.prefill_pairs
    )


def stream(arrival_s, isl, osl) -> Requests:
    n = len(arrival_s)
    return Requests(np.asarray(arrival_s, float), np.broadcast_to(isl, n).copy(), np.broadcast_to(osl, n).copy())


def poisson(n: int, rate: float, isl, osl, seed: int = 0) -> Requests:
    return stream(np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n)), isl, osl)


@pytest.mark.parametrize(("rho", "n"), [(0.5, 30_000), (0.8, 80_000)])
def test_md1_waits_are_lindley_and_pollaczek_khinchine(rho, n):
    """One engine serving one request at a time in one iteration of constant length is an M/D/1 queue: each wait
    (TTFT - D) is Lindley's recursion on the same arrivals, exactly, and their mean is Pollaczek-Khinchine's
    rho D / (2 (1 - rho)). The mean's sampling error (seed 0) is ~2.2% at rho 0.5 with 30,000 requests and ~3% at
    rho 0.8 with 80,000 (100 seeds of the recursion)."""
    requests = poisson(n, rho / D, isl=100, osl=1)
    stats = simulate(requests, ROOMY, constant)
    arrival, lindley, free = requests.arrival_s, np.empty(n), 0.0
    for i in range(n):
        start = max(arrival[i], free)
        lindley[i], free = start - arrival[i], start + D
    np.testing.assert_allclose(stats.ttft_s - D, lindley[n // 10 :], rtol=0, atol=1e-9)
    assert (stats.ttft_s - D).mean() == pytest.approx(rho * D / (2 * (1 - rho)), rel=0.05)


@pytest.mark.parametrize("chunked", [True, False])
def test_single_request_priced_by_hand(chunked):
    """A 3000-token prompt alone: three chunks of 1024, 1024 and 952 tokens (or, unchunked, one iteration of 3000
    over a 2048-token budget: a longer prompt goes alone); then 10 decode iterations at contexts 3001..3010."""
    stats = simulate(stream([0.0], 3000, 11), replace(ROOMY, chunked_prefill=chunked), linear, warmup_share=0)
    chunks = [(1024, 0), (1024, 1024), (952, 2048)] if chunked else [(3000, 0)]
    ttft = sum(1e-3 + 1e-5 * n + 1e-9 * chunk_pairs(n, cached) for n, cached in chunks)
    tpot = 1e-3 + 1e-4 + 1e-5 + 1e-7 * (3000 + 5.5)
    assert stats.ttft_s[0] == pytest.approx(ttft, rel=1e-12)
    assert stats.tpot_s[0] == pytest.approx(tpot, rel=1e-12)
    assert stats.e2e_s[0] == pytest.approx(ttft + 10 * tpot, rel=1e-12)
    assert (stats.iterations, stats.output_tokens, stats.running_mean) == (len(chunks) + 10, 11, 1.0)


def test_prefill_stalls_decodes_only_without_chunking():
    """A decodes from D; B arrives at 1.5 D. Unchunked, B's prompt takes the iteration [2D, 3D] alone and A stalls
    in it; chunked, B's prompt rides along A's decode."""
    requests = stream([0.0, 1.5 * D], 4, 5)
    engine = replace(ROOMY, max_seqs=2)
    unchunked = simulate(requests, replace(engine, chunked_prefill=False), constant, warmup_share=0)
    np.testing.assert_allclose(unchunked.ttft_s, [D, 1.5 * D])
    np.testing.assert_allclose(unchunked.e2e_s, [6 * D, 5.5 * D])
    chunked = simulate(requests, engine, constant, warmup_share=0)
    np.testing.assert_allclose(chunked.ttft_s, [D, 1.5 * D])
    np.testing.assert_allclose(chunked.e2e_s, [5 * D, 5.5 * D])


def test_queueing_grows_with_load():
    """8 sequences of 20 output tokens at a constant D per iteration serve 8 / (20 D) requests/s; at 90% of that
    the p99 TTFT is many iterations, at 30% about one."""
    engine = replace(ROOMY, max_seqs=8)
    capacity = 8 / (20 * D)
    low, high = (metrics(simulate(poisson(2000, rho * capacity, 64, 20), engine, constant), 1) for rho in (0.3, 0.9))
    assert low["ttft_p99_s"] <= 2 * D
    assert high["ttft_p99_s"] > 5 * low["ttft_p99_s"]
    assert high["tokens_per_s"] == pytest.approx(0.9 * capacity * 20, rel=0.05)


def test_preemption_worked_by_hand():
    """Two 4-token prompts of 6 output tokens in 4 blocks of 4 tokens: both prefill at 0 (1 block each) and take a
    second block at their first decode (context 5); at the 5th decode (context 9) A needs a third block, none is
    free, and B (admitted last) is preempted with 5 tokens generated. A finishes at 6D; then B prefills its 4 + 5
    tokens (3 blocks) and that iteration gives its 6th token: done at 7D, its first token still at D."""
    engine = replace(ROOMY, max_seqs=2, kv_capacity_tokens=16, kv_block_tokens=4)
    shapes: list[IterationShape] = []
    stats = simulate(stream([0.0, 0.0], 4, 6), engine, lambda shape: shapes.append(shape) or D, warmup_share=0)
    assert stats.preemptions == 1
    np.testing.assert_allclose(stats.ttft_s, [D, D])
    np.testing.assert_allclose(stats.e2e_s, [6 * D, 7 * D])
    np.testing.assert_allclose(stats.tpot_s, [D, 1.2 * D])
    assert [(s.decode_seqs, s.decode_kv_tokens, s.prefill_tokens, s.prefill_chunks) for s in shapes] == [
        (0, 0, 8, 2),
        (2, 10, 0, 0),
        (2, 12, 0, 0),
        (2, 14, 0, 0),
        (2, 16, 0, 0),
        (1, 9, 0, 0),
        (0, 0, 9, 1),
    ]
    assert stats.running_mean == pytest.approx(12 / 7)


def test_kv_pressure_preempts_and_every_request_completes():
    """32 clients on a cache that holds ~6 of their requests: preemptions, and all measured requests finish."""
    rng = np.random.default_rng(1)
    requests = stream(np.zeros(400), rng.integers(50, 400, 400), rng.integers(20, 300, 400))
    engine = replace(ROOMY, max_seqs=32, max_batched_tokens=512, prefill_chunk=256, kv_capacity_tokens=2048)
    stats = simulate(requests, engine, linear, clients=32)
    assert stats.preemptions > 50
    assert len(stats.e2e_s) == 400 - 32 - 40 and np.isfinite(stats.e2e_s).all()
    assert stats.rejected == 0


@pytest.mark.parametrize(("max_seqs", "running"), [(16, 8), (4, 4)])
def test_closed_loop_keeps_its_clients_in_flight(max_seqs, running):
    """8 clients of 64-token prompts (one chunk) and 10 output tokens at a constant D: every admitted sequence
    turns over every 10 iterations, so the deployment serves min(8, max_seqs) / (10 D) requests/s."""
    stats = simulate(stream(np.zeros(400), 64, 10), replace(ROOMY, max_seqs=max_seqs), constant, clients=8)
    found = metrics(stats, gpus=1)
    assert found["concurrency_mean"] == pytest.approx(running, rel=1e-9)
    assert found["requests_per_s"] == pytest.approx(running / (10 * D), rel=0.02)


def test_speculative_decoding_needs_fewer_iterations():
    """3 drafts accepted with probability 0.6 add 1 + 0.6 + 0.36 + 0.216 = 2.176 tokens per decode, so 100 tokens
    after the first take ceil(100 / 2.176) = 46 decode iterations, each processing 4 tokens."""
    shapes: list[IterationShape] = []
    engine = replace(ROOMY, draft_tokens=3, acceptance=0.6)
    stats = simulate(stream([0.0], 100, 101), engine, lambda shape: shapes.append(shape) or D, warmup_share=0)
    assert len(shapes) == 47 and all(s.decode_tokens == 4 for s in shapes[1:])
    assert stats.e2e_s[0] == pytest.approx(47 * D)


def test_routing_spreads_requests_over_engines():
    """Three requests at once on two engines of one sequence: one each, the third to engine 0 (a tie), after its
    first request's one iteration."""
    shapes: list[IterationShape] = []
    engine = replace(ROOMY, engines=2)
    stats = simulate(stream([0.0] * 3, 100, 1), engine, lambda shape: shapes.append(shape) or D, warmup_share=0)
    np.testing.assert_allclose(stats.ttft_s, [D, D, 2 * D])
    assert [s.prefill_tokens for s in shapes] == [100, 100, 100]


def test_requests_that_never_fit_are_dropped_and_too_few_are_refused():
    engine = replace(ROOMY, kv_capacity_tokens=256)
    stats = simulate(stream([0.0, 1.0, 2.0], [100, 300, 100], 10), engine, constant, warmup_share=0)
    assert stats.rejected == 1 and len(stats.e2e_s) == 2
    with pytest.raises(ValueError, match="none of the 1 fits"):
        simulate(stream([0.0], 300, 10), engine, constant)
    with pytest.raises(ValueError, match="8 clients needs more than 8 requests"):
        simulate(stream(np.zeros(8), 10, 10), engine, constant, clients=8)
    assert len(simulate(stream(np.zeros(9), 10, 10), engine, constant, clients=8).e2e_s) == 1


def test_metrics_by_hand():
    stats = EventStats(
        ttft_s=np.array([0.1, 0.2, 0.3, 0.4]),
        tpot_s=np.array([0.01, 0.02, math.nan, 0.05]),
        e2e_s=np.array([1.0, 2.0, 0.3, 3.0]),
        output_tokens=300,
        duration_s=10.0,
        preemptions=2,
        iterations=100,
        running_mean=3.5,
        rejected=0,
    )
    found = metrics(stats, gpus=4, slo={"ttft_p99_s": 0.35, "tpot_p90_s": 0.03})
    assert list(found) == [
        *(f"{m}_{s}_s" for m in ("ttft", "tpot", "e2e") for s in ("mean", "p50", "p90", "p99")),
        "tokens_per_s",
        "tokens_per_s_per_gpu",
        "tokens_per_s_per_user",
        "requests_per_s",
        "goodput_requests_per_s",
        "preemptions",
        "concurrency_mean",
    ]
    assert found["tpot_mean_s"] == pytest.approx(0.08 / 3)
    assert found["tpot_p50_s"] == pytest.approx(0.02)
    assert found["e2e_p90_s"] == pytest.approx(2.7)  # numpy's linear interpolation
    assert found["tokens_per_s_per_gpu"] == pytest.approx(7.5)
    assert found["tokens_per_s_per_user"] == pytest.approx((100 + 50 + 20) / 3)
    assert found["requests_per_s"] == pytest.approx(0.4)
    # the first two meet both bounds, the third has no TPOT and meets the TTFT one, the fourth misses both
    assert found["goodput_requests_per_s"] == pytest.approx(0.3)
    assert metrics(stats, gpus=4)["goodput_requests_per_s"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="ttft_p99_s"):
        metrics(stats, gpus=4, slo={"ttft_p99": 0.5})


def reference(requests: Requests, engine: Engine, time) -> tuple[np.ndarray, np.ndarray, int]:
    """The scheduler the module implements, written plainly for one engine in an open loop: every sequence stepped
    every iteration. Returns the first-token and finish times and the preemptions."""
    isl, osl, arrival = requests.isl.tolist(), requests.osl.tolist(), requests.arrival_s.tolist()
    n, block, width, gain = len(isl), engine.kv_block_tokens, 1 + engine.draft_tokens, engine.tokens_per_decode
    free = engine.kv_capacity_tokens // block
    gen, done, target, blocks = [0.0] * n, [0] * n, list(isl), [0] * n
    decoding, first, finish = [False] * n, [math.nan] * n, [math.nan] * n
    waiting: deque[int] = deque()
    running: list[int] = []  # admission order
    now, arrived, preemptions = 0.0, 0, 0
    chunks: list[tuple[int, int]] = []  # (request, tokens) of the iteration being scheduled
    preempted: list[int] = []  # in the iteration being scheduled
    while arrived < n or running or waiting:
        while arrived < n and arrival[arrived] <= now:
            waiting.append(arrived)
            arrived += 1
        if not running and not waiting:
            now = arrival[arrived]
            continue
        chunks.clear()
        preempted.clear()

        def grant(rid: int, need: int) -> bool:
            nonlocal free, preemptions
            while free < need:
                victim = running.pop()
                free += blocks[victim]
                blocks[victim], done[victim], decoding[victim] = 0, 0, False
                target[victim] = isl[victim] + int(gen[victim] + 1e-9)
                waiting.appendleft(victim)
                preempted.append(victim)
                preemptions += 1
                if victim == rid:
                    return False
            free -= need
            blocks[rid] += need
            return True

        def budget() -> int:
            return engine.max_batched_tokens - width * sum(decoding[r] for r in running) - sum(c for _, c in chunks)

        def admit(rid: int, chunk: int) -> None:
            nonlocal free
            waiting.popleft()
            running.append(rid)
            blocks[rid] = math.ceil(chunk / block)
            free -= blocks[rid]
            chunks.append((rid, chunk))

        prefill_only = False
        if not engine.chunked_prefill:
            while waiting and len(running) < engine.max_seqs:
                rid = waiting[0]
                fits = math.ceil(target[rid] / block) <= free
                if not fits or (chunks and sum(c for _, c in chunks) + target[rid] > engine.max_batched_tokens):
                    break
                admit(rid, target[rid])
            prefill_only = bool(chunks)
        if not prefill_only:
            for rid in [r for r in running if decoding[r]]:
                if rid in running:
                    grant(rid, max(math.ceil((isl[rid] + gen[rid]) / block - 1e-9) - blocks[rid], 0))
        if engine.chunked_prefill:
            for rid in [r for r in running if not decoding[r]]:
                if rid not in running or budget() <= 0:
                    continue
                chunk = min(target[rid] - done[rid], engine.prefill_chunk, budget())
                if grant(rid, max(math.ceil((done[rid] + chunk) / block) - blocks[rid], 0)):
                    chunks.append((rid, chunk))
            while not preempted and waiting and len(running) < engine.max_seqs and budget() > 0:
                rid = waiting[0]
                chunk = min(target[rid], engine.prefill_chunk, budget())
                if math.ceil(chunk / block) > free:
                    break
                admit(rid, chunk)
        decoders = [] if prefill_only else [r for r in running if decoding[r]]
        shape = IterationShape(
            len(decoders),
            width * len(decoders),
            float(sum(isl[r] + gen[r] for r in decoders)),
            sum(c for _, c in chunks),
            sum(chunk_pairs(c, done[r]) for r, c in chunks),
            len(chunks),
        )
        now += time(shape)
        ended = []
        for rid in decoders:
            gen[rid] += gain
            ended += [rid] if gen[rid] >= osl[rid] - 1e-9 else []
        for rid, chunk in chunks:
            done[rid] += chunk
            if done[rid] == target[rid]:
                gen[rid] += 1
                first[rid] = now if math.isnan(first[rid]) else first[rid]
                decoding[rid] = True
                ended += [rid] if gen[rid] >= osl[rid] - 1e-9 else []
        for rid in ended:
            running.remove(rid)
            free += blocks[rid]
            finish[rid] = now
    return np.array(first), np.array(finish), preemptions


@pytest.mark.parametrize(
    "changes",
    [{}, {"chunked_prefill": False}, {"draft_tokens": 1, "acceptance": 1.0}],
    ids=["chunked", "unchunked", "two-tokens-per-decode"],
)
def test_aggregate_decoding_matches_stepping_every_sequence(changes):
    """300 requests of random lengths at a high rate on an engine of 6 sequences, a 40-token budget, 24-token
    chunks and a cache of 20 blocks of 8 tokens (preemptions galore), priced by `linear`: the same times to the
    last rounding and the same preemptions as `reference`."""
    rng = np.random.default_rng(2)
    requests = stream(np.cumsum(rng.exponential(0.004, 300)), rng.integers(1, 60, 300), rng.integers(1, 40, 300))
    engine = Engine(1, 6, 40, True, 24, 160, 8)
    engine = replace(engine, **changes)
    stats = simulate(requests, engine, linear, warmup_share=0)
    first, finish, preemptions = reference(requests, engine, linear)
    np.testing.assert_allclose(stats.ttft_s, first - requests.arrival_s, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(stats.e2e_s, finish - requests.arrival_s, rtol=1e-12, atol=1e-12)
    assert stats.preemptions == preemptions > 20
