"""What the serving models exchange: the work of one engine iteration, and a stream of requests.

An iteration of a continuous-batching engine (vLLM, SGLang, TensorRT-LLM) runs one forward pass over every token it
scheduled: one (or, with speculative decoding, 1 + draft) token of each decoding sequence, and chunks of prompts
being prefilled. Its GEMMs, norms and tensor-parallel collectives see all those tokens as one batch; its attention
reads each decoding sequence's KV cache (memory-bound: proportional to the KV tokens read) and computes each prefill
chunk's causal scores (compute-bound: proportional to the query-key pairs). Four sums describe it for a cost that
is linear in each, which is what `IterationShape` holds.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(slots=True)
class IterationShape:
    """One engine iteration's work (all counts for one engine, i.e. one instance's micro-batch in flight). The event
    simulation gives whole counts; the steady state gives means, which may be fractional."""

    decode_seqs: float
    """Sequences decoding in this iteration."""
    decode_tokens: float
    """Tokens they process: decode_seqs, or decode_seqs * (1 + draft tokens) under speculative decoding."""
    decode_kv_tokens: float
    """KV-cache tokens their attention reads: the sum of their context lengths."""
    prefill_tokens: float
    """Prompt tokens prefilled in this iteration (chunks of one or more requests)."""
    prefill_pairs: float
    """Causal query-key pairs of those chunks: a chunk of n tokens after p cached ones has n * p + n * (n + 1) / 2."""
    prefill_chunks: float = 0
    """How many chunks (requests) the prefill tokens belong to: an attention kernel's speed depends on the length
    of each, which pairs / chunks gives."""

    @property
    def tokens(self) -> float:
        """Rows of every GEMM in the iteration."""
        return self.decode_tokens + self.prefill_tokens


IterationTime = Callable[[IterationShape], float]
"""Seconds of one engine iteration of a given shape (`dse.serving.iteration.IterationPricer.time`)."""
WaveTime = Callable[[Sequence[IterationShape]], float]
"""Seconds of one wave of engines in lock step, given each member's shape (an idle member's all zeros):
`dse.serving.iteration.IterationPricer.wave_time`."""


def chunk_pairs(tokens: float, cached: float) -> float:
    """Causal query-key pairs of a prefill chunk of `tokens` after `cached` tokens already in the KV cache."""
    return tokens * cached + tokens * (tokens + 1) / 2


def prompt_chunks(isl: float, size: float) -> list[tuple[float, float]]:
    """A prompt of `isl` tokens in chunks of at most `size`, each as (tokens, tokens cached before it)."""
    out, done = [], 0.0
    while done < isl:
        tokens = min(size, isl - done)
        out.append((tokens, done))
        done += tokens
    return out


@dataclass(frozen=True)
class Requests:
    """A request stream, sorted by arrival: arrival times (s), prompt (input) lengths and output lengths (tokens).
    In a closed loop (a concurrency instead of a rate) `arrival_s` is unused: each client sends its next request when
    its previous one has finished."""

    arrival_s: np.ndarray
    isl: np.ndarray
    osl: np.ndarray

    def __len__(self) -> int:
        return len(self.isl)


@dataclass(frozen=True)
class Engine:
    """One engine's scheduler and KV cache, as the serving models read them (built from the point's `serving`
    section and the deployment's memory by `dse.serving.deployment`). A deployment runs `engines` of them alike:
    its instances (data-parallel replicas) times the micro-batches each keeps in flight through its pipeline stages
    (vLLM's virtual engines), each with its own share of the instance's sequences and KV cache."""

    engines: int
    """Engines alike in the deployment; requests are routed to the one with the fewest outstanding requests."""
    max_seqs: int
    """Sequences an engine runs at once (vLLM max_num_seqs, TensorRT-LLM max_batch_size)."""
    max_batched_tokens: int
    """Tokens an iteration may process (vLLM max_num_batched_tokens, TensorRT-LLM max_num_tokens)."""
    chunked_prefill: bool
    """True: a prompt may be split over iterations and mixed with decodes (vLLM V1, SGLang, TensorRT-LLM);
    False: a prompt is prefilled whole in an iteration of prompts only, which takes priority over decodes (vLLM V0)."""
    prefill_chunk: int
    """Most prompt tokens of one request in one iteration (<= max_batched_tokens)."""
    kv_capacity_tokens: int
    """KV-cache tokens the engine holds (its share of the instance's paged cache)."""
    kv_block_tokens: int
    """Tokens per KV-cache block: a sequence holds ceil(context / block) blocks."""
    reserve: bool = False
    """Admission reserves a request's whole prompt + output of KV blocks, so that no sequence is ever preempted
    (TensorRT-LLM's GUARANTEED_NO_EVICT); False: blocks are allocated as the context grows and the newest sequence
    is preempted when none is free (vLLM's)."""
    draft_tokens: int = 0
    """Speculative decoding (MTP): tokens drafted per decode step, verified in the same forward; 0: none."""
    acceptance: float = 0.0
    """Probability that each drafted token is accepted (given the previous one was)."""
    role: Literal["both", "prefill", "decode"] = "both"
    """both: the engine prefills and decodes its requests (an aggregated deployment); prefill: it only prefills, and
    a request leaves it when its prompt is done (its KV cache then moves to a decode engine); decode: requests
    arrive with their prompt's KV cache in place and it decodes all their output tokens, the first in their first
    iteration (a disaggregated deployment's two pools)."""
    wave: int = 1
    """Engines that step in lock step (the attention data-parallel ranks of an expert-parallel group, which meet at
    every MoE layer's all-to-all): consecutive engines of the deployment in groups of this many; a wave's time is
    `WaveTime` of its members' shapes (LLMServingSim's DP+EP waves)."""

    @property
    def tokens_per_decode(self) -> float:
        """Expected tokens a sequence gains per decode iteration: 1 + a + a^2 + ... + a^k for k drafted tokens
        accepted each with probability a in order (Leviathan et al. 2023, eq. 1)."""
        a, k = self.acceptance, self.draft_tokens
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
