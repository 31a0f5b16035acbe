"""Request-level discrete-event simulation of a continuous-batching serving deployment.

The closed-form steady state (`steady`) gives a deployment's means with no spread; queueing, latency percentiles and
KV-cache preemption only show when requests arrive, wait, are admitted and leave one by one, which is what this
module does: an open loop (arrivals at given times) or a closed loop (N clients, each sending its next request when
the previous one finishes), routed over `engines` alike, each scheduled iteration by iteration as vLLM schedules, and
every iteration priced by the caller's `IterationTime` on the iteration's `IterationShape`.

Speed: a request of 1000 output tokens lives through 1000 iterations, so stepping every sequence every iteration
would cost 10^7 Python steps for 10,000 requests; nothing here costs a step per sequence per iteration. Every
decoding sequence of an engine gains the same `tokens_per_decode` tokens per iteration, so a sequence is described by
its state when it started decoding (engine step s0, tokens generated g0): at engine step s it has
g0 + (s - s0) * gain. The steps at which it finishes and at which its context crosses into a new KV block are known
in advance and kept in calendars (dicts from step to sequences; each engine visits its steps in order), and the sum
of the decoding contexts is a running total. An iteration costs the sequences that finish or need a block in it, not
the whole batch; and an engine runs on through decode-only iterations that nothing outside it can touch without
going back to the event queue.
"""

import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dse.serving.shapes import Engine, IterationShape, IterationTime, Requests, chunk_pairs

_EPS = 1e-9
"""Slack on float comparisons of generated-token counts (fractional under speculative decoding)."""

_WAITING, _PREFILLING, _DECODING, _FINISHED = range(4)
_STATISTICS = {"mean": None, "p50": 50.0, "p90": 90.0, "p99": 99.0}


@dataclass(frozen=True)
class EventStats:
    """What the simulation measured: per measured request (in request order) and over the measurement window.

    Measured requests: open loop, all but the first `warmup_share` of arrivals; closed loop, the completions after the
    first `warmup_share` of them, up to the one that sends the last request (after it the clients run out and the
    concurrency drains, so later completions are not at the load asked for). The window runs from the first measured
    arrival (open) or the last warm-up completion (closed; 0 without warm-up) to the last measured completion."""

    ttft_s: np.ndarray
    """Time to first token: the end of the iteration that finishes the prompt minus the arrival."""
    tpot_s: np.ndarray
    """Time per output token after the first: (finish - first token) / (osl - 1); NaN where osl == 1."""
    e2e_s: np.ndarray
    """Finish minus arrival."""
    output_tokens: int
    """Output tokens of the measured requests."""
    duration_s: float
    """Length of the measurement window."""
    preemptions: int
    """Recompute preemptions in the window."""
    iterations: int
    """Engine iterations started in the window, summed over engines."""
    running_mean: float
    """Time average over the window of the sequences admitted (holding KV), summed over engines."""
    rejected: int
    """Requests dropped up front (never sent) because prompt + output exceed one engine's whole KV cache."""


class _Flow:
    """Per-request state shared by the engines, as Python lists (scalar access to numpy arrays is slow)."""

    def __init__(self, isl: list[int], osl: list[int]):
        n = len(isl)
        self.isl, self.osl = isl, osl
        self.phase = [_WAITING] * n
        self.arrival = [math.nan] * n
        self.first = [math.nan] * n
        self.finish = [math.nan] * n
        self.completed: list[int] = []
        self.generated = [0.0] * n
        """Tokens generated so far (expected, so fractional under speculative decoding); while decoding, as of the
        engine step it started decoding at."""
        self.since = [0] * n
        """Engine step at which a decoding sequence started decoding."""
        self.target = list(isl)
        """Tokens to prefill: the prompt, plus the tokens generated before a preemption when recomputed."""
        self.done = [0] * n
        self.blocks = [0] * n
        self.admitted = [0] * n
        """Admission order (over all engines), which decides who is preempted: the most recently admitted."""
        self.finish_step = [0] * n
        self.cross_step = [0] * n
        self.admissions = 0
        self.preempted_at: list[float] = []


class _EngineState:
    """One engine: its queue, its admitted sequences, its KV blocks and the calendars of its decoding sequences.

    Scheduling (vLLM V1 with chunked prefill): every decoding sequence, each allocated the block it needs (preempting
    the most recently admitted sequence while none is free); then the next chunk of each partially prefilled prompt in
    admission order (allocated the same way); then waiting requests FCFS while the budget, max_seqs and free blocks
    allow, stopping at the first that does not fit. Decodes are never cut by the token budget (vLLM requires
    max_num_batched_tokens >= max_num_seqs). Without chunked prefill (vLLM V0) an iteration prefills whole prompts
    only, if the first waiting one fits, else decodes only. With `Engine.reserve` (TensorRT-LLM's
    GUARANTEED_NO_EVICT) a request is admitted only with blocks for its whole prompt and output, and so never needs
    another block or preempts."""

    def __init__(self, flow: _Flow, engine: Engine):
        self.flow = flow
        self.max_seqs = engine.max_seqs
        self.max_tokens = engine.max_batched_tokens
        self.chunked = engine.chunked_prefill
        self.chunk = engine.prefill_chunk
        self.block = engine.kv_block_tokens
        self.width = 1 + engine.draft_tokens
        self.reserve = engine.reserve
        self.gain = engine.tokens_per_decode
        self.free = engine.kv_capacity_tokens // engine.kv_block_tokens
        self.most_blocks = math.ceil(max(self.gain, 2.0) / self.block)
        """Most blocks a decoding sequence can need at one step: its context grows by the gain per step, or by up
        to 2 tokens at its first step past a (re)computed prompt."""
        self.step = 0
        """Iterations with decodes this engine has run: the clock of its decoding sequences."""
        self.waiting: deque[int] = deque()
        self.running: dict[int, None] = {}
        """Admitted sequences (holding KV), in admission order."""
        self.prefilling: dict[int, None] = {}
        self.decoders = 0
        self.kv_base = 0.0
        """Sum over decoding sequences of isl + generated - since * gain; their contexts sum to this plus
        decoders * step * gain."""
        self.finishing: dict[int, list[int]] = {}
        self.crossing: dict[int, list[int]] = {}
        self.busy = False
        self.decoded = False
        self.chunks: list[int] = []
        """Sequences given a prompt chunk in the iteration in flight."""
        self.tokens = 0
        self.pairs = 0.0
        self.preempted = False
        """Whether scheduling the iteration in flight preempted a sequence."""

    def schedule(self, now: float, time: IterationTime) -> float:
        """Schedule the next iteration and return its duration."""
        self.tokens, self.pairs, self.preempted = 0, 0.0, False
        if self.chunked:
            if self.step in self.crossing:
                self._grow_decoders(now)
            if self.prefilling:
                self._continue_prefills(now)
            if self.waiting and not self.preempted:  # as vLLM V1: no admission in a step that had to preempt
                self._admit_chunks()
            self.decoded = self.decoders > 0
        else:
            self.decoded = not self._admit_whole()
            if self.decoded and self.step in self.crossing:
                self._grow_decoders(now)
        n = self.decoders if self.decoded else 0
        kv = self.kv_base + n * self.step * self.gain if n else 0.0
        return time(IterationShape(n, n * self.width, kv, self.tokens, self.pairs, len(self.chunks)))

    def complete(self, now: float) -> None:
        """End the iteration in flight: decoders gain their tokens, finished prompts give their first token."""
        flow = self.flow
        if self.decoded:
            self.step += 1
            for rid in self.finishing.pop(self.step, ()):
                if flow.phase[rid] == _DECODING and flow.finish_step[rid] == self.step:
                    self._stop_decoding(rid)
                    self._finish(rid, now)
        for rid in self.chunks:
            if flow.done[rid] < flow.target[rid]:
                continue
            del self.prefilling[rid]
            flow.generated[rid] += 1.0
            if math.isnan(flow.first[rid]):
                flow.first[rid] = now
            if flow.generated[rid] >= flow.osl[rid] - _EPS:
                self._finish(rid, now)
            else:
                self._start_decoding(rid)
        self.chunks.clear()

    def _blocks(self, tokens: float) -> int:
        return math.ceil(tokens / self.block - _EPS)

    def _budget(self) -> int:
        return self.max_tokens - self.decoders * self.width - self.tokens

    def _grow_decoders(self, now: float) -> None:
        """Give the decoding sequences whose context enters a new block this step their blocks, oldest first when
        some may have to be preempted for them. The hot loop of the module: kept to plain arithmetic."""
        flow, step, block, gain, crossing = self.flow, self.step, self.block, self.gain, self.crossing
        due = crossing.pop(step)
        if len(due) * self.most_blocks > self.free:
            due.sort(key=flow.admitted.__getitem__)
        for rid in due:
            if flow.phase[rid] != _DECODING or flow.cross_step[rid] != step:
                continue  # preempted, possibly for an older sequence of this list, and maybe decoding again
            base = flow.isl[rid] + flow.generated[rid]
            held = max(math.ceil((base + (step - flow.since[rid]) * gain) / block - _EPS), flow.blocks[rid])
            need = held - flow.blocks[rid]
            if need > self.free and not self._make_room(rid, need, now):
                continue
            self.free -= need
            flow.blocks[rid] = held
            # the next step at which the context outgrows `held` blocks, if before the sequence finishes
            following = max(flow.since[rid] + math.floor((held * block - base) / gain + _EPS) + 1, step + 1)
            if following < flow.finish_step[rid]:
                flow.cross_step[rid] = following
                crossing.setdefault(following, []).append(rid)

    def _continue_prefills(self, now: float) -> None:
        flow = self.flow
        for rid in list(self.prefilling):
            budget = self._budget()
            if budget <= 0:
                break
            if flow.phase[rid] != _PREFILLING:
                continue  # preempted for an older sequence of this list
            chunk = min(flow.target[rid] - flow.done[rid], self.chunk, budget)
            need = max(self._blocks(flow.done[rid] + chunk) - flow.blocks[rid], 0)
            if need <= self.free or self._make_room(rid, need, now):
                self.free -= need
                flow.blocks[rid] += need
                self._add_chunk(rid, chunk)

    def _admit_chunks(self) -> None:
        flow = self.flow
        while self.waiting and len(self.running) < self.max_seqs:
            budget = self._budget()
            if budget <= 0:
                break
            rid = self.waiting[0]
            chunk = min(flow.target[rid], self.chunk, budget)
            need = self._reserved(rid) if self.reserve else self._blocks(chunk)
            if need > self.free:
                break
            self._admit(rid, need)
            self._add_chunk(rid, chunk)

    def _admit_whole(self) -> bool:
        """Without chunked prefill: whole prompts FCFS within the budget (a longer one alone); True if any."""
        flow = self.flow
        while self.waiting and len(self.running) < self.max_seqs:
            rid = self.waiting[0]
            need = self._reserved(rid) if self.reserve else self._blocks(flow.target[rid])
            if need > self.free or (self.tokens and self.tokens + flow.target[rid] > self.max_tokens):
                break
            self._admit(rid, need)
            self._add_chunk(rid, flow.target[rid])
        return self.tokens > 0

    def _reserved(self, rid: int) -> int:
        """The blocks a request holds from admission to its end when admission reserves them: its prompt and
        output (TensorRT-LLM's GUARANTEED_NO_EVICT); it never needs another, so nothing is preempted."""
        return self._blocks(self.flow.isl[rid] + self.flow.osl[rid])

    def _admit(self, rid: int, blocks: int) -> None:
        flow = self.flow
        self.waiting.popleft()
        flow.phase[rid] = _PREFILLING
        flow.admitted[rid] = flow.admissions
        flow.admissions += 1
        flow.blocks[rid] = blocks
        self.free -= blocks
        self.running[rid] = None
        self.prefilling[rid] = None

    def _add_chunk(self, rid: int, chunk: int) -> None:
        flow = self.flow
        self.tokens += chunk
        self.pairs += chunk_pairs(chunk, flow.done[rid])
        flow.done[rid] += chunk
        self.chunks.append(rid)

    def _make_room(self, rid: int, need: int, now: float) -> bool:
        """Preempt the most recently admitted sequences until `need` blocks are free for running sequence `rid`;
        False if that preempted `rid` itself."""
        while self.free < need:
            victim = next(reversed(self.running))
            self._preempt(victim, now)
            if victim == rid:
                return False
        return True

    def _preempt(self, rid: int, now: float) -> None:
        """Recompute preemption: free the blocks, requeue first; re-admitted, it prefills prompt + generated."""
        flow = self.flow
        self.free += flow.blocks[rid]
        flow.blocks[rid] = 0
        del self.running[rid]
        if flow.phase[rid] == _DECODING:
            generated = flow.generated[rid] + (self.step - flow.since[rid]) * self.gain
            self._stop_decoding(rid)
            flow.generated[rid] = generated
        else:
            del self.prefilling[rid]
        flow.target[rid] = flow.isl[rid] + int(flow.generated[rid] + _EPS)
        flow.done[rid] = 0
        flow.phase[rid] = _WAITING
        self.waiting.appendleft(rid)
        flow.preempted_at.append(now)
        self.preempted = True

    def _start_decoding(self, rid: int) -> None:
        flow = self.flow
        flow.phase[rid] = _DECODING
        flow.since[rid] = self.step
        self.decoders += 1
        self.kv_base += flow.isl[rid] + flow.generated[rid] - self.step * self.gain
        finish = self.step + math.ceil((flow.osl[rid] - flow.generated[rid]) / self.gain - _EPS)
        flow.finish_step[rid] = finish
        self.finishing.setdefault(finish, []).append(rid)
        flow.cross_step[rid] = self.step  # its context may already outgrow the prompt's blocks
        self.crossing.setdefault(self.step, []).append(rid)

    def _stop_decoding(self, rid: int) -> None:
        flow = self.flow
        self.decoders -= 1
        self.kv_base = (
            self.kv_base - flow.isl[rid] - flow.generated[rid] + flow.since[rid] * self.gain if self.decoders else 0.0
        )

    def _finish(self, rid: int, now: float) -> None:
        flow = self.flow
        self.free += flow.blocks[rid]
        flow.blocks[rid] = 0
        del self.running[rid]
        flow.phase[rid] = _FINISHED
        flow.finish[rid] = now
        flow.completed.append(rid)


def simulate(
    requests: Requests, engine: Engine, time: IterationTime, clients: int | None = None, warmup_share: float = 0.1
) -> EventStats:
    """Serve `requests` on `engine.engines` engines alike and measure them (see `EventStats` for what is measured).

    Open loop (clients None): request i arrives at requests.arrival_s[i] (sorted). Closed loop: `clients` clients all
    start at 0 and each sends the next row of `requests` the moment its previous request finishes. Each arrival goes to
    the engine with the fewest outstanding requests (ties: the lowest index); an idle engine starts an iteration as
    soon as it has work. Requests that could never fit one engine's KV cache are dropped up front and counted."""
    isl, osl = np.asarray(requests.isl, dtype=np.int64), np.asarray(requests.osl, dtype=np.int64)
    arrival = None if clients is not None else np.asarray(requests.arrival_s, dtype=float)
    _check(isl, osl, arrival, engine, clients, warmup_share)
    fits = -(-(isl + osl) // engine.kv_block_tokens) <= engine.kv_capacity_tokens // engine.kv_block_tokens
    flow = _Flow(isl[fits].tolist(), osl[fits].tolist())
    run = _Deployment(flow, engine, time, [] if arrival is None else arrival[fits].tolist(), clients)
    run.run()
    return _measure(flow, run.iterations, clients, warmup_share, rejected=int((~fits).sum()))


class _Deployment:
    """The engines under one stream of requests, advanced event by event: arrivals and ends of iterations in time
    order (an end before an arrival at the same time), idle engines started once every event at a time is handled."""

    def __init__(self, flow: _Flow, engine: Engine, time: IterationTime, arrivals: list[float], clients: int | None):
        self.flow, self.time, self.arrivals, self.clients = flow, time, arrivals, clients
        self.engines = [_EngineState(flow, engine) for _ in range(engine.engines)]
        self.outstanding = [0] * engine.engines
        self.ends: list[tuple[float, int]] = []
        """Heap of (end time, engine) of the iterations in flight."""
        self.ready: set[int] = set()
        """Idle engines to start once every event at the current time is handled."""
        self.sent = 0
        self.iterations: list[tuple[float, float, int]] = []
        """(start, duration, sequences admitted) of every iteration, for the measurement window."""

    def run(self) -> None:
        flow, ends, arrivals = self.flow, self.ends, self.arrivals
        for _ in range(min(self.clients or 0, len(flow.isl))):
            self._send(0.0)
        now = 0.0
        while True:
            next_arrival = arrivals[self.sent] if self.sent < len(arrivals) else math.inf
            if self.ready and min(ends[0][0] if ends else math.inf, next_arrival) > now:
                for index in sorted(self.ready):
                    self._start(index, now, next_arrival)
                self.ready.clear()
            if ends and ends[0][0] <= next_arrival:
                now, index = heapq.heappop(ends)
                self.engines[index].busy = False
                self.ready.add(index)
                finished = self._complete(index, now)
                while self.clients and finished and self.sent < len(flow.isl):
                    self._send(now)
                    finished -= 1
            elif next_arrival < math.inf:
                now = next_arrival
                self._send(now)
            else:
                break

    def _send(self, now: float) -> None:
        target = min(range(len(self.engines)), key=self.outstanding.__getitem__)
        self.flow.arrival[self.sent] = now
        self.outstanding[target] += 1
        self.engines[target].waiting.append(self.sent)
        if not self.engines[target].busy:
            self.ready.add(target)
        self.sent += 1

    def _complete(self, index: int, now: float) -> int:
        """End engine `index`'s iteration in flight; returns the requests it finished."""
        before = len(self.flow.completed)
        self.engines[index].complete(now)
        finished = len(self.flow.completed) - before
        self.outstanding[index] -= finished
        return finished

    def _start(self, index: int, now: float, next_arrival: float) -> None:
        """Start engine `index`'s next iteration, and run on through iterations that nothing outside the engine can
        touch: decode-only ones (nothing waiting, no prompt chunk) ending before the next arrival and, in a closed
        loop (where a finish sends a request), before any other engine's iteration ends and finishing nothing."""
        state = self.engines[index]
        horizon = (
            next_arrival if self.clients is None else min(self.ends[0][0] if self.ends else math.inf, next_arrival)
        )
        while state.running or state.waiting:
            duration = state.schedule(now, self.time)
            self.iterations.append((now, duration, len(state.running)))
            quiet = not state.waiting and not state.chunks
            if not quiet or now + duration >= horizon or (self.clients and state.step + 1 in state.finishing):
                heapq.heappush(self.ends, (now + duration, index))
                state.busy = True
                return
            now += duration
            self._complete(index, now)


def _check(
    isl: np.ndarray,
    osl: np.ndarray,
    arrival: np.ndarray | None,
    engine: Engine,
    clients: int | None,
    warmup_share: float,
) -> None:
    for field in ("engines", "max_seqs", "max_batched_tokens", "prefill_chunk", "kv_block_tokens"):
        if getattr(engine, field) < 1:
            raise ValueError(f"engine.{field} must be at least 1, not {getattr(engine, field)}")
    if len(isl) != len(osl) or (arrival is not None and len(arrival) != len(isl)):
        raise ValueError("requests: arrival_s, isl and osl must have one entry per request")
    if len(isl) and (isl.min() < 1 or osl.min() < 1):
        raise ValueError("requests: every isl and osl must be at least 1 token")
    if arrival is not None and np.any(np.diff(arrival) < 0):
        raise ValueError("requests: arrival_s must be sorted")
    if clients is not None and clients < 1:
        raise ValueError(f"clients must be at least 1, not {clients}")
    if not 0.0 <= warmup_share < 1.0:
        raise ValueError(f"warmup_share must be in [0, 1), not {warmup_share}")


def _measure(
    flow: _Flow, iterations: list[tuple[float, float, int]], clients: int | None, warmup_share: float, rejected: int
) -> EventStats:
    n = len(flow.isl)
    if not n:
        raise ValueError(f"no request to measure: none of the {rejected} fits one engine's KV cache")
    warmup = int(warmup_share * n)
    finish = np.array(flow.finish)
    if clients is None:
        measured = np.arange(warmup, n)
        start = flow.arrival[warmup]
    else:
        last = n - min(clients, n)  # completions up to the one that sends the last request
        if last <= warmup:
            raise ValueError(
                f"a closed loop of {clients} clients needs more than {n} requests: it measures the completions after "
                f"the warm-up's {warmup} up to the one that sends the last request, the {last}th"
            )
        measured = np.sort(np.array(flow.completed[warmup:last]))
        start = flow.finish[flow.completed[warmup - 1]] if warmup else 0.0
    end = float(finish[measured].max())
    arrival, first = np.array(flow.arrival)[measured], np.array(flow.first)[measured]
    osl = np.array(flow.osl)[measured]
    tpot = np.full(len(measured), math.nan)
    many = osl > 1
    tpot[many] = (finish[measured][many] - first[many]) / (osl[many] - 1)
    began, lasted, running = (np.array(column, dtype=float) for column in zip(*iterations, strict=True))
    overlap = np.clip(np.minimum(began + lasted, end) - np.maximum(began, start), 0.0, None)
    preempted = np.array(flow.preempted_at)
    duration = end - start
    return EventStats(
        ttft_s=first - arrival,
        tpot_s=tpot,
        e2e_s=finish[measured] - arrival,
        output_tokens=int(osl.sum()),
        duration_s=duration,
        preemptions=int(((preempted >= start) & (preempted < end)).sum()),
        iterations=int(((began >= start) & (began < end)).sum()),
        running_mean=float((overlap * running).sum() / duration),
        rejected=rejected,
    )


def metrics(stats: EventStats, gpus: int, slo: Mapping[str, float] | None = None) -> dict[str, float]:
    """The serving metrics of a simulation on `gpus` GPUs. Goodput counts the requests that meet every bound of `slo`
    (keys like "ttft_p99_s"), each checked against the request's own TTFT / TPOT / E2E: the statistic a key names
    is the one the bound is meant for over all requests, but per request the value is compared directly."""
    latencies = {"ttft": stats.ttft_s, "tpot": stats.tpot_s, "e2e": stats.e2e_s}
    out: dict[str, float] = {}
    for name, values in latencies.items():
        values = values[~np.isnan(values)]
        for statistic, q in _STATISTICS.items():
            if not len(values):
                out[f"{name}_{statistic}_s"] = math.nan
            else:
                out[f"{name}_{statistic}_s"] = float(values.mean() if q is None else np.percentile(values, q))
    window = stats.duration_s
    tpot = stats.tpot_s[~np.isnan(stats.tpot_s)]
    good = np.ones(len(stats.e2e_s), dtype=bool)
    for key, bound in (slo or {}).items():
        name, _, statistic = key.removesuffix("_s").partition("_")
        if not key.endswith("_s") or name not in latencies or statistic not in _STATISTICS:
            raise ValueError(f"SLO {key!r}: expected <ttft|tpot|e2e>_<mean|p50|p90|p99>_s, e.g. ttft_p99_s")
        good &= ~(latencies[name] > bound)  # a NaN TPOT (one output token) meets any bound
    out["tokens_per_s"] = stats.output_tokens / window
    out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / gpus
    out["tokens_per_s_per_user"] = float(np.mean(1.0 / tpot)) if len(tpot) else math.nan
    out["requests_per_s"] = len(stats.e2e_s) / window
    out["goodput_requests_per_s"] = int(good.sum()) / window
    out["preemptions"] = float(stats.preemptions)
    out["concurrency_mean"] = stats.running_mean
    return out
