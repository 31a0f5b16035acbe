"""The steady state of a serving deployment: a closed form from the load to the iteration time to TTFT, TPOT and
throughput, for search (milliseconds per point once its iterations are priced).

Every engine holds n sequences on average, each gaining E tokens per decode iteration (E = 1 without speculative
decoding), while the requests other than a given one arrive at some rate, each bringing isl prompt tokens. With
chunked prefill those prompts ride in the decode iterations in chunks: a share of the iterations carries one chunk
more than the rest (the roofline is not linear in tokens: a few ride free beside the weights' read, a chunk does
not); without it they run in prefill-only iterations that stall the decodes. Then

- TPOT = t / E, t the mean iteration time at that mix; throughput n E / t per engine;
- TTFT = the iterations that carry the request's own chunks beside the other sequences' decodes and the other
  prompts' chunks of the moment, plus (open loop) the rest of the iteration in flight when it arrives (E[t^2] /
  2 E[t]: an arrival lands in a long iteration more often), plus (closed loop with more clients than seats) the wait
  for a seat;
- n and the rate from the load: a concurrency gives n (within max_num_seqs, the KV cache and the token budget) and
  the rate n / (a request's time in the engine); a rate gives n by Little's law, n = rate x (TTFT + (osl - 1) x
  TPOT), solved by Brent's method. A rate above what the engines sustain at their most sequences has no steady
  state: that point is infeasible, with the rate it could take.

It is the zero-queue model aiconfigurator uses, with the iteration mix and the arrival's wait above: no spread, so
every percentile equals the mean, no queue behind other prompts for the token budget, and no preemption. The event
simulation (`dse.serving.events`) gives all three; at low load the two agree (tests/test_serving.py).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from dse.errors import InfeasibleError
from dse.serving.shapes import Engine, IterationShape, IterationTime, chunk_pairs, prompt_chunks
from dse.serving.spec import meets

FIXED_POINT_ROUNDS = 50
STALL_LIMIT = 2**40
"""Without chunked prefill, a TPOT this many iterations long means the prompts never leave the decodes a turn."""
TOLERANCE = 1e-9
"""Relative: of the fixed points' iteration times and of the open loop's sequences held."""


def root(f: Callable[[float], float], low: float, high: float, **tolerance: float) -> float:
    """scipy's brentq, imported on the first solve: scipy.optimize takes about 0.4 s and 30-50 MiB to import, which
    every process that imports dse (a Ray worker, a CLI call, a training-only sweep) would pay at import time."""
    from scipy.optimize import brentq

    return brentq(f, low, high, **tolerance)


@dataclass(frozen=True)
class Load:
    """What the steady state is asked about: mean lengths and the deployment's rate or concurrency."""

    isl: float
    osl: float
    rate_per_s: float | None = None
    concurrency: float | None = None


@dataclass(frozen=True)
class Steady:
    """One engine's steady state (the deployment runs `engine.engines` of them alike)."""

    seqs: float
    """Sequences the engine holds (decoding or being prefilled), the mean."""
    ttft_s: float
    tpot_s: float
    requests_per_s: float


def seats(engine: Engine, load: Load) -> float:
    """Sequences an engine can hold at once: max_num_seqs, the KV cache at the mean context of a sequence (its
    prompt, half its output, and half a block its last block leaves empty; its whole prompt and output when
    admission reserves them), and, with chunked prefill, the token budget that must carry both the decodes and the
    prompts replacing those that finish. Fewer than one is an InfeasibleError: the engine cannot serve the load at
    any depth."""
    e = engine.tokens_per_decode
    held = load.isl + (load.osl if engine.reserve else load.osl / 2) + engine.kv_block_tokens / 2
    kv = engine.kv_capacity_tokens / held
    most = min(engine.max_seqs, kv)
    if engine.chunked_prefill and engine.role != "decode":  # a decode engine's prompts arrive in its cache
        most = min(most, engine.max_batched_tokens / (1 + engine.draft_tokens + (e * load.isl / load.osl)))
    if most < 1:
        raise InfeasibleError(
            f"an engine cannot hold one sequence of {load.isl:g} + {load.osl:g} tokens (workload.serving.isl, osl): "
            f"its KV cache holds {engine.kv_capacity_tokens:,} tokens and its token budget "
            f"(workload.serving.scheduler.max_batched_tokens) {engine.max_batched_tokens:,}; give it more HBM or GPUs, "
            "a larger token budget, or shorter requests"
        )
    return most


def _decodes(engine: Engine, n: float, load: Load) -> IterationShape:
    """n sequences decoding at the mean context, nothing prefilled."""
    return IterationShape(n, n * (1 + engine.draft_tokens), n * (load.isl + load.osl / 2), 0.0, 0.0, 0.0)


def _with_prefill(base: IterationShape, tokens: float, pairs: float, chunks: float) -> IterationShape:
    return IterationShape(
        base.decode_seqs, base.decode_tokens, base.decode_kv_tokens, tokens, pairs, chunks if tokens else 0.0
    )


def _chunks(engine: Engine, isl: float, room: float) -> list[tuple[float, float]]:
    """A prompt's chunks as (tokens, cached before it) when each iteration has `room` tokens beside the decodes."""
    return prompt_chunks(isl, max(min(engine.prefill_chunk, room), 1.0))


@dataclass(frozen=True)
class Held:
    """An engine holding `seqs` sequences on average (an iteration at least one): its iteration time, and a request's
    TTFT (before any wait) and TPOT."""

    seqs: float
    iteration_s: float
    ttft_s: float
    tpot_s: float
    residual_s: float
    """The mean rest of the iteration in flight that a request arriving at random meets: E[t^2] / (2 E[t]) over
    the iterations' times (renewal theory: an arrival lands in a long iteration more often than in a short one)."""

    def residence_s(self, load: Load) -> float:
        """A request's time in the engine: its prompt, then its output tokens after the first."""
        return self.ttft_s + (load.osl - 1) * self.tpot_s

    def at(self, rate: float, wait: float = 0.0) -> Steady:
        return Steady(self.seqs, self.ttft_s + wait, self.tpot_s, rate)


Others = Callable[[float, float], float]
"""The rate (per second) at which requests other than a given one arrive, given its TTFT and TPOT."""


def _converged(old: float, new: float) -> bool:
    return abs(new - old) <= TOLERANCE * abs(new)


def state(engine: Engine, time: IterationTime, n: float, load: Load, others: Others) -> Held:
    """The engine holding n sequences, while the requests other than a given one arrive at `others` per second:
    their prompts are what its decode iterations carry beside the decodes (chunked prefill) or what stalls them
    (prefill-only iterations), and its own prompt runs beside the other n - 1 sequences' decodes. The iteration
    time and the rate depend on each other (a closed loop's clients send faster as the engine speeds up): a fixed
    point, reached in a few rounds where the engine keeps up, and bounded by the token budget where it does not."""
    e, held = engine.tokens_per_decode, max(n, 1.0)
    decoding = _decodes(engine, held, load)
    if engine.role == "decode":  # prompts arrive cached: a request's first token is its first iteration's
        t = time(decoding)
        return Held(n, t, t, t / e, t / 2)
    beside = _decodes(engine, max(n - 1.0, 0.0), load)
    if engine.chunked_prefill:
        pairs_per_token = chunk_pairs(load.isl, 0.0) / load.isl
        budget = max(engine.max_batched_tokens - decoding.decode_tokens, 0.0)
        chunk = min(load.isl, engine.prefill_chunk, budget)

        def carrying(base: IterationShape, chunks: float, own: tuple[float, float] | None = None) -> float:
            """An iteration of `base`'s decodes, `chunks` of the others' prompt chunks (within the budget) and,
            given as (tokens, cached), a chunk of the request's own prompt."""
            mine, cached = own or (0.0, 0.0)
            room = max(engine.max_batched_tokens - base.decode_tokens - mine, 0.0)
            tokens = min(chunks * chunk, room)
            pairs = tokens * pairs_per_token + chunk_pairs(mine, cached) * (mine > 0)
            return time(_with_prefill(base, tokens + mine, pairs, chunks + (mine > 0)))

        own_chunks = _chunks(engine, load.isl, engine.max_batched_tokens - beside.decode_tokens)
        t, ttft, chunks = time(decoding), 0.0, 0.0
        for _ in range(FIXED_POINT_ROUNDS):
            # Prompts come in chunks, not spread thinly over every iteration: a share of the iterations carries
            # one chunk more than the rest, and the roofline is not linear (a few tokens ride free beside the
            # weights' read, a chunk does not), so the mean iteration is the mix of the two. The request's own
            # chunks share their iterations with the other prompts' chunks of the moment.
            ttft = sum(carrying(beside, chunks, own) for own in own_chunks)
            chunks = others(ttft, t / e) * load.isl * t / chunk if chunk > 0 else 0.0
            whole, share = math.floor(chunks), chunks - math.floor(chunks)
            low, high = carrying(decoding, whole), carrying(decoding, whole + 1)
            t, previous = (1 - share) * low + share * high, t
            if _converged(previous, t):
                break
        residual = ((1 - share) * low * low + share * high * high) / (2 * t)
        return Held(n, t, ttft, t / e, residual)
    t = time(decoding)
    ttft = time(IterationShape(0.0, 0.0, 0.0, load.isl, chunk_pairs(load.isl, 0.0), 1.0))
    residual = t / 2  # an arrival waits for the decode iteration in flight; prompts' iterations come first

    def shortfall(tpot: float) -> float:
        """TPOT less what the decodes take beside the share of time spent on others' prompts at that TPOT."""
        return tpot * (1.0 - others(ttft, tpot) * ttft) - t / e

    low, high = t / e, 2 * t / e
    while shortfall(high) < 0:  # others' prompts take more than the decodes leave: a slower TPOT sends fewer
        high *= 2
        if high > STALL_LIMIT * t:
            return Held(n, t, ttft, math.inf, residual)
    tpot = low if shortfall(low) >= 0 else root(shortfall, low, high, rtol=TOLERANCE)
    return Held(n, t, ttft, tpot, residual)


def closed(engine: Engine, time: IterationTime, n: float, load: Load) -> Steady:
    """n sequences always held (a closed loop with as many clients as seats): the rate is n over a request's time
    in the engine (Little's law), of which the other n - 1 clients send (n - 1) / n. Fewer clients than engines
    leave each engine a share n < 1 of one: it serves one request a share n of the time."""
    s = state(engine, time, n, load, lambda ttft, tpot: max(n - 1.0, 0.0) / (ttft + (load.osl - 1) * tpot))
    return s.at(n / s.residence_s(load))


def steady_state(engine: Engine, time: IterationTime, load: Load) -> Steady:
    """One engine's steady state under the deployment's load (see the module docstring)."""
    most = seats(engine, load)
    if load.concurrency is not None:
        clients = load.concurrency / engine.engines
        found = closed(engine, time, min(clients, most), load)
        if clients <= most:
            return found
        # Clients beyond the seats wait for one: each finishing request frees one (Little's law on the queue).
        queue = (clients - most) / found.requests_per_s
        return replace(found, ttft_s=found.ttft_s + queue)
    assert load.rate_per_s is not None
    rate = load.rate_per_s / engine.engines

    def excess(n: float) -> float:
        """Sequences a rate keeps in the engine (Little's law) beyond n: falls through 0 at the steady state."""
        s, wait = arriving(engine, time, n, load, rate)
        return rate * (s.residence_s(load) + wait) - n

    if excess(most) >= 0:
        full = closed(engine, time, most, load)
        raise InfeasibleError(
            f"serving.rate_per_s={load.rate_per_s:g} is beyond what the deployment sustains: "
            f"{full.requests_per_s * engine.engines:.4g} requests/s with every engine at {most:.0f} sequences; "
            "lower the rate or add instances"
        )
    n = root(excess, 0.0, most, xtol=TOLERANCE * most, rtol=TOLERANCE)
    s, wait = arriving(engine, time, n, load, rate)
    return s.at(rate, wait)


def arriving(engine: Engine, time: IterationTime, n: float, load: Load, rate: float) -> tuple[Held, float]:
    """The open loop at n held, and a request's wait on arrival: while an iteration runs (a share min(n, 1) of the
    time) it waits for the rest of it (`Held.residual_s`). A closed loop's request is sent as its client's last
    one finishes, at the end of an iteration, and waits for none."""
    s = state(engine, time, n, load, lambda ttft, tpot: rate)
    return s, min(n, 1.0) * s.residual_s


def metrics(steady: Steady, load: Load, engines: int, gpus: int, slo: dict[str, float]) -> dict[str, float]:
    """The serving metrics of a steady state (the keys of `dse.serving.events.metrics`): no spread, so each
    percentile is the mean, and goodput is every request or none."""
    requests = steady.requests_per_s * engines
    tokens = requests * load.osl
    e2e = steady.ttft_s + (load.osl - 1) * steady.tpot_s
    values = {"ttft": steady.ttft_s, "tpot": steady.tpot_s, "e2e": e2e}
    out: dict[str, float] = {}
    for what, value in values.items():
        for stat in ("mean", "p50", "p90", "p99"):
            out[f"{what}_{stat}_s"] = value
    met = meets(out, slo)
    out |= {
        "tokens_per_s": tokens,
        "tokens_per_s_per_gpu": tokens / gpus,
        "tokens_per_s_per_user": 1.0 / steady.tpot_s,
        "requests_per_s": requests,
        "goodput_requests_per_s": requests if met else 0.0,
        "preemptions": 0.0,
        "concurrency_mean": steady.seqs * engines,
    }
    return out
