"""A serving point priced: its engines sized from the memory its steps hold, its load run through the steady state
or the event simulation, and the result as the metrics every other point reports plus the serving ones.

The deployment is `parallel.dp` instances of `tp x pp` GPUs (`parallel.ep` shares experts among instances in
lock step). Each instance keeps `pp` micro-batches in flight, so it is `pp` engines of `max_num_seqs / pp`
sequences each, sharing its KV cache; a request goes to the engine with the fewest outstanding requests.
"""

from dataclasses import dataclass, field

from dse.errors import InfeasibleError, SpecError
from dse.interfaces import CostModel, SimResult, WorkloadGenerator
from dse.modelstats import model_flops
from dse.serving import steady
from dse.serving.iteration import IterationPricer, pricer
from dse.serving.requests import requests
from dse.serving.shapes import Engine
from dse.serving.spec import ServingSpec
from dse.serving.steps import decode_point, step_point
from dse.spec import DesignPoint, WorkloadSpec
from dse.workload import Workload


@dataclass(slots=True)
class ServingResult(SimResult):
    """A serving point's result: the SimResult fields are its typical decode iteration's step (the step_time the
    steady state's iteration time), `serving` the serving metrics (`dse.serving.events.metrics`' keys, and mfu),
    `memory_bytes` what each GPU holds: weights, working memory and the KV cache the engine allocates."""

    serving: dict[str, float] = field(default_factory=dict)
    memory_bytes: float = 0.0
    kv_capacity_tokens: int = 0
    """KV-cache tokens per instance."""
    workload: Workload | None = None
    """The typical decode step's workload (what `dse evaluate --json` and a study's run record describe)."""

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory_bytes


def kv_capacity(point: DesignPoint, prices: IterationPricer) -> tuple[int, float]:
    """(KV-cache tokens one instance holds, bytes each GPU takes with it) from the engine's memory budget: HBM x
    memory_fraction, less the weights and the largest iteration's working memory, over the cache bytes per token."""
    serving = point.workload.serving
    assert serving is not None
    budget = point.system.accelerator.hbm_bytes * serving.kv_cache.memory_fraction
    held = prices.weight_bytes() + prices.working_bytes(serving.scheduler.max_batched_tokens)
    per_token = prices.kv_bytes_per_token()
    if held >= budget:
        raise InfeasibleError(
            f"the weights and working memory take {held / 2**30:.1f} GiB per GPU, over the engine's "
            f"{budget / 2**30:.1f} GiB (hbm x serving.kv_cache.memory_fraction); add GPUs (tp, pp), HBM or "
            "lower serving.scheduler.max_batched_tokens"
        )
    return int((budget - held) / per_token), budget


def engine_of(point: DesignPoint, capacity_tokens: int) -> Engine:
    """The point's engines: an instance's `pp` micro-batches in flight each an engine; with expert parallelism the
    `ep` ranks of a group (and their micro-batches) step in lock step, a wave."""
    serving = point.workload.serving
    assert serving is not None
    pp, scheduler = point.parallel.pp, serving.scheduler
    speculative = serving.speculative
    return Engine(
        engines=point.parallel.dp * pp,
        max_seqs=max(scheduler.max_num_seqs // pp, 1),
        max_batched_tokens=scheduler.max_batched_tokens,
        chunked_prefill=scheduler.chunked_prefill,
        reserve=scheduler.admission == "reserve",
        prefill_chunk=scheduler.chunk,
        kv_capacity_tokens=capacity_tokens // pp,
        kv_block_tokens=serving.kv_cache.block_tokens,
        draft_tokens=speculative.draft_tokens if speculative else 0,
        acceptance=speculative.acceptance if speculative else 0.0,
        wave=point.parallel.ep * pp if point.parallel.ep > 1 else 1,
    )


def load_of(serving: ServingSpec) -> steady.Load:
    """What the steady state reads of the point's load: mean lengths and the rate or concurrency (a trace's mean
    lengths and its mean rate: its requests after the first over the time from the first arrival to the last)."""
    if serving.trace is None:
        assert serving.isl is not None and serving.osl is not None
        return steady.Load(serving.isl, serving.osl, serving.rate_per_s, serving.concurrency)
    stream = requests(serving)
    span = float(stream.arrival_s[-1] - stream.arrival_s[0])
    if len(stream) < 2 or span <= 0:
        raise SpecError(
            f"field 'workload.serving.trace': {serving.trace} has no arrival rate (its requests all arrive at once); "
            "give two or more requests at different arrival_s, or use serving.concurrency"
        )
    return steady.Load(float(stream.isl.mean()), float(stream.osl.mean()), (len(stream) - 1) / span)


def model_flops_per_request(point: DesignPoint, isl: float, osl: float) -> float:
    """Model FLOPs of one request by the convention of `dse.modelstats.model_flops`: its prompt's prefill and its
    output tokens' decodes at their mean context."""
    prompt = WorkloadSpec(mode="prefill", seq_len=max(round(isl), 1), global_batch=1)
    token = WorkloadSpec(mode="decode", seq_len=max(round(isl + osl / 2), 1), global_batch=1)
    return model_flops(point.model, prompt) + (osl - 1) * model_flops(point.model, token)


def deployment(
    point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel
) -> tuple[IterationPricer, Engine, int, float]:
    """The point's iteration prices, its engines, the KV-cache tokens of an instance and the bytes a GPU holds."""
    prices = pricer(point, generator, cost_model)
    capacity, memory = kv_capacity(point, prices)
    return prices, engine_of(point, capacity), capacity, memory


def mfu(point: DesignPoint, metrics: dict[str, float], isl: float, osl: float, gpus: int) -> float:
    """Model FLOPs served per second over the deployment's peak."""
    peak = point.system.accelerator.peak_flops(point.model.dtype) * gpus
    return metrics["requests_per_s"] * model_flops_per_request(point, isl, osl) / peak


def generated_step(point: DesignPoint) -> DesignPoint:
    """What `dse generate` writes of a serving point: a decode iteration of its (decode pool's) instance full,
    max_num_seqs sequences over its pp micro-batches, at the mean context (the prompt and half the output): the
    step its TPOT is made of at full load."""
    serving = point.workload.serving
    assert serving is not None
    pool = decode_point(point) if serving.kind == "disaggregated" else point
    scheduler = pool.workload.serving.scheduler  # type: ignore[union-attr]
    load = load_of(serving)
    seqs = max(scheduler.max_num_seqs // pool.parallel.pp, 1)
    return step_point(pool, "decode", seqs, max(round(load.isl + load.osl / 2), 1))
