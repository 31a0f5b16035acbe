"""Pipeline schedules: the order in which one stage runs forward (F) and backward (B) micro-batches, and how many
micro-batches show a schedule's steady state (`steady_microbatches`).

`gpipe` and `one_f_one_b` give (step, micro-batch) pairs for a stage holding one model chunk; `interleaved`
gives (step, micro-batch, chunk) for a stage holding `chunks` model chunks (Narayanan et al. 2021's interleaved
1F1B, as Megatron-LM orders it).
"""

from typing import Literal

from dse.spec import DesignPoint

Step = tuple[Literal["F", "B"], int]
ChunkStep = tuple[Literal["F", "B"], int, int]


def gpipe(stages: int, stage: int, microbatches: int) -> list[Step]:
    """All forwards, then all backwards: every stage keeps all micro-batches' activations."""
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]


def one_f_one_b(stages: int, stage: int, microbatches: int) -> list[Step]:
    """PipeDream-flush 1F1B: stage s runs p-s-1 warm-up forwards, then alternates, so at most p-s
    micro-batches are in flight on it."""
    warmup = min(stages - stage - 1, microbatches)
    steps: list[Step] = [("F", i) for i in range(warmup)]
    for j in range(microbatches - warmup):
        steps += [("F", warmup + j), ("B", j)]
    steps += [("B", i) for i in range(microbatches - warmup, microbatches)]
    return steps


def interleaved(stages: int, stage: int, microbatches: int, chunks: int) -> list[ChunkStep]:
    """Interleaved 1F1B: micro-batches go through the stage's chunks in groups of `stages`; the stage runs
    (p - s - 1) * 2 + (v - 1) * p warm-up forwards, then alternates, then drains. Needs microbatches % stages
    == 0."""
    total = microbatches * chunks
    group = stages * chunks

    def forward(k: int) -> ChunkStep:
        return ("F", (k // group) * stages + k % stages, (k % group) // stages)

    def backward(k: int) -> ChunkStep:
        return ("B", (k // group) * stages + k % stages, chunks - 1 - (k % group) // stages)

    if chunks == 1:
        return [(step, mb, 0) for step, mb in one_f_one_b(stages, stage, microbatches)]
    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    steps = [forward(k) for k in range(warmup)]
    for j in range(total - warmup):
        steps += [forward(warmup + j), backward(j)]
    steps += [backward(k) for k in range(total - warmup, total)]
    return steps


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


LINK_CYCLE = 6
"""Periods after which the state of shared network links repeats, at most, as the analytical model schedules
them: calls repeat every period, but which transfer last used a link shared by pipeline sends and collectives (or
ring-attention sends) can cycle over 2 or 3 periods, and the drain after the steady state starts where in that
cycle the step is. A steady form with a whole number of such cycles fewer than the step starts its drain in the
same place."""


def steady_microbatches(point: DesignPoint) -> int | None:
    """Micro-batches of the step's SteadyForm, or None when it has none (see `Pipeline.steady_form`).

    A 1F1B stage runs up to p - 1 warm-up forwards and as many drain backwards, and its timing settles within
    about p micro-batches of steady state, so 2p + 2 micro-batches leave a few steady periods on every stage;
    interleaved stages repeat every p micro-batches and warm up and drain for up to about two of those groups
    each, so they take 6p. To those, as many periods as make the difference to the step a multiple of LINK_CYCLE.
    Only training with those schedules has one: GPipe holds every micro-batch's activations, so its memory grows
    with them, and inference holds a KV cache per micro-batch."""
    p = point.parallel
    if point.workload.mode != "train" or p.pp_schedule not in ("1f1b", "interleaved"):
        return None
    period = steady_period(point)
    base = 6 * p.pp if period > 1 else 2 * p.pp + 2
    short = base + (point.micro_batches - base) % (LINK_CYCLE * period)
    return short if point.micro_batches > short else None


def steady_period(point: DesignPoint) -> int:
    """Micro-batches after which a steady pipeline stage repeats its calls: one for 1F1B, a group of p for
    interleaved 1F1B (each chunk's micro-batches go through the stages in groups of p)."""
    p = point.parallel
    return p.pp if p.pp_schedule == "interleaved" and p.virtual_stages > 1 else 1
