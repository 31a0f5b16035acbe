"""What a serving point's `workload.serving` section holds: the requests, the load, the engine's scheduler and KV
cache, speculative decoding, the SLO and how deep to simulate.

Field names follow the frameworks' own where they agree (vLLM's max_num_seqs, max_num_batched_tokens,
gpu_memory_utilization, block_size; TensorRT-LLM calls them max_batch_size, max_num_tokens,
free_gpu_memory_fraction, tokens_per_block).
"""

from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import Field, model_validator

from dse.fields import Count, Degree, Spec
from dse.limits import MAX_GLOBAL_BATCH, MAX_SEQ_LEN

Tokens = Annotated[Count, Le(MAX_SEQ_LEN)]
SLO_METRICS = tuple(f"{what}_{stat}_s" for what in ("ttft", "tpot", "e2e") for stat in ("mean", "p50", "p90", "p99"))
"""The latency metrics an SLO may bound (`serving.slo`), as the metrics dictionary names them."""


def meets(metrics: dict[str, float], slo: dict[str, float]) -> bool:
    """Whether serving metrics are within every bound of an SLO (`serving.slo`)."""
    return all(metrics[name] <= bound for name, bound in slo.items())


MAX_REQUESTS = 1_000_000
"""Requests one event simulation may run (an event simulation of 10,000 takes a few seconds)."""
MAX_RATE_PER_S = 1e6
REQUESTS = 2000
"""Requests an event simulation runs by default: its p99 rests on the 20 slowest."""


class LengthsSpec(Spec):
    """How prompt and output lengths spread around serving.isl and serving.osl (their means)."""

    distribution: Literal["fixed", "uniform", "lognormal"] = Field(
        "fixed",
        description="fixed: every request has isl and osl tokens; uniform: evenly between (1 - cv * sqrt(3)) and "
        "(1 + cv * sqrt(3)) times the mean; lognormal: a lognormal of that mean and coefficient of variation (the "
        "long tail of chat prompts, ShareGPT's shape)",
    )
    cv: Annotated[float, Ge(0), Le(4)] = Field(0.0, description="coefficient of variation (std / mean) of both")

    @model_validator(mode="after")
    def _check(self) -> "LengthsSpec":
        if (self.distribution == "fixed") != (self.cv == 0):
            raise ValueError("lengths.cv must be 0 with distribution fixed and above 0 otherwise")
        if self.distribution == "uniform" and self.cv * 3**0.5 >= 1:
            raise ValueError(f"lengths.cv={self.cv} would make uniform lengths reach 0; use cv below 0.577")
        return self


class SchedulerSpec(Spec):
    """Continuous batching as vLLM, SGLang and TensorRT-LLM run it, per instance: decodes first, then prompt chunks
    within the token budget, new requests admitted first come first served while seats and KV blocks last; under
    `admission: grow`, when the cache is full the most recently admitted request gives its blocks back and is
    prefilled again later (vLLM's recompute preemption)."""

    max_num_seqs: Annotated[Count, Le(MAX_GLOBAL_BATCH)] = Field(
        256, description="sequences an instance runs at once (vLLM max_num_seqs, TensorRT-LLM max_batch_size)"
    )
    max_batched_tokens: Tokens = Field(
        8192, description="tokens one iteration may process (vLLM max_num_batched_tokens, TensorRT-LLM max_num_tokens)"
    )
    admission: Literal["grow", "reserve"] = Field(
        "grow",
        description="grow: a request is admitted with blocks for its first chunk and given more as its context "
        "grows, the newest preempted when none is free (vLLM, SGLang); reserve: admitted only with blocks for its "
        "whole prompt and output, never preempted (TensorRT-LLM's default GUARANTEED_NO_EVICT)",
    )
    chunked_prefill: bool = Field(
        True,
        description="true: prompts are split into chunks that share iterations with decoding sequences (vLLM V1, "
        "SGLang, TensorRT-LLM); false: whole prompts in prefill-only iterations that come before decodes (vLLM V0)",
    )
    prefill_chunk: Tokens | None = Field(
        None, description="most prompt tokens of one request per iteration; default: max_batched_tokens"
    )

    @property
    def chunk(self) -> int:
        return self.prefill_chunk or self.max_batched_tokens

    @model_validator(mode="after")
    def _check(self) -> "SchedulerSpec":
        if self.prefill_chunk is not None and self.prefill_chunk > self.max_batched_tokens:
            raise ValueError(
                f"scheduler.prefill_chunk={self.prefill_chunk} exceeds scheduler.max_batched_tokens="
                f"{self.max_batched_tokens}; lower it or raise max_batched_tokens"
            )
        if self.max_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"scheduler.max_batched_tokens={self.max_batched_tokens} is below max_num_seqs={self.max_num_seqs}: "
                "an iteration could not decode every sequence (vLLM refuses it too); raise it or lower max_num_seqs"
            )
        if self.prefill_chunk is not None and not self.chunked_prefill:
            raise ValueError("scheduler.prefill_chunk only takes effect with chunked_prefill: true; remove it")
        return self


class KVCacheSpec(Spec):
    """The paged KV cache (MLA models cache their compressed latent and RoPE key, which the model section sets)."""

    block_tokens: Annotated[Count, Le(1024)] = Field(16, description="tokens per block (vLLM block_size)")
    memory_fraction: Annotated[float, Gt(0), Le(1)] = Field(
        0.9,
        description="share of each GPU's HBM the engine may use for weights, activations and the cache (vLLM "
        "gpu_memory_utilization); the cache gets what the weights and the largest iteration's activations leave",
    )
    dtype: Literal["bf16", "fp16", "fp8"] | None = Field(None, description="cache element type; default: model.dtype")


class SpeculativeSpec(Spec):
    """Speculative decoding with multi-token prediction (DeepSeek-V3's MTP, EAGLE): each decode step drafts
    tokens and verifies them in one forward."""

    draft_tokens: Annotated[Count, Le(16)] = Field(description="tokens drafted per decode step")
    acceptance: Annotated[float, Ge(0), Le(1)] = Field(
        description="probability that a drafted token is accepted, given the ones before it were (DeepSeek-V3 "
        "reports 0.85-0.90 for its one MTP token)"
    )


class DecodePoolSpec(Spec):
    """The decode pool of a disaggregated deployment (serving.kind: disaggregated), beside the prefill pool that the
    point's `parallel` then describes: its instances, their layout and their scheduler's limits. Its instances take
    the system's NPUs after the prefill pool's."""

    dp: Degree = Field(1, description="decode instances (with ep: attention data-parallel ranks, ep to a group)")
    tp: Degree = Field(1, description="tensor-parallel degree of a decode instance")
    pp: Degree = Field(1, description="pipeline stages of a decode instance")
    ep: Degree = Field(1, description="expert-parallel group of attention data-parallel ranks (divides dp)")
    max_num_seqs: Annotated[Count, Le(MAX_GLOBAL_BATCH)] = Field(
        256, description="sequences a decode instance runs at once (vLLM max_num_seqs)"
    )
    admission: Literal["grow", "reserve"] = Field(
        "grow", description="as serving.scheduler.admission, for the decode instances (prompts arrive cached)"
    )

    @model_validator(mode="after")
    def _check(self) -> "DecodePoolSpec":
        if self.dp % self.ep:
            raise ValueError(f"serving.decode.ep={self.ep} does not divide serving.decode.dp={self.dp}")
        return self

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


class ServingSpec(Spec):
    """A deployment under a load: `parallel.dp` instances of `tp x pp` GPUs each, serving requests of `isl` prompt
    and `osl` output tokens (or a trace) at a rate or a concurrency."""

    isl: Tokens | None = Field(None, description="prompt (input) tokens per request, the mean under `lengths`")
    osl: Tokens | None = Field(None, description="output tokens per request (the first included), the mean")
    lengths: LengthsSpec = Field(default_factory=LengthsSpec)
    trace: str | None = Field(
        None,
        description="a CSV file of requests with columns arrival_s, isl, osl (relative to the point file's "
        "folder); replaces isl, osl, lengths and rate_per_s",
    )
    rate_per_s: Annotated[float, Gt(0), Le(MAX_RATE_PER_S)] | None = Field(
        None, description="requests per second over the whole deployment (open loop)"
    )
    arrival: Literal["poisson", "uniform"] = Field(
        "poisson", description="how requests arrive at rate_per_s: a Poisson process, or evenly spaced"
    )
    concurrency: Annotated[Count, Le(MAX_GLOBAL_BATCH)] | None = Field(
        None,
        description="clients over the whole deployment, each sending its next request when its last one finishes "
        "(closed loop, as benchmark_serving --max-concurrency and aiconfigurator's batch sizes)",
    )
    max_rate: bool = Field(
        False,
        description="find the highest request rate at which the SLO holds (Vidur-Search's capacity: a bisection "
        "over the rate, each probe at the point's depth) and report the point at it; needs slo, and neither "
        "rate_per_s nor concurrency",
    )
    requests: Annotated[Count, Le(MAX_REQUESTS)] = Field(REQUESTS, description="requests the event simulation runs")
    depth: Literal["steady", "events"] = Field(
        "steady",
        description="steady: a closed form from the load to the iteration time to the latencies (no queueing, no "
        "spread: percentiles equal means); events: a request-level simulation with queueing, KV capacity and "
        "preemption, for percentiles",
    )
    seed: Annotated[int, Ge(0), Le(2**31)] = Field(0, description="seed of the request stream")
    warmup: Annotated[float, Ge(0), Lt(1)] = Field(
        0.0,
        description="share of the first requests (arrivals; in a closed loop, completions) the event simulation "
        "leaves out of its measurement; 0: every one, as benchmark_serving and genai-perf measure, the first wave of "
        "a closed loop's clients (all sending at once) included",
    )
    kind: Literal["aggregated", "disaggregated"] = Field(
        "aggregated",
        description="aggregated: every instance (`parallel`) prefills and decodes its own requests; disaggregated: "
        "`parallel` is a pool of prefill instances and serving.decode a pool of decode instances, each request "
        "prefilled in one, its KV cache moved over the network, and decoded in the other (DistServe, Splitwise, "
        "Dynamo, llm-d)",
    )
    decode: DecodePoolSpec | None = Field(
        None, description="with kind disaggregated: the decode pool (the point's parallel is then the prefill pool)"
    )
    kv_transfer: Literal["whole", "layers"] = Field(
        "whole",
        description="with kind disaggregated, when a prompt's KV cache moves to the decode pool: whole, once its "
        "prefill ends (vLLM's NIXL connector, Dynamo, SGLang); layers, each layer's as its prefill ends, beside the "
        "later layers' compute (Splitwise), so that only what outlasts the prefill is exposed",
    )
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    speculative: SpeculativeSpec | None = None
    slo: dict[str, Annotated[float, Gt(0)]] = Field(
        default_factory=dict,
        description="latency bounds in seconds by metric (ttft_p99_s: 2.0, tpot_p99_s: 0.05, ...): a request meets "
        "them for goodput, and meets_slo is the constraint that the deployment does",
    )

    @model_validator(mode="after")
    def _check(self) -> "ServingSpec":
        if self.trace is not None:
            given = [name for name in ("isl", "osl", "rate_per_s") if getattr(self, name) is not None]
            if given or self.lengths.distribution != "fixed":
                raise ValueError(
                    f"serving.trace gives every request's arrival and lengths, so serving."
                    f"{given[0] if given else 'lengths'} would be ignored; remove it"
                )
            if self.concurrency is not None or self.max_rate:
                raise ValueError(
                    "serving.trace gives arrivals, so serving.concurrency or max_rate would be ignored; remove it"
                )
        else:
            for name in ("isl", "osl"):
                if getattr(self, name) is None:
                    raise ValueError(f"serving.{name} is missing; give it, or a serving.trace")
            loads = [name for name in ("rate_per_s", "concurrency", "max_rate") if getattr(self, name)]
            if len(loads) != 1:
                raise ValueError(
                    "give serving.rate_per_s (open loop), serving.concurrency (closed loop) or serving.max_rate "
                    f"(the highest rate meeting the SLO), one of them{'; not ' + ' and '.join(loads) if loads else ''}"
                )
            if self.max_rate and not self.slo:
                raise ValueError("serving.max_rate needs serving.slo: the bounds the highest rate must meet")
        if self.concurrency is not None and self.arrival != "poisson":
            raise ValueError("serving.arrival only takes effect with a rate; remove it with concurrency")
        if self.depth == "events" and self.concurrency is not None and self.requests < 2 * self.concurrency:
            raise ValueError(
                f"serving.requests={self.requests} is too few for concurrency {self.concurrency}: a closed loop is "
                "measured once its clients are busy and until they run out of requests; give at least "
                f"{2 * self.concurrency}"
            )
        if self.depth == "steady":
            spread = {
                "requests": self.requests != REQUESTS,
                "seed": self.seed != 0,
                "arrival": self.arrival != "poisson",
                "lengths": self.lengths.distribution != "fixed",
                "warmup": self.warmup != 0.0,
            }
            ignored = next((name for name, set_ in spread.items() if set_), None)
            if ignored is not None:
                raise ValueError(
                    f"serving.{ignored} only takes effect with depth events (the steady state reads mean lengths "
                    "and rates, not a drawn stream); remove it or set serving.depth: events"
                )
        if self.kind == "disaggregated" and self.decode is None:
            raise ValueError(
                "serving.kind disaggregated needs serving.decode, its decode pool (dp, tp, pp, ep, max_num_seqs); "
                "give it, or use kind aggregated"
            )
        for name in self.slo:
            if name not in SLO_METRICS:
                raise ValueError(f"serving.slo.{name} is not a latency metric; use one of {', '.join(SLO_METRICS)}")
        return self
