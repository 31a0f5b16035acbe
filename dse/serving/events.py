"""Request-level discrete-event simulation of a serving deployment: one pool of continuous-batching engines, or a
disaggregated one whose prefill pool hands each prompt's KV cache over links to a decode pool.

The closed-form steady state (`steady`) gives a deployment's means with no spread; queueing, latency percentiles and
KV-cache preemption only show when requests arrive, wait, are admitted and leave one by one, which is what this
module does: an open loop (arrivals at given times) or a closed loop (N clients, each sending its next request when
the previous one finishes), routed over `engines` alike, each scheduled iteration by iteration as vLLM schedules
(`dse.serving.events_engine`, which also says how it stays fast), and every iteration priced by the caller's
`IterationTime` on the iteration's `IterationShape`. Engines of an expert-parallel group (`Engine.wave` > 1) step in
lock step, a wave priced by the caller's `WaveTime` on its members' shapes. A disaggregated deployment runs both
pools and the links between them in one event loop: in a closed loop a decode finish sends the next request to the
prefill pool, so neither pool runs without the other.

An engine alone in its wave runs on through decode-only iterations that nothing outside it can touch without going
back to the event queue: in an open loop, until the next arrival of a request or of a KV cache, or the next end of a
prefill iteration (which sends KV caches); in a closed loop (where a finish sends a request), until any other event.
"""

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from dse.serving.events_engine import EngineState, Flow
from dse.serving.shapes import Engine, IterationTime, Requests, WaveTime

_STATISTICS = {"mean": None, "p50": 50.0, "p90": 90.0, "p99": 99.0}


def _none() -> np.ndarray:
    return np.empty(0)


@dataclass(frozen=True)
class EventStats:
    """What the simulation measured: per measured request (in request order) and over the measurement window.

    Measured requests: open loop, all but the first `warmup_share` of arrivals; closed loop, the completions after the
    first `warmup_share` of them, up to the one that sends the last request (after it the clients run out and the
    concurrency drains, so later completions are not at the load asked for). The window runs from the first measured
    arrival (open) or the last warm-up completion (closed; 0 without warm-up) to the last measured completion."""

    ttft_s: np.ndarray
    """Time to first token minus the arrival: the end of the iteration that finishes the prompt, or on a decode
    pool the end of the request's first decode iteration (the decode engine streams every token)."""
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
    """Engine iterations started in the window, summed over engines (an idle member of a wave's dummy one too)."""
    running_mean: float
    """Time average over the window of the sequences admitted (holding KV), summed over engines of every pool."""
    rejected: int
    """Requests dropped up front (never sent) because they exceed one engine's whole KV cache: prompt + output, or
    on a prefill pool the prompt."""
    prefill_s: np.ndarray = field(default_factory=_none)
    """Disaggregated: arrival to the prompt done on the prefill pool, its queue included (else empty)."""
    transfer_s: np.ndarray = field(default_factory=_none)
    """Disaggregated: prompt done to its KV cache at the decode pool, the link's queue included (else empty)."""


def simulate(
    requests: Requests,
    engine: Engine,
    time: IterationTime,
    clients: int | None = None,
    warmup_share: float = 0.1,
    wave: WaveTime | None = None,
) -> EventStats:
    """Serve `requests` on `engine.engines` engines alike and measure them (see `EventStats` for what is measured).

    Open loop (clients None): request i arrives at requests.arrival_s[i] (sorted). Closed loop: `clients` clients all
    start at 0 and each sends the next row of `requests` the moment its previous request finishes. Each arrival goes to
    the engine with the fewest outstanding requests (ties: the lowest index); an idle engine (or wave with work)
    starts an iteration as soon as it has work. Requests that could never fit one engine's KV cache are dropped up
    front and counted. `wave` prices the iterations of engines in waves (`Engine.wave` > 1)."""
    isl, osl, arrival = _stream(requests, clients, warmup_share)
    _check_engine(engine, "engine", "both", wave)
    fits = _fits(isl + osl, engine)
    flow = Flow(isl[fits].tolist(), osl[fits].tolist())
    pools = [_Pool(flow, engine, time, wave, 0)]
    run = _Deployment(flow, pools, [] if arrival is None else arrival[fits].tolist(), clients)
    run.run()
    return _measure(flow, run.iterations, clients, warmup_share, int((~fits).sum()), disaggregated=False)


def simulate_disaggregated(
    requests: Requests,
    prefill: Engine,
    decode: Engine,
    prefill_time: IterationTime,
    decode_time: IterationTime,
    transfer_s: Callable[[int], float],
    clients: int | None = None,
    warmup_share: float = 0.1,
    engines_per_link: int = 1,
    prefill_wave: WaveTime | None = None,
    decode_wave: WaveTime | None = None,
) -> EventStats:
    """Serve `requests` on a prefill pool and a decode pool (`Engine.role` "prefill" and "decode") and measure them,
    loads as `simulate`'s. A request goes to the prefill engine with the fewest outstanding requests; when its
    prompt is done, its KV cache takes transfer_s(isl) seconds on its prefill engine's link, first come first served
    (engines 0..k-1 share link 0, k = `engines_per_link`: the pipeline stages of one instance share its NICs); then
    it goes to the decode engine with the fewest outstanding requests, which decodes all its output tokens. Requests
    whose prompt exceeds a prefill engine's KV cache, or prompt + output a decode engine's, are dropped up front."""
    isl, osl, arrival = _stream(requests, clients, warmup_share)
    _check_engine(prefill, "prefill", "prefill", prefill_wave)
    _check_engine(decode, "decode", "decode", decode_wave)
    if engines_per_link < 1:
        raise ValueError(f"engines_per_link must be at least 1, not {engines_per_link}")
    fits = _fits(isl, prefill) & _fits(isl + osl, decode)
    flow = Flow(isl[fits].tolist(), osl[fits].tolist())
    prefills = _Pool(flow, prefill, prefill_time, prefill_wave, 0)
    decodes = _Pool(flow, decode, decode_time, decode_wave, prefill.engines // prefill.wave)
    links = _Links(transfer_s, engines_per_link, prefill.engines)
    run = _Deployment(flow, [prefills, decodes], [] if arrival is None else arrival[fits].tolist(), clients, links)
    run.run()
    return _measure(flow, run.iterations, clients, warmup_share, int((~fits).sum()), disaggregated=True)


class _Pool:
    """Engines alike of one role: requests routed to the one with the fewest outstanding, the engines stepped in
    waves of `Engine.wave` consecutive ones (groups numbered from `first_group` over the deployment)."""

    def __init__(self, flow: Flow, engine: Engine, time: IterationTime, wave: WaveTime | None, first_group: int):
        self.engines = [EngineState(flow, engine) for _ in range(engine.engines)]
        self.outstanding = [0] * engine.engines
        self.time, self.wave, self.size, self.first_group = time, wave, engine.wave, first_group
        self.hands_over = engine.role == "prefill"
        """A request leaving an engine goes on to the decode pool (else it has finished)."""

    def route(self) -> int:
        return min(range(len(self.engines)), key=self.outstanding.__getitem__)


class _Links:
    """The links from the prefill pool to the decode pool, each a first-come-first-served queue of KV transfers."""

    def __init__(self, seconds: Callable[[int], float], engines_per_link: int, engines: int):
        self.seconds, self.engines_per_link = seconds, engines_per_link
        self.free = [0.0] * -(-engines // engines_per_link)
        """When each link is done with the transfers queued on it."""

    def send(self, engine: int, tokens: int, now: float) -> float:
        """Queue the KV cache of a `tokens`-token prompt from prefill engine `engine`; returns when it arrives."""
        link = engine // self.engines_per_link
        self.free[link] = max(now, self.free[link]) + self.seconds(tokens)
        return self.free[link]


class _Deployment:
    """The pools under one stream of requests, advanced event by event: ends of iterations, arrivals of requests and
    of KV caches at the decode pool, in time order (an end before an arrival at the same time); idle groups with work
    started once every event at a time is handled. A group is a wave of engines (one engine without waves)."""

    def __init__(
        self, flow: Flow, pools: list[_Pool], arrivals: list[float], clients: int | None, links: _Links | None = None
    ):
        self.flow, self.pools, self.arrivals, self.clients, self.links = flow, pools, arrivals, clients, links
        self.groups = [
            (pool, range(start, start + pool.size))
            for pool in pools
            for start in range(0, len(pool.engines), pool.size)
        ]
        """Each group's pool and its engines there."""
        self.busy = [False] * len(self.groups)
        self.ends: list[tuple[float, int]] = []
        """Heap of (end time, group) of the iterations in flight."""
        self.handovers: list[float] = []
        """Heap of the end times of the prefill pool's iterations in flight: the earliest a KV cache can be sent."""
        self.transfers: list[tuple[float, int]] = []
        """Heap of (arrival at the decode pool, request) of the KV caches in transfer."""
        self.ready: set[int] = set()
        """Idle groups to start once every event at the current time is handled."""
        self.sent = 0
        self.iterations: list[tuple[float, float, int]] = []
        """(start, duration, sequences admitted) of every engine iteration, for the measurement window."""

    def run(self) -> None:
        flow, ends, arrivals, transfers = self.flow, self.ends, self.arrivals, self.transfers
        for _ in range(min(self.clients or 0, len(flow.isl))):
            self._send(0.0)
        now = 0.0
        while True:
            next_arrival = arrivals[self.sent] if self.sent < len(arrivals) else math.inf
            next_transfer = transfers[0][0] if transfers else math.inf
            next_event = min(next_arrival, next_transfer)
            if self.ready and min(ends[0][0] if ends else math.inf, next_event) > now:
                for group in sorted(self.ready):
                    self._start(group, now, next_event)
                self.ready.clear()
            if ends and ends[0][0] <= next_event:
                now, group = heapq.heappop(ends)
                if self.handovers and self.groups[group][0].hands_over:
                    heapq.heappop(self.handovers)
                self.busy[group] = False
                self.ready.add(group)
                finished = self._complete(group, now)
                while self.clients and finished and self.sent < len(flow.isl):
                    self._send(now)
                    finished -= 1
            elif next_event == math.inf:
                break
            elif next_transfer <= next_arrival:
                now, rid = heapq.heappop(transfers)
                flow.delivered[rid] = now
                self._route(self.pools[1], rid)
            else:
                now = next_arrival
                self._send(now)

    def _send(self, now: float) -> None:
        self.flow.arrival[self.sent] = now
        self._route(self.pools[0], self.sent)
        self.sent += 1

    def _route(self, pool: _Pool, rid: int) -> None:
        target = pool.route()
        pool.outstanding[target] += 1
        pool.engines[target].waiting.append(rid)
        group = pool.first_group + target // pool.size
        if not self.busy[group]:
            self.ready.add(group)

    def _complete(self, group: int, now: float) -> int:
        """End group `group`'s iteration in flight; returns the requests it finished."""
        pool, members = self.groups[group]
        finished = 0
        for index in members:
            left = pool.engines[index].complete(now)
            if not left:
                continue
            pool.outstanding[index] -= len(left)
            if not pool.hands_over:
                finished += len(left)
                continue
            assert self.links is not None
            for rid in left:
                self.flow.prefilled[rid] = now
                heapq.heappush(self.transfers, (self.links.send(index, self.flow.isl[rid], now), rid))
        return finished

    def _start(self, group: int, now: float, next_event: float) -> None:
        """Start group `group`'s next iteration if any member has work. A wave prices its members' shapes together
        (an idle member's all zeros). An engine alone runs on through iterations that nothing outside it can touch:
        decode-only ones (nothing waiting, no prompt chunk) ending before anything can reach it and, in a closed loop
        (where a finish sends a request), finishing nothing. Groups start in order (prefill groups first), so a
        decode engine's horizon sees the ends of the prefill iterations started at the same time."""
        pool, members = self.groups[group]
        if pool.size > 1:
            states = [pool.engines[index] for index in members]
            if not any(state.running or state.waiting for state in states):
                return
            shapes = [state.schedule(now) for state in states]
            assert pool.wave is not None
            duration = pool.wave(shapes)
            self.iterations.extend((now, duration, len(state.running)) for state in states)
            self._started(group, pool, now + duration)
            return
        index = members.start
        state, time, outstanding = pool.engines[index], pool.time, pool.outstanding
        if self.clients is not None:  # a finish anywhere sends a request
            horizon = min(self.ends[0][0] if self.ends else math.inf, next_event)
        else:  # only arrivals and KV caches reach an engine: the next of them, or the next prefill end that sends some
            horizon = min(self.handovers[0] if self.handovers else math.inf, next_event)
        while state.running or state.waiting:
            duration = time(state.schedule(now))
            self.iterations.append((now, duration, len(state.running)))
            quiet = not state.waiting and not state.chunks
            if not quiet or now + duration >= horizon or (self.clients and state.step + 1 in state.finishing):
                self._started(group, pool, now + duration)
                return
            now += duration
            outstanding[index] -= len(state.complete(now))  # decodes only: finishes, hands nothing over

    def _started(self, group: int, pool: _Pool, end: float) -> None:
        heapq.heappush(self.ends, (end, group))
        if pool.hands_over:
            heapq.heappush(self.handovers, end)
        self.busy[group] = True


def _stream(
    requests: Requests, clients: int | None, warmup_share: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The requests' prompt and output lengths and (open loop) arrivals, checked."""
    isl, osl = np.asarray(requests.isl, dtype=np.int64), np.asarray(requests.osl, dtype=np.int64)
    arrival = None if clients is not None else np.asarray(requests.arrival_s, dtype=float)
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
    return isl, osl, arrival


def _check_engine(engine: Engine, name: str, role: str, wave: WaveTime | None) -> None:
    for what in ("engines", "max_seqs", "max_batched_tokens", "prefill_chunk", "kv_block_tokens", "wave"):
        if getattr(engine, what) < 1:
            raise ValueError(f"{name}.{what} must be at least 1, not {getattr(engine, what)}")
    if engine.role != role:
        raise ValueError(f"{name}.role must be {role!r} here, not {engine.role!r}")
    if engine.engines % engine.wave:
        raise ValueError(f"{name}.engines ({engine.engines}) must be a multiple of {name}.wave ({engine.wave})")
    if engine.wave > 1 and wave is None:
        raise ValueError(f"{name}.wave is {engine.wave}: pass the WaveTime that prices its waves")


def _fits(tokens: np.ndarray, engine: Engine) -> np.ndarray:
    """Whether requests holding `tokens` tokens of KV cache at most fit one engine's whole cache."""
    return -(-tokens // engine.kv_block_tokens) <= engine.kv_capacity_tokens // engine.kv_block_tokens


def _measure(
    flow: Flow,
    iterations: list[tuple[float, float, int]],
    clients: int | None,
    warmup_share: float,
    rejected: int,
    disaggregated: bool,
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
    began, lasted, running = np.array(iterations, dtype=float).reshape(-1, 3).T  # zip(*) of 1e6 tuples took seconds
    overlap = np.clip(np.minimum(began + lasted, end) - np.maximum(began, start), 0.0, None)
    preempted = np.array(flow.preempted_at)
    duration = end - start
    if disaggregated:
        prefilled = np.array(flow.prefilled)[measured]
        prefill_s, transfer_s = prefilled - arrival, np.array(flow.delivered)[measured] - prefilled
    else:
        prefill_s = transfer_s = _none()
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
        prefill_s=prefill_s,
        transfer_s=transfer_s,
    )


def metrics(stats: EventStats, gpus: int, slo: Mapping[str, float] | None = None) -> dict[str, float]:
    """The serving metrics of a simulation on `gpus` GPUs. Goodput counts the requests that meet every bound of `slo`
    (keys like "ttft_p99_s"), each checked against the request's own TTFT / TPOT / E2E: the statistic a key names
    is the one the bound is meant for over all requests, but per request the value is compared directly. A
    disaggregated run's also give the mean prefill (queue included) and KV transfer (link queue included)."""
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
    if len(stats.prefill_s):
        out["prefill_mean_s"] = float(stats.prefill_s.mean())
    if len(stats.transfer_s):
        out["kv_transfer_mean_s"] = float(stats.transfer_s.mean())
    return out
