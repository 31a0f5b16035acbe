"""The price of one engine iteration, from steps the point's generator builds and its cost model prices.

An iteration's time is a sum of its kernels' times (inference has no gradient traffic to hide; a tensor-parallel
all-reduce waits for its GEMM and the next GEMM waits for it), so it splits into what scales with the tokens of the
iteration and what its attention does:

    time(shape) = linear(tokens) + decode_attention_per_kv_token * decode_kv_tokens
                                  + prefill_attention_per_pair * prefill_pairs

- linear(T): a decode step of T sequences at a context of one token, less its attention: every GEMM with T rows
  (the weights read once), the norms, the KV-cache writes, the tensor-parallel collectives, the pipeline's sends.
  Prefill tokens and decode tokens are the same rows to it, as they are to the engine.
- decode attention: a decode step of b sequences at a context of t, its attention kernels' time per KV token read
  (memory-bound: the cache is read once per step).
- prefill attention: a prefill step of one s-token prompt, its attention time per causal query-key pair
  (compute-bound: FlashAttention's work is proportional to the pairs).

Steps are priced on a grid of shapes (1, 2, 3, 4, 6, 8, 12, ...: two per octave) and cached, so a simulation of
thousands of iterations prices a few dozen steps: linear(T) is interpolated between the two grid points around T,
the attention rates read at the grid point nearest the shape. The steps are the point's own: its model, one
instance of its parallel layout (tp, pp, ep) on the GPUs it takes (`dse.serving.steps`), its generator and its cost
model (the measured kernel tables where the accelerator has them, else the roofline), so a serving study prices its
iterations as consistently as a training study prices its steps.

With pipeline stages, an engine keeps `pp` micro-batches in flight (vLLM's virtual engines): one micro-batch's
iteration is its pass through every stage, which is the step of one micro-batch the generator builds.
"""

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from dse.fields import DTYPE_BYTES
from dse.interfaces import CostModel, SimResult, WorkloadGenerator
from dse.serving.shapes import IterationShape
from dse.serving.steps import step_point
from dse.spec import DesignPoint
from dse.workload import Collective, Workload

GRID = tuple(sorted({2**k for k in range(25)} | {3 * 2**k for k in range(24)}))
"""Step shapes priced: powers of two and 1.5 times them, 1 to 2**24 (two per octave)."""
KV_PROBE_CONTEXT = 1024
"""The context of the decode step whose KV-cache bytes give the bytes per token (any context gives the same)."""
CACHED_INSTANCES = 64
"""Instances (layouts on their GPUs) whose priced steps a process keeps."""


@dataclass(frozen=True, slots=True)
class PricedStep:
    """One generated and priced step, with what the serving models read of it."""

    time_s: float
    attention_s: float
    """The step's time spent in attention kernels (the share of its busy time they take, times its time)."""
    all_to_all_s: float
    """The step's time in the MoE dispatch and combine all-to-alls (0 without experts split over ep)."""
    workload: Workload
    result: SimResult

    def memory(self, kind: str) -> float:
        """The most bytes of one tensor kind any rank class holds at its peak."""
        return max(c.memory_at_peak.get(kind, 0.0) for c in self.result.classes)


def _seconds_in(result: SimResult, category: str) -> float:
    """The step's time in one category of ops: the share of its busy time they take, times its time."""
    busy = sum(sum(c.time_by_category.values()) for c in result.classes)
    spent = sum(c.time_by_category.get(category, 0.0) for c in result.classes)
    return 0.0 if busy == 0 else result.step_time_s * spent / busy


def _bracket(value: float) -> tuple[int, int]:
    """The grid points at or below and at or above `value` (1 <= value <= the grid's last), by arithmetic: the
    event simulation asks this of every iteration."""
    base = 1 << (int(value).bit_length() - 1)  # the power of two at or below
    if value == base:
        return base, base
    middle = 3 * base // 2 if base > 1 else 2
    if value < middle:
        return base, middle
    if value == middle:
        return middle, middle
    return middle, 2 * base


def nearest(value: float) -> int:
    """The grid point nearest `value` in ratio."""
    if value <= 1.0:
        return 1
    low, high = _bracket(value)
    return low if value * value <= low * high else high


class IterationPricer:
    """Prices iterations of one serving point's engines (see the module docstring); `steps` counts those priced."""

    def __init__(self, point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel, steps: "Steps") -> None:
        assert point.workload.serving is not None
        self.point, self.generator, self.cost_model = point, generator, cost_model
        self._steps = steps
        self._rates: dict[tuple, float] = {}
        """What time() reads of the steps, by grid point: the event simulation asks for thousands of iterations."""
        self._by_tokens: dict[float, float] = {}
        """linear() by token count, which an event simulation's iterations repeat."""
        model = point.model
        kv_dtype = point.workload.serving.kv_cache.dtype or model.dtype
        self.kv_scale = DTYPE_BYTES[kv_dtype] / model.dtype_bytes
        """The cache's element size over the model's, which the generated steps store it in: decode attention is
        memory-bound, so its time and the cache's bytes scale by it."""

    @property
    def steps(self) -> int:
        return len(self._steps)

    def step(self, mode: str, batch: int, seq_len: int) -> PricedStep:
        """A prefill or decode step of `batch` sequences per instance at `seq_len`, generated and priced once."""
        key = (mode, batch, seq_len)
        priced = self._steps.get(key)
        if priced is None:
            point = step_point(self.point, mode, batch, seq_len)
            workload = self.generator.generate(point)
            result = self.cost_model.simulate(workload, point.system)
            priced = self._steps[key] = PricedStep(
                result.step_time_s,
                _seconds_in(result, "attention"),
                _seconds_in(result, Collective.ALL_TO_ALL),
                workload,
                result,
            )
        return priced

    def linear(self, tokens: float) -> float:
        """Seconds of an iteration's work that scales with its tokens (GEMMs, norms, collectives), interpolated
        between the grid points around `tokens`."""
        low, high = _bracket(max(tokens, 1.0))
        at_low = self._linear_at(low)
        if high == low:
            return at_low
        share = (tokens - low) / (high - low)
        return at_low + share * (self._linear_at(high) - at_low)

    def _linear_at(self, tokens: int) -> float:
        found = self._rates.get(("linear", tokens))
        if found is None:
            step = self.step("decode", tokens, 1)
            found = self._rates["linear", tokens] = step.time_s - step.attention_s
        return found

    def all_to_all(self, tokens: float) -> float:
        """Seconds of an iteration's MoE all-to-alls when each member of the expert-parallel group sends `tokens`,
        interpolated between the grid points around it (they move bytes in proportion to the tokens)."""
        low, high = _bracket(max(tokens, 1.0))
        at_low = self.step("decode", low, 1).all_to_all_s
        if high == low:
            return at_low
        share = (tokens - low) / (high - low)
        return at_low + share * (self.step("decode", high, 1).all_to_all_s - at_low)

    def wave_time(self, shapes: Sequence[IterationShape]) -> float:
        """Seconds of one wave of an expert-parallel group's engines in lock step (`dse.serving.shapes.WaveTime`),
        as LLMServingSim specifies DP+EP waves: an idle member runs a dummy one-token batch, the all-to-all is
        sized to the member with the most tokens, and the members meet at it, so the wave lasts as long as the
        slowest member's own work plus that all-to-all."""
        members = [shape if shape.tokens else DUMMY_BATCH for shape in shapes]
        largest = max(shape.tokens for shape in members)
        own = max(self.time(shape) - self.all_to_all(shape.tokens) for shape in members)
        return own + self.all_to_all(largest)

    def decode_attention_per_kv_token(self, seqs: float, context: float) -> float:
        b, t = nearest(seqs), nearest(context)
        found = self._rates.get(("decode", b, t))
        if found is None:
            found = self._rates["decode", b, t] = self.kv_scale * self.step("decode", b, t).attention_s / (b * t)
        return found

    def prefill_attention_per_pair(self, pairs_per_chunk: float) -> float:
        s = nearest(math.sqrt(2.0 * pairs_per_chunk))
        found = self._rates.get(("prefill", s))
        if found is None:
            found = self._rates["prefill", s] = self.step("prefill", 1, s).attention_s / (s * (s + 1) / 2)
        return found

    def time(self, shape: IterationShape) -> float:
        """Seconds of one engine iteration of this shape (`dse.serving.shapes.IterationTime`)."""
        tokens = shape.tokens
        if tokens == 0:
            return 0.0
        seconds = self._by_tokens.get(tokens)
        if seconds is None:  # an event simulation's iterations repeat their token counts
            seconds = self._by_tokens[tokens] = self.linear(tokens)
        if shape.decode_seqs:
            context = shape.decode_kv_tokens / shape.decode_seqs
            seconds += self.decode_attention_per_kv_token(shape.decode_seqs, context) * shape.decode_kv_tokens
        if shape.prefill_tokens:
            per_chunk = shape.prefill_pairs / max(shape.prefill_chunks, 1)
            seconds += self.prefill_attention_per_pair(per_chunk) * shape.prefill_pairs
        return seconds

    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token takes on the GPU holding the most (its stage's layers, its share of the heads;
        MLA's latent on every tensor-parallel rank), in the cache's dtype."""
        return self.kv_scale * self.step("decode", 1, KV_PROBE_CONTEXT).memory("kv_cache") / KV_PROBE_CONTEXT

    def weight_bytes(self) -> float:
        return self.step("decode", 1, 1).memory("parameter")

    def working_bytes(self, max_tokens: int) -> float:
        """What the largest iteration (a prefill of max_tokens) holds beside the weights and the cache: activations,
        temporaries and the runtime's reserve, as the engine's profiling run measures them before it sizes the
        cache."""
        step = self.step("prefill", 1, max_tokens)
        return sum(step.memory(kind) for kind in ("activation", "temporary", "reserve"))


DUMMY_BATCH = IterationShape(1.0, 1.0, 1.0, 0.0, 0.0, 0.0)
"""What an idle member of a wave runs: one token decoded at a context of one (LLMServingSim's dummy batch)."""
Steps = dict[tuple[str, int, int], PricedStep]
"""Priced steps of one instance by (mode, batch, seq_len)."""
_STEPS: OrderedDict[tuple, tuple[WorkloadGenerator, CostModel, Steps]] = OrderedDict()
"""Priced steps by instance, generator and cost model; an entry holds the two plugins, so that their ids in its key
cannot be another's while it lives."""


def pricer(point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel) -> IterationPricer:
    """A pricer of the point's iterations over the process's priced steps of its instance (its model, its tp x pp
    layout on the GPUs it takes, its kernels), generator and cost model: a study's points that differ in their load,
    scheduler, cache dtype or number of instances share them."""
    step = step_point(point, "decode", 1, 1)
    key = (
        id(generator),
        id(cost_model),
        step.model.model_dump_json(),
        step.parallel.model_dump_json(),
        step.system.model_dump_json(),
        point.workload.kernels,
        point.workload.attention_kernel,
    )
    entry = _STEPS.get(key)
    if entry is None:
        entry = _STEPS[key] = (generator, cost_model, {})
        if len(_STEPS) > CACHED_INSTANCES:
            _STEPS.popitem(last=False)
    else:
        _STEPS.move_to_end(key)
    return IterationPricer(point, generator, cost_model, entry[2])
