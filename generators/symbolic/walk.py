"""One pipeline stage's calls walked in its schedule's order (`Pipeline.scheduled` keeps what a walk gives as the
stage's skeleton): its forwards and backwards over micro-batches and model chunks, the sends and receives between
stages, the gradient syncs and ZeRO-3's prefetched weight gathers, and the activations and gathered weights each
call keeps alive."""

from collections import defaultdict
from typing import TYPE_CHECKING

from dse.workload import Call, OpKind, Program, TensorKind
from generators.symbolic.buckets import GradientSyncs
from generators.symbolic.optimizer import TIED_SYNC_TAG
from generators.symbolic.schedule import (
    chunk_order,
    dualpipev_posts,
    microbatch_group,
    stage_steps,
)
from generators.symbolic.skeleton import (
    MADE_FOR_WEIGHT_GRAD,
    RESHARDED,
    SAVED,
    SAVED_FOR_INPUT_GRAD,
    SAVED_FOR_WEIGHT_GRAD,
    Source,
    TensorRow,
    Unit,
)
from generators.symbolic.weight_gathers import WeightGathers

if TYPE_CHECKING:
    from generators.symbolic.pipeline import Pipeline


def walk(
    pipeline: "Pipeline", program: Program, stage: int, layers: dict[int, list[int]], optimizer: int | None
) -> tuple[list[TensorRow], list[Source], list[tuple[int, int]]]:
    """Calls of one stage in its pipeline schedule order, with the activations (and prefetched weights) they
    keep alive; returns those tensors, what sizes each of them (a `Source`) and, per step of the schedule, the
    calls and tensors made before it (where `splice` finds the steady periods of a 1F1B stage).

    Its hot loops make their calls as `new(Call, (block, inputs, layer, microbatch, tag))`, without the named
    tuple's own constructor (a Python function per call, half the time of making one), and its tensors as plain
    rows: the skeleton keeps them as a table's columns (`Skeleton.of_walk`), so a Tensor each would only be
    taken apart again. Together a third of a walk, most of which is making objects."""
    p = pipeline.point.parallel
    new, activation = tuple.__new__, TensorKind.ACTIVATION
    microbatches = pipeline.microbatches
    chunks = pipeline.chunks
    vstages = p.pp * chunks
    sharding = pipeline.sharding
    held = sharding.hold
    sync_every = p.zero >= 2 and not sharding.grad_per_step
    held_to_backward: dict[tuple[int, int], tuple[Unit, tuple[int, ...]]] = {}
    """Per (module, micro-batch of the backward that frees them), forward-gathered weights kept to then."""
    resharded: dict[tuple[int, int], int] = {}
    """Per (module, micro-batch of the backward that frees it), the forward call after which the module keeps a
    1/n shard of its weights: FSDP2 keeps one post-forward shard per module, so under pipelining, with several
    micro-batches in flight, one from the first forward to the last backward of the step."""
    fwd_call: dict[tuple[int, int], int] = {}
    input_grad: dict[tuple[int, int], int] = {}
    """Per (module, micro-batch), the call of a backward's input-gradient half whose weight half is to run."""
    last_backward: dict[int, int] = {}
    buckets = pipeline.stage_buckets(stage, layers) if pipeline.train else []
    gradients = GradientSyncs(program, buckets, p.overlap_grad_reduce)
    syncs = gradients.calls
    updated: set[int] = set()
    """Modules whose updated weights the step has gathered (see `param_gathers`)."""
    first_forwards: list[int] = []
    """The forward calls that read weights `update_weights` gathered, in order."""

    sources: list[Source] = []
    rows: list[TensorRow] = []
    """The tensors the walk keeps alive, as rows of the stage's `TensorTable` (`Skeleton.of_walk`)."""

    sized: dict[Source, float] = {}

    def size(source: Source) -> float:
        """A tensor's bytes, from its source as a skeleton replay sizes it."""
        nbytes = sized.get(source)
        if nbytes is None:
            nbytes = sized[source] = pipeline.source_bytes(source)
        return nbytes

    def keep(name: str, source: Source, producer: int, consumer: int, kind: TensorKind = TensorKind.ACTIVATION) -> None:
        """A tensor held from `producer` to `consumer`."""
        rows.append((name, kind, size(source), producer, consumer))
        sources.append(source)

    names = {-1: "embed", -2: "head"} | {i: f"layer{i}" for indices in layers.values() for i in indices}

    def hold(unit: Unit, way: int, index: int, gathered: tuple[int, ...], consumer: int) -> None:
        for producer in gathered:
            keep(f"{names[index]}.weights", (*unit, way), producer, consumer, TensorKind.TEMPORARY)

    def update_weights(unit: Unit, index: int, mb: int) -> tuple[int, ...]:
        """The call gathering a module's updated weights (`param_gathers`) before its first forward of the step.
        Megatron gathers the first module's at the step's start and each next one's as the forward of the one
        before it starts (its pre-forward hook), once that one's gather and the forward before it are done: on
        the data-parallel stream, after the forward two modules back."""
        block = pipeline.param_gathers.get(trace_of[unit].forward)
        if block is None or index in updated:
            return ()
        updated.add(index)
        return (program.add(Call(block, tuple(first_forwards[-2:-1]), index, mb)),)

    tag = pipeline.placement.tag
    posted: dict[int, int] = {}
    consumed: set[int] = set()
    cursor: dict[int, int] = defaultdict(int)

    holder, vstage_of = pipeline.placement.holder, pipeline.placement.vstage
    v_shape, handed_to = pipeline.placement.v_shape, pipeline.placement.handed
    p2p_of: dict[tuple[OpKind, int, int], int] = {}

    def p2p(kind: OpKind, offset: int, crossed: int) -> int:
        """`p2p_block` of a send to (receive from) the stage `offset` along pp of what crosses the boundary after
        virtual stage `crossed`, looked up once per walk."""
        key = (kind, offset, crossed)
        block = p2p_of.get(key)
        if block is None:
            block = p2p_of[key] = pipeline.p2p_block(kind, offset, pipeline.boundary(crossed))
        return block

    def peer(vstage: int, step: int) -> int:
        """Offset along pp of the rank holding virtual stage vstage + step (0: this one, which sends to itself
        unless `Placement.handed` says it passes without a transfer)."""
        return holder(vstage + step)[0] - stage

    if pipeline.sends is None:
        pipeline.sends = pipeline.placement.send_orders(
            [stage_steps(pipeline.point, s, microbatches) for s in range(p.pp)]
        )
    sends = pipeline.sends

    def post(source_vstage: int, wanted: int) -> None:
        """Post the receives from the stage holding source_vstage, in its send order, up to `wanted` (unless
        that one is posted already)."""
        source = holder(source_vstage)[0]
        order = sends[(source, stage)]
        while wanted not in posted and wanted not in consumed:
            t = order[cursor[source]]
            cursor[source] += 1
            base, backward = divmod(t - 1, 2)
            # the boundary the transfer crosses: tags of interleaved schedules name it, else the sender's stage
            crossed = base % vstages if chunks > 1 else source - backward
            recv = p2p(OpKind.RECV, source - stage, crossed)
            mb_of = base // (1 if chunks == 1 else vstages)
            posted[t] = program.add(new(Call, (recv, blocked_after(), -1, mb_of, t)))

    p2p_calls: list[int] = []
    """Without `overlap_p2p_comm`: the p2p calls issued since the last compute, which the next compute waits for
    (Megatron's batched isend/irecv, waited on before the next micro-batch)."""
    last_compute: list[int] = []

    def blocked_after() -> tuple[int, ...]:
        """A blocking p2p call's input, the compute before it; it is one the next compute waits for."""
        if p.overlap_p2p_comm:
            return ()
        p2p_calls.append(len(program.calls))
        return tuple(last_compute[-1:])

    def waits() -> tuple[int, ...]:
        """The blocking p2p calls the next compute call waits for."""
        done = tuple(p2p_calls)
        p2p_calls.clear()
        return done

    def inbound(kind: str, vstage: int, mb: int) -> int:
        """The call whose output a forward (backward) reads from the virtual stage before (after) it: its
        receive, or in a V, where the last stage holds the middle two, that stage's own call."""
        source = vstage - 1 if kind == "F" else vstage + 1
        if v_shape and handed_to(stage, source):
            return handed.pop((kind, mb))
        wanted = tag(mb, min(source, vstage), kind == "B")
        post(source, wanted)
        consumed.add(wanted)
        return posted.pop(wanted)

    steps = stage_steps(pipeline.point, stage, microbatches)
    handed: dict[tuple[str, int], int] = {}
    """In a V placement, the last stage's (F or B, micro-batch) outputs its other chunk reads, unsent."""
    done = {"F": 0, "B": 0, "W": 0}
    """Forwards, backwards and (zero-bubble) weight-gradient steps the stage has run."""
    lockstep = {"F": 0, "B": 0}
    """Forwards and backwards of the ending stage whose wrapped-around tensors this stage has posted for."""
    group = microbatch_group(pipeline.point)
    lockstepped = chunks > 1 and p.pp_schedule == "interleaved"
    order = chunk_order(microbatches, chunks, group) if lockstepped else []

    def post_lockstep(kind: str) -> None:
        """Before a forward (backward) of the leading stage (the first in forward, the last in backward), post
        what the ending stage has sent it by then: Megatron's leading stage receives from the ending one p - 1
        iterations behind, whatever chunk the tensor is for (`recv_tensor_from_previous_stage`, buffering up to
        microbatch_group - p + 1 tensors). With groups of p that is the tensor the step reads; with larger
        groups it arrives before the step that reads it, and the ending stage's sends do not wait for that."""
        if stage != (0 if kind == "F" else p.pp - 1):
            return
        while lockstep[kind] <= done[kind] - p.pp:
            mb, chunk = order[lockstep[kind]]
            lockstep[kind] += 1
            if chunk == chunks - 1:  # the last chunk's forward (the first chunk's backward) ends the pipeline
                continue
            if kind == "F":
                source = (chunk + 1) * p.pp - 1
                post(source, tag(mb, source, False))
            else:
                source = (chunks - 1 - chunk) * p.pp
                post(source, tag(mb, source - 1, True))

    due = dualpipev_posts(p.pp, microbatches)[stage] if pipeline.placement.v_shape else []

    def prefetch(i: int) -> None:
        """Before a step's send, post the receive the next step reads (Megatron's send_forward_recv_forward
        and send_backward_recv_backward), so neither end's send waits behind the other's; in a V, those
        due by the end of the step before (`dualpipev_posts`)."""
        if due:
            post_due(2 * i - 1)
            return
        if i >= len(steps):
            return
        step, mb, chunk = steps[i]
        vstage = vstage_of(stage, chunk)
        if step == "F" and vstage > 0:
            post(vstage - 1, tag(mb, vstage - 1, False))
        elif step == "B" and vstage < vstages - 1:
            post(vstage + 1, tag(mb, vstage, True))
        if lockstepped:
            post_lockstep(step)

    def post_due(slot: int) -> None:
        for kind, mb, source in due[slot] if slot >= 0 else ():
            post(source, tag(mb, source if kind == "F" else source - 1, kind == "B"))

    in_order = pipeline.chunk_units(stage, layers)
    reversed_order = {chunk: units[::-1] for chunk, units in in_order.items()}
    trace_of = {unit: pipeline.unit_trace(unit) for units in in_order.values() for _, unit in units}
    saved_source = {unit: (*unit, SAVED) for unit in trace_of}
    last_mb = microbatches - 1
    gathers = WeightGathers(program, trace_of, held, p.fsdp_prefetch, sharding.head_hold)

    # Weights gathered once per step (`Sharding.hold` step) are all gathered from the step's start, chunk by
    # chunk, before any transfer: torch.distributed.pipelining issues a stage's UNSHARD well ahead of its first
    # forward, so neither its compute nor a pipeline transfer holding the link waits for them.
    step_gathers = {
        chunk: [gathers.gather(units, pos, 0, (), 0) for pos in range(len(units))]
        for chunk, units in in_order.items()
        if held == "step" and gathers.on
    }
    calls, append = program.calls, program.calls.append  # the walk's two hot loops add calls inline
    marks: list[tuple[int, int]] = []
    for i, (step, mb, chunk) in enumerate(steps):
        marks.append((len(calls), len(rows)))
        vstage = vstage_of(stage, chunk)
        if lockstepped:
            post_lockstep(step)
        if due:  # what arrived by the end of the step before (if it sent nothing) and by this one's start
            post_due(2 * i - 1)
            post_due(2 * i)
        done[step] += 1
        first, last = vstage == 0, vstage == vstages - 1
        if step == "F":
            units = in_order[chunk]
            # the first module's updated weights are gathered from the step's start, not after the receive
            early = update_weights(units[0][1], units[0][0], mb) if pipeline.param_gathers and units else ()
            # the first modules' gathers start with the step, once its input has arrived (Megatron waits for
            # the receive before it runs the micro-batch), each next one's as the module `fsdp_prefetch` places
            # before it runs; weights gathered once per step were issued at the step's start (`step_gathers`)
            issued = step_gathers.pop(chunk, []) if mb == 0 else []
            prev = None if first else inbound("F", vstage, mb)
            if gathers.on:
                gathers.ahead(units, issued, 0, 0, () if prev is None else (prev,), mb)
            blocked = waits()
            for pos, (index, unit) in enumerate(units):
                inputs = () if prev is None else (prev,)
                gathered = gathers.ahead(units, issued, pos, 0, inputs, mb) if gathers.on else ()
                traced = trace_of[unit]
                block = traced.forward if mb == 0 or traced.held_forward is None else traced.held_forward
                update = early if pos == 0 or not pipeline.param_gathers else update_weights(unit, index, mb)
                if gathered or update or blocked:
                    inputs = (*inputs, *gathered, *update, *blocked)
                append(new(Call, (block, inputs, index, mb, 0)))
                prev, blocked = len(calls) - 1, ()
                if update:
                    first_forwards.append(prev)
                kept = gathers.held(unit) if gathered or traced.gathers[0] is not None else None
                if gathered and kept in ("microbatch", "step"):
                    held_to_backward[(index, mb if kept == "microbatch" else last_mb)] = (unit, gathered)
                elif gathered:
                    hold(unit, 0, index, gathered, prev)
                if kept == "shard" and traced.gathers[0] is not None and (p.pp == 1 or mb == 0):
                    resharded[(index, mb if p.pp == 1 else last_mb)] = prev
                fwd_call[(index, mb)] = prev
            last_compute[:] = [prev]
            if not last and v_shape and handed_to(stage, vstage + 1):
                handed[("F", mb)] = prev
            elif not last:
                if chunks > 1:
                    prefetch(i + 1)
                send = p2p(OpKind.SEND, peer(vstage, +1), vstage)
                blocked_after()
                program.add(new(Call, (send, (prev,), -1, mb, tag(mb, vstage, False))))
            continue
        if step == "W":
            # a zero-bubble schedule's deferred weight gradients: they free the activations and sync
            for index, unit in reversed_order[chunk]:
                traced = trace_of[unit]
                if traced.backward_weight is None:
                    continue
                made_by = input_grad.pop((index, mb))
                append(new(Call, (traced.backward_weight, (made_by,), index, mb, 0)))
                weight = last_backward[index] = len(calls) - 1
                keep(names[index], (*unit, SAVED_FOR_WEIGHT_GRAD), fwd_call[(index, mb)], weight)
                keep(f"{names[index]}.wgrad_inputs", (*unit, MADE_FOR_WEIGHT_GRAD), made_by, weight)
                if traced.sync is not None and (sync_every or mb == last_mb):
                    gradients.backward_ended(weight, mb, index)
            continue
        prev = None if last else inbound("B", vstage, mb)
        received = () if prev is None else (prev,)
        reducing = mb == last_mb and not sharding.reduce_after_stage
        units = reversed_order[chunk]
        # a module is gathered again for its backward once its forward has freed its weights
        # (and, like the forward's, once the gradient it starts from has arrived)
        issued = []
        if gathers.on and units:
            gathers.ahead(units, issued, 0, 1, (*received, fwd_call[(units[0][0], mb)]), mb)
        blocked = waits()
        for pos, (index, unit) in enumerate(units):
            traced = trace_of[unit]
            assert traced.backward is not None
            forward = fwd_call[(index, mb)]
            inputs = (forward,) if prev is None else (prev, forward)
            gathered = gathers.ahead(units, issued, pos, 1, inputs, mb) if gathers.on else ()
            block = traced.backward if traced.unsynced is None or reducing else traced.unsynced
            append(new(Call, (block, (*inputs, *gathered, *blocked) if gathered or blocked else inputs, index, mb, 0)))
            prev = last_backward[index] = len(calls) - 1
            blocked = ()
            if gathered:
                hold(unit, 1, index, gathered, prev)
            if held_to_backward and (index, mb) in held_to_backward:
                held_unit, held_gather = held_to_backward.pop((index, mb))
                hold(held_unit, 0, index, held_gather, prev)
            if resharded and (index, mb) in resharded:
                name = f"{names[index]}.weights.resharded"
                keep(name, (*unit, RESHARDED), resharded.pop((index, mb)), prev, TensorKind.TEMPORARY)
            if traced.backward_weight is not None:
                # its weight gradient, what that reads and the gradient sync wait for the W step
                input_grad[(index, mb)] = prev
                keep(names[index], (*unit, SAVED_FOR_INPUT_GRAD), forward, prev)
                continue
            source = saved_source[unit]  # `keep`, inline
            rows.append((names[index], activation, sized.get(source) or size(source), forward, prev))
            sources.append(source)
            if traced.sync is not None and (sync_every or mb == last_mb):
                gradients.backward_ended(prev, mb, index)
        last_compute[:] = [] if prev is None else [prev]
        if not first and v_shape and handed_to(stage, vstage - 1):
            handed[("B", mb)] = prev
        elif not first:
            assert prev is not None
            if chunks > 1:
                prefetch(i + 1)
            send = p2p(OpKind.SEND, peer(vstage, -1), vstage - 1)
            blocked_after()
            prev = program.add(new(Call, (send, (prev,), -1, mb, tag(mb, vstage - 1, True))))
        if mb == last_mb and sharding.reduce_after_stage:
            # FSDP's post-backward of the stage module (torch.distributed.pipelining's REDUCE_GRAD action, after
            # the stage's last backward and its send): every module's reduce-scatter. It waits for the send as
            # well, which takes the link first (an activation gradient, short beside the stage's gradients).
            for index, unit in units:
                reduce = trace_of[unit].post_backward
                if reduce is not None:
                    syncs.append(program.add(Call(reduce, (prev,), index, mb)))
    if gradients.deferred:
        # Megatron without --overlap-grad-reduce: every reduction starts once the whole backward has ended
        # (and, with blocking p2p, once the last send has gone)
        gradients.issue_deferred((max(last_backward.values()), *waits()))
    tied = pipeline.tied_sync.get(stage)
    if tied is not None:
        # after the last backward of the embedding (first stage) or the head (last stage)
        owner = -1 if stage == 0 else -2
        syncs.append(program.add(Call(tied, (last_backward[owner],), owner, microbatches - 1, TIED_SYNC_TAG)))
    if optimizer is not None:
        program.add(Call(optimizer, (*syncs, *waits()) or (len(program.calls) - 1,)))
    return rows, sources, marks
