"""Pipeline schedules: the order in which one stage runs forward (F) and backward (B) micro-batches, and, for
zero-bubble schedules, the deferred weight-gradient halves of backwards (W); and how many micro-batches show a
schedule's steady state (`steady_microbatches`).

`gpipe`, `one_f_one_b` and `zb_h1` give (step, micro-batch) pairs for a stage holding one model chunk;
`interleaved` gives (step, micro-batch, chunk) for a stage holding `chunks` model chunks (Narayanan et al. 2021's
interleaved 1F1B, in Megatron-core's order: `forward_backward_pipelining_with_interleaving`).
"""

from typing import Literal

from dse.spec import DesignPoint

Step = tuple[Literal["F", "B", "W"], int]
ChunkStep = tuple[Literal["F", "B", "W"], int, int]


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


def zb_h1(stages: int, stage: int, microbatches: int) -> list[Step]:
    """Zero-bubble H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3.1): 1F1B with each backward split
    into B (the input gradient, which the previous stage waits for) and W (the weight gradient, which nothing
    waits for). Stage s runs 1F1B's p-s-1 warm-up forwards, then s forwards each followed by a B alone, then F B W
    while forwards remain, then B W, then the s W it held back (the order of the authors' DeepSpeed
    ZeroBubbleH1Pipeline with exact semantics). The deferred W fill the warm-up and drain bubbles, which shrink
    from (p-1)(T_F + T_B + T_W) to (p-1)(T_F + T_B - T_W) while T_W <= T_F and T_W <= T_B (a transformer layer's
    weight-gradient GEMMs are its forward's GEMMs, less than its forward with attention), and no stage holds more
    than p micro-batches' activations, 1F1B's peak."""
    warmup = min(stages - stage - 1, microbatches)
    steps: list[Step] = [("F", i) for i in range(warmup)]
    held = min(stage, microbatches - warmup)
    for j in range(microbatches - warmup):
        steps += [("F", warmup + j), ("B", j)] + ([("W", j - held)] if j >= held else [])
    for j in range(microbatches - warmup, microbatches):
        steps += [("B", j), ("W", j - held)]
    return steps + [("W", j) for j in range(microbatches - held, microbatches)]


def chunk_order(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in the order a stage runs its forwards: `group` micro-batches through chunk 0, the same
    through chunk 1, ..., then the next group; the last group takes every micro-batch left (Megatron-core's
    `get_schedule_table` with microbatch_group_size_per_vp_stage = group)."""
    order = []
    for low in range(0, microbatches, group):
        high = microbatches if low + group >= microbatches else low + group
        order += [(mb, chunk) for chunk in range(chunks) for mb in range(low, high)]
    return order


def interleaved(stages: int, stage: int, microbatches: int, chunks: int, group: int | None = None) -> list[ChunkStep]:
    """Interleaved 1F1B as Megatron-core runs it: forwards in `chunk_order`, backwards in the same order with the
    chunks reversed; stage s runs (p - s - 1) * 2 + (v - 1) * group warm-up forwards (all of them if fewer),
    then one forward and one backward at a time, then drains. `group` defaults to p, Megatron's; it must lie in
    [p, microbatches] and leave a last group of 0 or at least p micro-batches (`feasibility`), else the
    pipeline waits on its own dependencies. Each stage is then busy for (m v + p - 1) chunk forwards and
    backwards, the bubble (p - 1) / (v m) of Narayanan et al."""
    group = group or stages
    if chunks == 1:
        return [(step, mb, 0) for step, mb in one_f_one_b(stages, stage, microbatches)]
    order = chunk_order(microbatches, chunks, group)
    forwards: list[ChunkStep] = [("F", mb, chunk) for mb, chunk in order]
    backwards: list[ChunkStep] = [("B", mb, chunks - 1 - chunk) for mb, chunk in order]
    total = len(order)
    warmup = interleaved_warmup(stages, stage, microbatches, chunks, group)
    steps = forwards[:warmup]
    for j in range(total - warmup):
        steps += [forwards[warmup + j], backwards[j]]
    return steps + backwards[total - warmup :]


def interleaved_warmup(stages: int, stage: int, microbatches: int, chunks: int, group: int) -> int:
    """Forwards an interleaved stage runs before its first backward (Megatron-core's get_pp_rank_microbatches)."""
    return min((stages - stage - 1) * 2 + (chunks - 1) * group, microbatches * chunks)


def microbatch_group(point: DesignPoint) -> int:
    """Micro-batches an interleaved stage runs through one chunk before the next: parallel.microbatch_group, by
    default pp (Megatron's microbatch_group_size_per_vp_stage and its default)."""
    p = point.parallel
    return p.microbatch_group or p.pp


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1}


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
    interleaved and ZB-H1 stages repeat every several micro-batches (`steady_period`) and warm up and drain for up
    to about two of those periods each, so they take 6 periods. To those, as many periods as make the difference to
    the step a multiple of LINK_CYCLE (which keeps an interleaved step's last, shorter group too). Only training
    with those schedules has one: GPipe holds every micro-batch's activations, so its memory grows with them, and
    inference holds a KV cache per micro-batch."""
    p = point.parallel
    if point.workload.mode != "train" or p.pp_schedule not in ("1f1b", "interleaved", "zb_h1"):
        return None
    period = steady_period(point)
    base = 6 * period if period > 1 else 2 * p.pp + 2
    short = base + (point.micro_batches - base) % (LINK_CYCLE * period)
    return short if point.micro_batches > short else None


def steady_period(point: DesignPoint) -> int:
    """Micro-batches after which a steady pipeline stage repeats its calls and their timing: one for 1F1B, a group
    (`microbatch_group`) for interleaved 1F1B, p for ZB-H1 (its calls repeat every micro-batch, but with stage s
    holding back s weight gradients, the stages' transfers settle into a pattern that repeats every p)."""
    p = point.parallel
    if p.pp_schedule == "zb_h1":
        return p.pp
    return microbatch_group(point) if p.pp_schedule == "interleaved" and p.virtual_stages > 1 else 1
