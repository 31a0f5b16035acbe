"""The steady state of a disaggregated deployment: a prefill pool, the KV hand-off, a decode pool (DistServe,
Splitwise, Dynamo, llm-d), as a closed form for search.

Requests pass through three stages in turn, each of which sustains a rate of its own:

- the prefill pool: engines that only prefill, each iteration carrying a request's prompt chunk beside the other
  prompts that arrived during the iteration before (within the token budget). An engine sustains
  budget / (isl x t(budget)) requests per second, t(budget) being its iteration at a full budget;
- the hand-off: each prefill engine's KV link moves one prompt's cache at a time (`dse.serving.transfer`), queued
  behind the others on its link (an M/D/1 wait, rho t / 2 (1 - rho));
- the decode pool: engines whose requests arrive with their prompt cached (`Engine.role` decode), at the steady
  state of `dse.serving.steady`, which sustains its seats over a request's time in them (its arrival's wait for
  the iteration in flight included).

The deployment's rate is the load's (open loop) or, for n clients (closed loop), the rate at which n requests are
in flight through the three stages (Little's law), found by Brent's method. The stage that sustains the least is the
bottleneck; the decode pool's share of GPUs at which the two pools sustain the same rate is the balanced split.
TTFT = the prefill (queue-free, plus the iteration in flight on arrival) + the hand-off + the decode pool's first
iteration (the decode engine streams every token); TPOT = the decode pool's.
"""

import math
from dataclasses import dataclass, replace

from dse.errors import InfeasibleError
from dse.serving import steady
from dse.serving.shapes import Engine, IterationShape, IterationTime, chunk_pairs, prompt_chunks
from dse.serving.transfer import KVLink

FIXED_POINT_ROUNDS = 50
SATURATION = 1 - 1e-6
"""The closed loop's rate stays this share below the bottleneck's, where the zero-queue stages still have a state."""


@dataclass(frozen=True)
class Pool:
    """One pool's engines and the price of their iterations."""

    engine: Engine
    time: IterationTime
    gpus: int


@dataclass(frozen=True)
class Pools:
    """A disaggregated deployment as the steady state reads it."""

    prefill: Pool
    decode: Pool
    link: KVLink
    links: int
    """Hand-off links: one per prefill attention data-parallel rank (its GPUs' NICs)."""


@dataclass(frozen=True)
class PoolsSteady:
    """The deployment's steady state (whole-deployment figures)."""

    requests_per_s: float
    ttft_s: float
    tpot_s: float
    prefill_s: float
    """Arrival to prompt done: the wait for the iteration in flight and the prompt's iterations."""
    transfer_s: float
    """Prompt done to cache in the decode engine: the link's queue and the hand-off."""
    seqs: float
    """Requests in flight through the three stages (Little's law)."""
    capacity: dict[str, float]
    """Requests per second each stage sustains: prefill, transfer, decode."""

    @property
    def bottleneck(self) -> str:
        return min(self.capacity, key=self.capacity.__getitem__)


def _prefill_shape(tokens: float, pairs: float, chunks: float) -> IterationShape:
    return IterationShape(0.0, 0.0, 0.0, tokens, pairs, chunks)


def prompt_alone(time: IterationTime, isl: float) -> float:
    """A prompt's prefill alone in one iteration: what a layer-by-layer hand-off hides under."""
    return time(_prefill_shape(isl, chunk_pairs(isl, 0.0), 1.0))


def _own_chunks(engine: Engine, isl: float) -> list[tuple[float, float]]:
    """A prompt's chunks as (tokens, cached before it): pieces of prefill_chunk within the budget, or the whole prompt
    in one prefill-only iteration without chunked prefill."""
    return prompt_chunks(isl, min(engine.prefill_chunk, engine.max_batched_tokens) if engine.chunked_prefill else isl)


def prefill_capacity(engine: Engine, time: IterationTime, isl: float) -> float:
    """Requests per second one prefill engine sustains: full budgets of prompt tokens back to back (a prompt longer
    than the budget without chunked prefill runs alone)."""
    budget = max(engine.max_batched_tokens, isl) if not engine.chunked_prefill else engine.max_batched_tokens
    pairs = budget * chunk_pairs(isl, 0.0) / isl
    return budget / (isl * time(_prefill_shape(budget, pairs, max(budget / isl, 1.0))))


def prefill_latency(engine: Engine, time: IterationTime, isl: float, rate: float) -> float:
    """Seconds from arrival to prompt done at `rate` requests per second on one engine: the prompt's chunks each
    share an iteration with the prompt tokens that arrived during the one before (a fixed point: that iteration's
    length depends on what it carries), after the rest of the iteration in flight on arrival, which is busy a share
    rho = rate x isl x t / tokens of the time."""
    own = _own_chunks(engine, isl)
    pairs_per_token = chunk_pairs(isl, 0.0) / isl
    first, cached = own[0]
    t = time(_prefill_shape(first, chunk_pairs(first, cached), 1.0))
    others = 0.0
    for _ in range(FIXED_POINT_ROUNDS):
        others = min(rate * isl * t, max(engine.max_batched_tokens - first, 0.0))
        pairs = chunk_pairs(first, cached) + others * pairs_per_token
        t, previous = time(_prefill_shape(first + others, pairs, 1.0 + others / first)), t
        if abs(t - previous) <= steady.TOLERANCE * t:
            break
    busy = min(rate * isl * t / (first + others), 1.0)
    seconds = busy * t / 2
    for tokens, done in own:
        room = min(others, max(engine.max_batched_tokens - tokens, 0.0))
        pairs = chunk_pairs(tokens, done) + room * pairs_per_token
        seconds += time(_prefill_shape(tokens + room, pairs, 1.0 + room / tokens))
    return seconds


def capacities(pools: Pools, load: steady.Load) -> dict[str, float]:
    """Requests per second the deployment's prefill pool, hand-off links and decode pool each sustain."""
    p, d = pools.prefill, pools.decode
    prefill = prefill_capacity(p.engine, p.time, load.isl) * p.engine.engines
    transfer = pools.links / pools.link.seconds(load.isl, prompt_alone(p.time, load.isl))
    most = steady.seats(d.engine, load)
    full, wait = steady.arriving(d.engine, d.time, most, load, 0.0)  # its prompts arrive cached: none ride along
    decode = most / (full.residence_s(load) + wait) * d.engine.engines
    return {"prefill": prefill, "transfer": transfer, "decode": decode}


def balanced_decode_share(capacity: dict[str, float], prefill_gpus: int, decode_gpus: int) -> float:
    """The share of the deployment's GPUs the decode pool takes when both pools sustain the same rate, at their
    rates per GPU here (each pool's rate is proportional to its instances): 1/d / (1/p + 1/d) for p and d the
    prefill and decode pools' requests per second per GPU."""
    per_prefill, per_decode = capacity["prefill"] / prefill_gpus, capacity["decode"] / decode_gpus
    return per_prefill / (per_prefill + per_decode)


def at_rate(pools: Pools, load: steady.Load, rate: float, capacity: dict[str, float]) -> PoolsSteady:
    """The deployment's steady state at `rate` requests per second (an InfeasibleError beyond a stage's capacity)."""
    slowest = min(capacity, key=capacity.__getitem__)
    if rate >= capacity[slowest]:
        raise InfeasibleError(
            f"serving rate {rate:.4g} requests/s is beyond what the disaggregated deployment sustains: its {slowest} "
            f"stage takes {capacity[slowest]:.4g}; lower the rate or give that pool more instances"
        )
    p, d = pools.prefill, pools.decode
    prefill_s = prefill_latency(p.engine, p.time, load.isl, rate / p.engine.engines)
    hand_off = pools.link.seconds(load.isl, prompt_alone(p.time, load.isl))
    busy = rate / pools.links * hand_off
    transfer_s = hand_off + busy * hand_off / (2 * (1 - busy))
    decoding = steady.steady_state(d.engine, d.time, replace(load, rate_per_s=rate, concurrency=None))
    ttft = prefill_s + transfer_s + decoding.ttft_s
    seqs = rate * (ttft + (load.osl - 1) * decoding.tpot_s)
    return PoolsSteady(rate, ttft, decoding.tpot_s, prefill_s, transfer_s, seqs, capacity)


def steady_state(pools: Pools, load: steady.Load) -> PoolsSteady:
    """The deployment's steady state under the load: at its rate, or, for a concurrency, at the rate that keeps that
    many requests in flight (clients beyond what the stages hold at the bottleneck's rate wait before the prefill)."""
    capacity = capacities(pools, load)
    if load.concurrency is None:
        assert load.rate_per_s is not None
        return at_rate(pools, load, load.rate_per_s, capacity)
    clients = load.concurrency
    highest = SATURATION * min(capacity.values())
    full = at_rate(pools, load, highest, capacity)
    if full.seqs <= clients:
        wait = (clients - full.seqs) / highest
        return replace(full, ttft_s=full.ttft_s + wait, prefill_s=full.prefill_s + wait, seqs=clients)
    rate = steady.root(
        lambda r: at_rate(pools, load, r, capacity).seqs - clients, highest * 1e-9, highest, rtol=steady.TOLERANCE
    )
    return at_rate(pools, load, rate, capacity)


def metrics(state: PoolsSteady, load: steady.Load, gpus: int, slo: dict[str, float]) -> dict[str, float]:
    """`steady.metrics`' keys for the whole deployment, and the disaggregated stages': each stage's mean seconds,
    the share of its capacity the rate takes, and the decode pool's share of GPUs at which the pools balance."""
    whole = steady.Steady(state.seqs, state.ttft_s, state.tpot_s, state.requests_per_s)
    out = steady.metrics(whole, load, 1, gpus, slo)
    out |= {"prefill_mean_s": state.prefill_s, "kv_transfer_mean_s": state.transfer_s}
    for stage, sustained in state.capacity.items():
        out[f"{stage}_load"] = state.requests_per_s / sustained if math.isfinite(sustained) else 0.0
    return out
