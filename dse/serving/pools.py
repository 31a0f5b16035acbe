"""A disaggregated serving point as two pools: the prefill pool (the point's `parallel`) and the decode pool
(`serving.decode`), each priced as an aggregated point's instances are (`dse.serving.iteration`, on one instance's
own GPUs), the KV link between them (`dse.serving.transfer`), and the deployment served at the point's depth: the
steady state of `dse.serving.disaggregated` or the event simulation of both pools and the links.

The decode pool's scheduler admits requests whose prompts arrive cached, so its token budget is its sequences' own
decode tokens (max_num_seqs x (1 + draft tokens)), and its working memory that of such an iteration.
"""

from dataclasses import dataclass, replace

from dse.fields import DTYPE_BYTES
from dse.interfaces import CostModel, WorkloadGenerator
from dse.serving import disaggregated, events, steady
from dse.serving.capacity import at_highest_rate
from dse.serving.deployment import ServingResult, engine_of, kv_capacity, load_of, mfu
from dse.serving.disaggregated import Pool, Pools
from dse.serving.iteration import IterationPricer, nearest, pricer
from dse.serving.requests import requests
from dse.serving.spec import ServingSpec
from dse.serving.steps import decode_point
from dse.serving.transfer import kv_link, meeting_depth, spans
from dse.spec import DesignPoint


@dataclass(frozen=True)
class Deployment:
    """A disaggregated point's pools and what priced them."""

    pools: Pools
    prefill: IterationPricer
    decode: IterationPricer
    kv_capacity_tokens: int
    """KV-cache tokens of a decode instance."""
    memory_bytes: float


def deployment(point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel) -> Deployment:
    """Both pools' engines sized from their memory, their iteration prices and the KV link between them; an
    InfeasibleError if either cannot hold one request."""
    serving = point.workload.serving
    assert serving is not None
    load = load_of(serving)
    prefill_prices = pricer(point, generator, cost_model)
    prefill_tokens, memory = kv_capacity(point, prefill_prices)
    prefill = replace(engine_of(point, prefill_tokens), role="prefill")
    steady.seats(prefill, replace(load, osl=1.0))  # a prefill engine holds a prompt until it is done
    at_decode = decode_point(point)
    decode_prices = pricer(at_decode, generator, cost_model)
    decode_tokens, _ = kv_capacity(at_decode, decode_prices)
    decode = replace(engine_of(at_decode, decode_tokens), role="decode")
    steady.seats(decode, load)
    p, d = point.parallel, at_decode.parallel
    units = (p.tp * p.pp * p.ep, d.tp * d.pp * d.ep)
    depth = meeting_depth(point.system, *units)
    busiest = []  # the largest iteration of each pool whose instances' collectives cross the dimension too
    if spans(point.system, depth, units[0]):
        busiest.append(prefill_prices.step("prefill", 1, serving.scheduler.max_batched_tokens))
    if spans(point.system, depth, units[1]):
        busiest.append(decode_prices.step("decode", nearest(decode.max_seqs), nearest(load.isl + load.osl / 2)))
    link = kv_link(
        point.model,
        point.system,
        DTYPE_BYTES[serving.kv_cache.dtype or point.model.dtype],
        p.tp * p.pp,
        decode_prices.kv_bytes_per_token(),
        depth,
        serving.kv_transfer == "layers",
        max((step.result.comm_time_s / step.time_s for step in busiest), default=0.0),
    )
    pools = Pools(Pool(prefill, prefill_prices.time, p.world), Pool(decode, decode_prices.time, d.world), link, p.dp)
    return Deployment(pools, prefill_prices, decode_prices, decode_tokens, memory)


def simulate(point: DesignPoint, built: Deployment, serving: ServingSpec) -> events.EventStats:
    """The event simulation of both pools and the links under the serving section's load."""
    pools = built.pools
    return events.simulate_disaggregated(
        requests(serving),
        pools.prefill.engine,
        pools.decode.engine,
        pools.prefill.time,
        pools.decode.time,
        lambda isl: pools.link.seconds(isl, disaggregated.prompt_alone(pools.prefill.time, isl)),
        serving.concurrency,
        serving.warmup,
        engines_per_link=point.parallel.pp,
        prefill_wave=built.prefill.wave_time,
        decode_wave=built.decode.wave_time,
    )


def serve(point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel) -> ServingResult:
    """Price a disaggregated serving point (see `dse.serving.serve.serve`)."""
    serving = point.workload.serving
    assert serving is not None and serving.decode is not None
    built = deployment(point, generator, cost_model)
    pools, load = built.pools, load_of(serving)
    gpus = pools.prefill.gpus + pools.decode.gpus
    capacity = disaggregated.capacities(pools, load)

    def measure(rate: float | None) -> dict[str, float]:
        spec = serving if rate is None else serving.model_copy(update={"rate_per_s": rate})
        if spec.depth == "steady":
            at = load if rate is None else replace(load, rate_per_s=rate)
            return disaggregated.metrics(disaggregated.steady_state(pools, at), at, gpus, spec.slo)
        return events.metrics(simulate(point, built, spec), gpus, spec.slo or None)

    metrics = at_highest_rate(measure, min(capacity.values()), serving.slo) if serving.max_rate else measure(None)
    metrics["mfu"] = mfu(point, metrics, load.isl, load.osl, gpus)
    metrics["kv_capacity_tokens"] = float(built.kv_capacity_tokens)
    metrics |= {f"{stage}_capacity_per_s": sustained for stage, sustained in capacity.items()}
    metrics["balanced_decode_gpu_share"] = disaggregated.balanced_decode_share(
        capacity, pools.prefill.gpus, pools.decode.gpus
    )
    decode = pools.decode.engine
    held = metrics["concurrency_mean"] * pools.decode.gpus / gpus / decode.engines
    typical = built.decode.step("decode", nearest(held), nearest(load.isl + load.osl / 2))
    return ServingResult(
        step_time_s=metrics["tpot_mean_s"] * decode.tokens_per_decode,
        classes=typical.result.classes,
        timeline=typical.result.timeline,
        serving=metrics,
        memory_bytes=built.memory_bytes,
        kv_capacity_tokens=built.kv_capacity_tokens,
        workload=typical.workload,
    )
