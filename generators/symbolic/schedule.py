"""Pipeline schedules: the order in which one stage runs forward (F) and backward (B) micro-batches, and, for
zero-bubble schedules, the deferred weight-gradient halves of backwards (W); and how many micro-batches show a
schedule's steady state (`steady_form`).

`gpipe`, `one_f_one_b` and `zb_h1` give (step, micro-batch) pairs for a stage holding one model chunk;
`interleaved` gives (step, micro-batch, chunk) for a stage holding `chunks` model chunks (Narayanan et al. 2021's
interleaved 1F1B, in Megatron-core's order: `forward_backward_pipelining_with_interleaving`); `dualpipev` gives
them for a stage holding two chunks placed in a V (`Placement`).
"""

from collections import defaultdict, deque
from collections.abc import Callable
from functools import lru_cache
from typing import Literal, NamedTuple

from dse.spec import DesignPoint
from dse.workload import Program, SteadyForm

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


def dualpipev(stages: int, stage: int, microbatches: int) -> list[ChunkStep]:
    """DualPipeV (the V-shaped, single-copy form of DeepSeek-V3's DualPipe, deepseek-ai/DualPipe's dualpipev.py):
    stage s holds chunk 0 (virtual stage s) and chunk 1 (virtual stage 2p-1-s), micro-batches enter at stage 0 and
    the backward is split into B and W as in ZB-H1. Its eight phases, for r = p - s - 1 stages after this one:
    2r forwards of chunk 0; s + 1 pairs F0 F1; r times B1 W F1 (the W at once); m - 2p + s + 1 times F0 B1 F1 B0
    (the overlapped forward-and-backward pairs: our engine runs one compute stream, so each pair runs as its F then
    its B, what DualPipe does without its communication-computation overlap); r times B1 F1 B0; s + 1 pairs B1 B0,
    the second half of them deferring their W; r times W B0 (deferred); the s + 1 deferred W left. Backwards not
    deferred run their W right after their B. Feasibility keeps m >= 2p, as dualpipev.py asserts."""
    count = {"F": [0, 0], "B": [0, 0]}
    deferred: deque[tuple[int, int]] = deque()
    steps: list[ChunkStep] = []

    def forward(chunk: int) -> None:
        steps.append(("F", count["F"][chunk], chunk))
        count["F"][chunk] += 1

    def backward(chunk: int, defer: bool = False) -> None:
        mb = count["B"][chunk]
        count["B"][chunk] += 1
        steps.append(("B", mb, chunk))
        if defer:
            deferred.append((mb, chunk))
        else:
            steps.append(("W", mb, chunk))

    def weight() -> None:
        mb, chunk = deferred.popleft()
        steps.append(("W", mb, chunk))

    after = stages - stage - 1
    for _ in range(2 * after):
        forward(0)
    for _ in range(stage + 1):
        forward(0)
        forward(1)
    for _ in range(after):
        backward(1, defer=True)
        weight()
        forward(1)
    for _ in range(microbatches - 2 * stages + stage + 1):
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(after):
        backward(1)
        forward(1)
        backward(0)
    defer = False
    for i in range(stage + 1):  # the second half defers its W (from B1 on odd stages, from B0 on even ones)
        defer = defer or (i == (stage + 1) // 2 and stage % 2 == 1)
        backward(1, defer)
        defer = defer or (i == (stage + 1) // 2 and stage % 2 == 0)
        backward(0, defer)
    for _ in range(after):
        weight()
        backward(0, defer=True)
    for _ in range(stage + 1):
        weight()
    return steps


class Placement(NamedTuple):
    """Where the virtual stages (model chunks in forward order) sit: interleaved, virtual stage v is chunk v // p
    of stage v % p (Megatron's); in a V (DualPipeV), stage s holds virtual stages s and 2p-1-s, so the first stage
    holds both ends (embedding and head) and the last one the middle two, passing between them without a
    transfer."""

    stages: int
    chunks: int
    v_shape: bool

    @classmethod
    def of(cls, point: DesignPoint) -> "Placement":
        p = point.parallel
        if p.pp_schedule == "dualpipev":
            return cls(p.pp, 2, True)
        return cls(p.pp, p.virtual_stages if p.pp_schedule == "interleaved" else 1, False)

    def vstage(self, stage: int, chunk: int) -> int:
        """The virtual stage of a stage's chunk."""
        return 2 * self.stages - 1 - stage if self.v_shape and chunk == 1 else chunk * self.stages + stage

    def holder(self, vstage: int) -> tuple[int, int]:
        """(stage, chunk) holding a virtual stage."""
        chunk, stage = divmod(vstage, self.stages)
        return (2 * self.stages - 1 - vstage, 1) if self.v_shape and chunk == 1 else (stage, chunk)

    def handed(self, stage: int, vstage: int) -> bool:
        """Whether a stage reaches its neighbouring virtual stage `vstage` without a transfer: in a V, where the
        last stage holds the middle two. An interleaved stage with pp = 1 holds every chunk yet sends to itself,
        as the engine pairs the send with its own receive."""
        return self.v_shape and self.holder(vstage)[0] == stage

    def tag(self, mb: int, vstage: int, backward: bool) -> int:
        """Both ends of a transfer compute the same tag, from the sender's forward virtual stage."""
        base = mb if self.chunks == 1 else mb * self.stages * self.chunks + vstage
        return 1 + 2 * base + (1 if backward else 0)

    def send_orders(self, steps: list[list[ChunkStep]]) -> dict[tuple[int, int], list[int]]:
        """Per (sender stage, receiver stage), the tags in the order the sender sends them, given each stage's
        steps.

        Sends and receives run in order on their streams (as NCCL p2p calls on one stream do), so a receiver
        posts its receives from a sender in that sender's order; with one chunk per stage this is simply
        micro-batch order, with interleaved chunks it lets a receive be posted before the step that reads it. The
        last stage of a V passes between its two chunks without a transfer."""
        last = self.stages * self.chunks - 1
        orders: dict[tuple[int, int], list[int]] = defaultdict(list)
        for stage, order in enumerate(steps):
            for step, mb, chunk in order:
                vstage = self.vstage(stage, chunk)
                if step == "F" and vstage < last and not self.handed(stage, vstage + 1):
                    orders[(stage, self.holder(vstage + 1)[0])].append(self.tag(mb, vstage, False))
                elif step == "B" and vstage > 0 and not self.handed(stage, vstage - 1):
                    orders[(stage, self.holder(vstage - 1)[0])].append(self.tag(mb, vstage - 1, True))
        return orders


Post = tuple[Literal["F", "B"], int, int]
"""A receive: of micro-batch mb's forward activation (F) or activation gradient (B) sent by virtual stage v."""


@lru_cache(maxsize=8)
def dualpipev_posts(stages: int, microbatches: int) -> list[list[list[Post]]]:
    """Per stage, the receives to post before each of its `dualpipev` steps (slot 2j) and after it, before its
    send (slot 2j + 1).

    A stage posts its receives on one stream in order and its sends on another, and a send waits for its
    receive (`simulators.analytical.engine`), so the receives of two neighbours must be posted in an order that
    no chain of sends can invert. DualPipeV's ranks post the receives of each step together with the sends
    before it (one NCCL group, in any order); here they are posted in the order of one run of the schedule with
    unit-time steps and instant transfers: every stage's calls then follow one global order, which cannot
    deadlock, and a receive is posted as soon as that run had its tensor sent."""
    placement = Placement(stages, 2, True)
    last = 2 * stages - 1
    steps = [dualpipev(stages, stage, microbatches) for stage in range(stages)]
    ended: dict[tuple[str, int, int], float] = {}
    times: list[list[tuple[float, float]]] = [[] for _ in range(stages)]
    clock = [0.0] * stages
    progress = True
    while progress:
        progress = False
        for stage in range(stages):
            while len(times[stage]) < len(steps[stage]):
                kind, mb, chunk = steps[stage][len(times[stage])]
                v = placement.vstage(stage, chunk)
                needs = {"F": [("F", mb, v - 1)] if v else [], "W": [("B", mb, v)]}.get(kind)
                if needs is None:
                    needs = [("F", mb, v)] + ([("B", mb, v + 1)] if v < last else [])
                if any(need not in ended for need in needs):
                    break
                start = max([clock[stage]] + [ended[need] for need in needs])
                clock[stage] = ended[(kind, mb, v)] = start + 1.0
                times[stage].append((start, start + 1.0))
                progress = True
    assert all(len(t) == len(s) for t, s in zip(times, steps, strict=True)), "the DualPipeV order deadlocks"
    arrivals: list[list[tuple[float, Post]]] = [[] for _ in range(stages)]
    for stage in range(stages):
        for (kind, mb, chunk), (_, end) in zip(steps[stage], times[stage], strict=True):
            v = placement.vstage(stage, chunk)
            to = v + 1 if kind == "F" else v - 1
            if kind != "W" and 0 <= to <= last and (receiver := placement.holder(to)[0]) != stage:
                arrivals[receiver].append((end, (kind, mb, v)))
    posts: list[list[list[Post]]] = []
    for stage in range(stages):
        pending = sorted(arrivals[stage])
        slots: list[list[Post]] = []
        for bound in (bound for span in times[stage] for bound in span):
            taken = 0
            while taken < len(pending) and pending[taken][0] <= bound:
                taken += 1
            slots.append([post for _, post in pending[:taken]])
            del pending[:taken]
        posts.append(slots)
    return posts


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
"""The schedules of stages holding one model chunk."""


def stage_steps(point: DesignPoint, stage: int, microbatches: int) -> list[ChunkStep]:
    """(F, B or W, micro-batch, chunk) in the order a stage of the point runs them over `microbatches`."""
    p, chunks = point.parallel, Placement.of(point).chunks
    if point.workload.mode != "train":
        return [("F", mb, c) for c in range(chunks) for mb in range(microbatches)]
    if p.pp_schedule == "interleaved":
        return interleaved(p.pp, stage, microbatches, chunks, microbatch_group(point))
    if p.pp_schedule == "dualpipev":
        return dualpipev(p.pp, stage, microbatches)
    return [(s, mb, 0) for s, mb in SCHEDULES[p.pp_schedule](p.pp, stage, microbatches)]


def steady_form(point: DesignPoint, programs: Callable[[int], list[Program]]) -> SteadyForm | None:
    """The step with fewer micro-batches that shows its whole pipeline steady state (`steady_microbatches`), with
    its longer form (`cycle_microbatches`) built only if asked for; None if it has none. `programs` builds the
    stages' programs for a number of micro-batches. The cost model checks the periods on the timeline and prices
    the whole step where they do not show."""
    short = steady_microbatches(point)
    if short is None:
        return None
    period = steady_period(point)
    repeats = (point.micro_batches - short) // period
    longer = cycle_microbatches(point)
    shorter = programs(short)

    def build() -> SteadyForm:
        assert longer is not None
        cycle = point.parallel.pp * period
        return SteadyForm(
            shorter if longer == short else programs(longer), longer, cycle, (point.micro_batches - longer) // cycle
        )

    return SteadyForm(shorter, short, period, repeats, None if longer is None else build)


def steady_microbatches(point: DesignPoint) -> int | None:
    """Micro-batches of the step's SteadyForm, or None when it has none.

    A 1F1B stage runs up to p - 1 warm-up forwards and as many drain backwards, and p + 4 micro-batches (2p + 2
    where that is fewer) leave a few steady periods on every stage: enough, as the cost model checks a stage's
    steady stretch only for what the calls after it read (`simulators.analytical.steady._periods`; a backward's
    own activations, read p periods back on the first stage, never set its start);
    interleaved and ZB-H1 stages repeat every several micro-batches (`steady_period`) and warm up and drain for up
    to about two of those periods each, so they take 6 periods. To that base, the step's remainder mod the period
    (which keeps an interleaved step's last, shorter group too), so that the form is a whole number of periods
    shorter than the step. Only training with those schedules has one: GPipe holds every micro-batch's
    activations, so its memory grows with them, and inference holds a KV cache per micro-batch.

    The form was once rounded up further, to a difference of a multiple of six periods: which transfer last used a
    link shared by pipeline sends and collectives cycled over 2 or 3 periods, unseen by the checks, and a form of
    another phase started its drain elsewhere in that cycle (up to 0.8% off). That cycle was the engine's order
    (which side of a transfer it reached first), which no time shows since transfers reserve their links as they
    are issued (`simulators.analytical.engine._reserve`, tests/test_analytical_steady.py), so the rounding guarded
    nothing and only lengthened forms, by up to five periods (GPT-3 175B at pp 16 and 48 micro-batches: 24, now
    20). A cycle a pipeline still has, such as a delay round the pp loop, shows in the calls' times: the checks
    reject the shorter form, and the longer form (`cycle_microbatches`), whole cycles shorter than the step,
    prices it."""
    p = point.parallel
    if point.workload.mode != "train" or p.pp_schedule not in ("1f1b", "interleaved", "zb_h1"):
        return None
    period = steady_period(point)
    base = 6 * period if period > 1 else min(2 * p.pp + 2, p.pp + 4)
    short = base + (point.micro_batches - base) % period
    return short if point.micro_batches > short else None


def cycle_microbatches(point: DesignPoint) -> int | None:
    """Micro-batches of the SteadyForm's longer form (`SteadyForm.longer`), for a 1F1B pipeline whose stages repeat
    only every k micro-batches, k dividing pp; None where there is none.

    A 1F1B pipeline is a loop of pp stages, and when its stages' sends and receives queue behind each other on
    shared links (tp 8 with sp off sends tp times the bytes of sp on), a delay can travel round that loop and come
    back every pp micro-batches: GPT-3 175B on 1,024 H100s at tp 8, pp 16, micro-batch 1 without sp repeats every
    16 micro-batches (653.4 ms with selective recompute and ZeRO-1), not every one. A cost model needs three such
    cycles steady between the warm-up and the drain to trust one (`simulators.analytical.steady`); 4p
    micro-batches give them from pp 8 to 16 (at 3p, the 16-stage one shows it on no stage, at 4p on all). To
    those, the step's remainder mod the cycle, pp micro-batches, so that the form is whole cycles shorter than the
    step and its drain starts in the step's phase of the cycle. Interleaved and ZB-H1 forms already repeat over
    groups of micro-batches and have none."""
    p = point.parallel
    if steady_microbatches(point) is None or steady_period(point) != 1 or p.pp < 2:
        return None
    base = 4 * p.pp
    longer = base + (point.micro_batches - base) % p.pp
    return longer if point.micro_batches > longer else None


def steady_period(point: DesignPoint) -> int:
    """Micro-batches after which a steady pipeline stage repeats its calls and their timing: one for 1F1B, a group
    (`microbatch_group`) for interleaved 1F1B, p for ZB-H1 (its calls repeat every micro-batch, but with stage s
    holding back s weight gradients, the stages' transfers settle into a pattern that repeats every p)."""
    p = point.parallel
    if p.pp_schedule == "zb_h1":
        return p.pp
    return microbatch_group(point) if p.pp_schedule == "interleaved" and p.virtual_stages > 1 else 1
