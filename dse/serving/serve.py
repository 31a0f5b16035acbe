"""Pricing a serving point: an aggregated deployment (every instance prefills and decodes) or a disaggregated one
(`dse.serving.pools`), at the point's depth and load, and every request's latencies for the CDFs."""

from dataclasses import replace

from dse.interfaces import CostModel, WorkloadGenerator
from dse.serving import events, pools, steady
from dse.serving.capacity import at_highest_rate
from dse.serving.deployment import ServingResult, deployment, load_of, mfu
from dse.serving.iteration import nearest
from dse.serving.requests import requests
from dse.spec import DesignPoint


def latencies(point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel) -> events.EventStats:
    """Every measured request's TTFT, TPOT and end-to-end latency under the point's load, from the event simulation
    whatever the point's depth (for latency CDFs; a max_rate point at its own load is refused)."""
    serving = point.workload.serving
    assert serving is not None and not serving.max_rate, "a load, not max_rate"
    if serving.concurrency is not None:  # a steady point may have more clients than its default stream measures
        serving = serving.model_copy(update={"requests": max(serving.requests, 2 * serving.concurrency)})
    if serving.kind == "disaggregated":
        return pools.simulate(point, pools.deployment(point, generator, cost_model), serving)
    prices, engine, _, _ = deployment(point, generator, cost_model)
    steady.seats(engine, load_of(serving))  # an engine that cannot seat one request cannot serve at any depth
    return events.simulate(
        requests(serving), engine, prices.time, serving.concurrency, serving.warmup, wave=prices.wave_time
    )


def serve(point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel) -> ServingResult:
    """Price a serving point at its `serving.depth` (and, with `max_rate`, at the highest rate meeting its SLO); an
    InfeasibleError if it cannot run (memory, or a rate beyond what it sustains under the steady state)."""
    serving = point.workload.serving
    assert serving is not None
    if serving.kind == "disaggregated":
        return pools.serve(point, generator, cost_model)
    prices, engine, capacity, memory = deployment(point, generator, cost_model)
    load = load_of(serving)
    isl, osl = load.isl, load.osl
    most = steady.seats(engine, load)  # an engine that cannot seat one request cannot serve at any depth
    gpus = point.parallel.world

    def measure(rate: float | None) -> dict[str, float]:
        """The serving metrics at this rate (None: the point's own load)."""
        spec = serving if rate is None else serving.model_copy(update={"rate_per_s": rate})
        if spec.depth == "steady":
            at = load if rate is None else replace(load, rate_per_s=rate)
            return steady.metrics(steady.steady_state(engine, prices.time, at), at, engine.engines, gpus, spec.slo)
        stats = events.simulate(
            requests(spec), engine, prices.time, spec.concurrency, spec.warmup, wave=prices.wave_time
        )
        return events.metrics(stats, gpus, spec.slo or None)

    if serving.max_rate:
        full = steady.closed(engine, prices.time, most, load)
        metrics = at_highest_rate(measure, full.requests_per_s * engine.engines, serving.slo)
    else:
        metrics = measure(None)
    metrics["mfu"] = mfu(point, metrics, isl, osl, gpus)
    metrics["kv_capacity_tokens"] = float(capacity)
    typical = prices.step("decode", nearest(metrics["concurrency_mean"] / engine.engines), nearest(isl + osl / 2))
    return ServingResult(
        step_time_s=metrics["tpot_mean_s"] * engine.tokens_per_decode,
        classes=typical.result.classes,
        timeline=typical.result.timeline,
        serving=metrics,
        memory_bytes=memory,
        kv_capacity_tokens=capacity,
        workload=typical.workload,
    )
