"""Pipeline schedules: the order in which one stage runs forward (F) and backward (B) micro-batches."""

from typing import Literal

Step = tuple[Literal["F", "B"], int]


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


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}
