"""Pipeline schedules: the order in which one stage runs forward (F) and backward (B) micro-batches.

`gpipe` and `one_f_one_b` give (step, micro-batch) pairs for a stage holding one model chunk; `interleaved`
gives (step, micro-batch, chunk) for a stage holding `chunks` model chunks (Narayanan et al. 2021's interleaved
1F1B, as Megatron-LM orders it).
"""

from typing import Literal

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


def forward_only(stages: int, stage: int, microbatches: int) -> list[Step]:
    """Inference: forwards only, in micro-batch order."""
    return [("F", i) for i in range(microbatches)]


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
