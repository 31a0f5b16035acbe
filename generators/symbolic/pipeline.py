"""The pipeline schedule of a step: per stage, the calls of its traced blocks in the order its schedule runs forwards
and backwards over micro-batches and model chunks, the pipeline sends and receives between stages, the gradient
syncs and ZeRO-3's prefetched weight gathers, and the activations and gathered weights each call keeps alive.
A stage's schedule is walked once per shape (`skeleton`) and given the sizes of later points.
"""

from collections import defaultdict
from typing import NamedTuple

import numpy as np

from dse.spec import DesignPoint
from dse.workload import BLOCK_INPUT, Block, Call, Op, OpKind, Program, SteadyForm, Tensor, TensorKind
from generators.symbolic.blocks import LayerKey, Traced, add_block
from generators.symbolic.buckets import Bucket, GradientSyncs, gradient_buckets
from generators.symbolic.dense import DenseModule
from generators.symbolic.emitter import Emitter
from generators.symbolic.optimizer import TIED_SYNC_TAG
from generators.symbolic.schedule import (
    Placement,
    chunk_order,
    dualpipev_posts,
    microbatch_group,
    stage_steps,
    steady_form,
)
from generators.symbolic.sharding import Sharding
from generators.symbolic.skeleton import (
    MADE_FOR_WEIGHT_GRAD,
    RESHARDED,
    SAVED,
    SAVED_FOR_INPUT_GRAD,
    SAVED_FOR_WEIGHT_GRAD,
    Skeleton,
    Source,
    StepShape,
    StepSkeletons,
    Unit,
    keep_skeleton,
    keep_step,
    runs,
    schedule_shape,
    skeleton_for,
    step_for,
    traced_bytes,
)
from generators.symbolic.weight_gathers import WeightGathers


class Stage(NamedTuple):
    """What a pipeline stage's programs share, whatever their number of micro-batches."""

    layers: dict[int, list[int]]
    """Per model chunk, the layers the stage holds."""
    optimizer: int | None
    fixed: tuple[Tensor, ...]
    """Tensors held for the whole step: weights, gradients, optimizer states, KV cache."""


class Pipeline:
    """Schedules the traced modules of one point over its pipeline stages, adding the p2p blocks it needs to
    `blocks`."""

    def __init__(
        self,
        point: DesignPoint,
        module: DenseModule,
        blocks: list[Block],
        layer_traces: dict[LayerKey, Traced],
        embed: Traced,
        head: Traced,
        keys: list[LayerKey],
        tied_sync: dict[int, int],
        param_gathers: dict[int, int] | None = None,
    ) -> None:
        self.point = point
        self.train = point.workload.mode == "train"
        self.module = module
        self.tracer = module.tracer
        self.blocks = blocks
        self.layer_traces = layer_traces
        self.embed, self.head = embed, head
        self.keys = keys
        """Per layer, the traced layer it runs."""
        self.tied_sync = tied_sync
        """By stage, the block exchanging a tied weight's gradient (`ModelStates.tied_sync_blocks`)."""
        self.param_gathers = param_gathers or {}
        """By forward block, the block gathering its module's updated weights ahead of the step's first forward
        of the module (`ModelStates.param_gather_blocks`, Megatron's overlap_param_gather)."""
        self.microbatches = point.micro_batches
        """How many micro-batches the programs being scheduled run (see `programs`)."""
        self.sends: dict[tuple[int, int], list[int]] | None = None
        """Send orders of the micro-batches being scheduled, found when a stage is walked (`schedule`): a
        skeleton reused from an earlier point needs none."""
        self.p2p: dict[tuple[OpKind, int, str], int] = {}
        self.buckets: dict[int, list[Bucket]] = {}
        """By stage, its gradient buckets (`gradient_buckets`), made once so that every program of the stage, the
        steady form's and the full step's, issues the same blocks."""
        self.bucket_blocks: dict[Block, int] = {}
        self.sharding = Sharding.of(point.parallel)
        p, m = point.parallel, point.model
        placement = self.placement = Placement.of(point)
        chunks = self.chunks = placement.chunks
        # Virtual stage v (chunk c of stage s, `Placement.holder`) runs layers [starts[v], starts[v + 1]); a
        # stage's layers split evenly over its chunks, the first chunks taking one more where they do not divide
        # (uneven stages).
        per_stage = p.stage_layers(m.layers)
        starts = self.vstage_starts = [0]
        for v in range(p.pp * chunks):
            stage, chunk = placement.holder(v)
            count = per_stage[stage]
            starts.append(starts[-1] + count // chunks + (chunk < count % chunks))

    def stage_layers(self, stage: int) -> dict[int, list[int]]:
        """Per model chunk, the layers a stage holds."""
        starts = self.vstage_starts
        vstages = [self.placement.vstage(stage, c) for c in range(self.chunks)]
        return {c: list(range(starts[v], starts[v + 1])) for c, v in enumerate(vstages)}

    def ends(self, stage: int) -> tuple[bool, bool]:
        """Whether a stage holds the first virtual stage (the embedding) and the last (the head)."""
        holder, last = self.placement.holder, self.point.parallel.pp * self.chunks - 1
        return holder(0)[0] == stage, holder(last)[0] == stage

    def programs(self, stages: list[Stage], microbatches: int) -> list[Program]:
        """One program per pipeline stage, running `microbatches` micro-batches."""
        self.microbatches = microbatches
        self.sends = None
        shape = self.step_shape()
        programs = [Program(stage, f"stage{stage}", tensors=list(fixed)) for stage, (_, _, fixed) in enumerate(stages)]
        first = self.scheduled(programs[0], 0, stages[0].layers, stages[0].optimizer, shape)
        # the stages' skeletons as one: their keys follow from the first's with the step's optimizer blocks, unless
        # gradient buckets sized by this point's bytes add blocks between the stages
        keyed = not self.train or self.point.parallel.grad_bucket_mb is None
        key = (shape, len(self.blocks), tuple(self.p2p.items()), tuple(s.optimizer for s in stages), first)
        step = step_for(key) if keyed else None
        if step is not None:
            for kind, peer, strategy in step.p2p:
                self.p2p_block(kind, peer, strategy)
            step.fill(programs, [self.source_bytes(source) for source in step.sources])
            return programs
        after_first, skeletons = len(self.p2p), [first]
        for stage, (layers, optimizer, _) in enumerate(stages[1:], start=1):
            skeletons.append(self.scheduled(programs[stage], stage, layers, optimizer, shape))
        if keyed:
            keep_step(key, StepSkeletons.of(skeletons, tuple(list(self.p2p)[after_first:])))
        return programs

    def step_shape(self) -> StepShape:
        """What every stage's skeleton is keyed by besides the stage's own (see `scheduled`), for the micro-batches
        being scheduled."""
        traces = (self.embed, self.head, *self.layer_traces.values())
        return StepShape.of(
            (
                schedule_shape(self.point),
                self.microbatches,
                tuple(self.param_gathers.items()),
                runs(self.keys),
                tuple(
                    (
                        t.forward,
                        t.backward,
                        t.backward_weight,
                        t.sync,
                        t.gathers,
                        t.unsynced,
                        t.post_backward,
                        t.held_forward,
                    )
                    for t in traces
                ),
            )
        )

    def steady_form(self, stages: list[Stage]) -> SteadyForm | None:
        """The step with fewer micro-batches that shows its whole pipeline steady state (`schedule.steady_form`)."""
        return steady_form(self.point, lambda microbatches: self.programs(stages, microbatches))

    def p2p_block(self, kind: OpKind, peer: int, strategy: str) -> int:
        """A send to (recv from) the stage `peer` positions along pp of an activation (or its gradient) laid out as
        the layers of `strategy` leave it; one block per direction, offset and strategy."""
        key = (kind, peer, strategy)
        if key not in self.p2p:
            direction = "fwd" if (peer > 0) == (kind is OpKind.SEND) else "bwd"
            name = f"{kind.value}_{direction}" + ("" if abs(peer) == 1 else f"_{peer:+d}")
            name += "" if strategy == "tp" else f".{strategy}"
            size = self.tracer.nbytes(self.module.activation("x", ("b", "s", "h"), strategy))
            emitter = Emitter()
            # a blocking receive (without overlap_p2p_comm) is posted once the compute before it has ended
            blocking = not self.point.parallel.overlap_p2p_comm
            deps = (BLOCK_INPUT,) if kind is OpKind.SEND or blocking else ()
            emitter.emit(Op(name, kind, kind.value, comm_bytes=size, axis="pp", peer=peer, deps=deps))
            self.p2p[key] = add_block(self.blocks, name, emitter)
        return self.p2p[key]

    def boundary(self, vstage: int) -> str:
        """The strategy of the last layer of a virtual stage: how what crosses to the next one is laid out."""
        return self.point.parallel.layer_strategy(self.vstage_starts[vstage + 1] - 1)

    def unrecomputed(self, key: LayerKey, index: int) -> bool:
        """Whether layer `index` runs its backward without recompute: with `recompute_every` n only every n-th
        layer recomputes (layers n-1, 2n-1, ..., as torchtitan's layer-level selective checkpointing and the FSDP
        blog's checkpointing of every n-th block); the others keep every activation their backward reads."""
        every = self.point.parallel.recompute_every
        return self.layer_traces[key].unrecomputed is not None and (index + 1) % every != 0

    def chunk_units(self, stage: int, layers: dict[int, list[int]]) -> dict[int, list[tuple[int, Unit]]]:
        """Per chunk of a stage, the modules a forward runs, with their layer indices (-1 the embedding, -2 the
        head); a backward runs them reversed."""
        vstages = self.point.parallel.pp * self.chunks
        in_order: dict[int, list[tuple[int, Unit]]] = {}
        for chunk, indices in layers.items():
            vstage = self.placement.vstage(stage, chunk)
            units: list[tuple[int, Unit]] = [(-1, ("embed", False))] if vstage == 0 else []
            units += [(index, (self.keys[index], self.unrecomputed(self.keys[index], index))) for index in indices]
            in_order[chunk] = units + ([(-2, ("head", False))] if vstage == vstages - 1 else [])
        return in_order

    def stage_buckets(self, stage: int, layers: dict[int, list[int]]) -> list[Bucket]:
        """The gradient buckets of a stage's chunks (`gradient_buckets`), made on the stage's first schedule."""
        buckets = self.buckets.get(stage)
        if buckets is None:
            buckets = self.buckets[stage] = []
            for units in self.chunk_units(stage, layers).values():
                chunk = [(index, self.unit_trace(unit)) for index, unit in reversed(units)]
                buckets += gradient_buckets(chunk, self.point.parallel.grad_bucket_mb, self.blocks, self.bucket_blocks)
        return buckets

    def scheduled(
        self, program: Program, stage: int, layers: dict[int, list[int]], optimizer: int | None, shape: StepShape
    ) -> Skeleton:
        """`schedule`, or its skeleton from an earlier point of the same shape with this point's sizes; returns the
        skeleton.

        The calls of a stage depend only on the shape of the step (stages, chunks, micro-batches, layer kinds,
        block numbering, when gradients sync), not on sizes; only the activation bytes differ, and those come
        from this point's traced blocks. A study's points share few shapes, so most generations skip the walk
        over every layer and micro-batch. Without a bucket size, a stage's gradient buckets are its modules' own
        syncs (`gradient_buckets`), which the key holds already (its layers, their kinds and the traces' blocks),
        so they are made only for a walk; with one, what they pack depends on sizes, and the key holds them."""
        if not self.train:
            buckets: tuple[Bucket, ...] | None = ()
        elif self.point.parallel.grad_bucket_mb is None:
            buckets = None
        else:
            buckets = tuple(self.stage_buckets(stage, layers))
        key = (
            stage,
            shape,
            len(self.blocks),
            tuple(self.p2p.items()),
            optimizer,
            tuple((c, tuple(indices)) for c, indices in layers.items()),
            buckets,
        )
        skeleton = skeleton_for(key)
        if skeleton is None:
            first_p2p, first_tensor = len(self.p2p), len(program.tensors)
            sources = self.schedule(program, stage, layers, optimizer)
            skeleton = Skeleton.of_walk(program, first_tensor, sources, tuple(list(self.p2p)[first_p2p:]))
            keep_skeleton(key, skeleton)
            return skeleton
        for kind, peer, strategy in skeleton.p2p:
            self.p2p_block(kind, peer, strategy)
        skeleton.fill(program, np.array([self.source_bytes(source) for source in skeleton.sources]))
        return skeleton

    def source_bytes(self, source: Source) -> float:
        """The bytes of a scheduled tensor, from what sizes it (see `Source`)."""
        key, unrecomputed, what = source
        return traced_bytes(self.unit_trace((key, unrecomputed)), what, self.sharding.post_forward)

    def unit_trace(self, unit: Unit) -> Traced:
        """The traced module a unit of the schedule runs."""
        key, unrecomputed = unit
        if key == "embed":
            return self.embed
        if key == "head":
            return self.head
        traced = self.layer_traces[key]  # type: ignore[index]
        if unrecomputed:
            assert traced.unrecomputed is not None
            return traced.unrecomputed
        return traced

    def schedule(
        self, program: Program, stage: int, layers: dict[int, list[int]], optimizer: int | None
    ) -> list[Source]:
        """Calls of one stage in its pipeline schedule order, with the activations (and prefetched weights) they
        keep alive; returns what sizes each of those tensors (a `Source`)."""
        p = self.point.parallel
        microbatches = self.microbatches
        chunks = self.chunks
        vstages = p.pp * chunks
        sharding = self.sharding
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
        buckets = self.stage_buckets(stage, layers) if self.train else []
        gradients = GradientSyncs(program, buckets, p.overlap_grad_reduce)
        syncs = gradients.calls
        updated: set[int] = set()
        """Modules whose updated weights the step has gathered (see `param_gathers`)."""
        first_forwards: list[int] = []
        """The forward calls that read weights `update_weights` gathered, in order."""

        sources: list[Source] = []

        sized: dict[Source, float] = {}

        def keep(
            name: str, source: Source, producer: int, consumer: int, kind: TensorKind = TensorKind.ACTIVATION
        ) -> None:
            """A tensor held from `producer` to `consumer`, sized by its source as a skeleton replay sizes it."""
            nbytes = sized.get(source)
            if nbytes is None:
                nbytes = sized[source] = self.source_bytes(source)
            program.tensors.append(Tensor(name, kind, nbytes, producer, consumer))
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
            block = self.param_gathers.get(trace_of[unit].forward)
            if block is None or index in updated:
                return ()
            updated.add(index)
            return (program.add(Call(block, tuple(first_forwards[-2:-1]), index, mb)),)

        tag = self.placement.tag
        posted: dict[int, int] = {}
        consumed: set[int] = set()
        cursor: dict[int, int] = defaultdict(int)

        holder, vstage_of = self.placement.holder, self.placement.vstage

        def peer(vstage: int, step: int) -> int:
            """Offset along pp of the rank holding virtual stage vstage + step (0: this one, which sends to itself
            unless `Placement.handed` says it passes without a transfer)."""
            return holder(vstage + step)[0] - stage

        if self.sends is None:
            self.sends = self.placement.send_orders([stage_steps(self.point, s, microbatches) for s in range(p.pp)])
        sends = self.sends

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
                recv = self.p2p_block(OpKind.RECV, source - stage, self.boundary(crossed))
                mb_of = base // (1 if chunks == 1 else vstages)
                posted[t] = program.add(Call(recv, blocked_after(), -1, mb_of, t))

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
            if self.placement.handed(stage, source):
                return handed.pop((kind, mb))
            wanted = tag(mb, min(source, vstage), kind == "B")
            post(source, wanted)
            consumed.add(wanted)
            return posted.pop(wanted)

        steps = stage_steps(self.point, stage, microbatches)
        handed: dict[tuple[str, int], int] = {}
        """In a V placement, the last stage's (F or B, micro-batch) outputs its other chunk reads, unsent."""
        done = {"F": 0, "B": 0, "W": 0}
        """Forwards, backwards and (zero-bubble) weight-gradient steps the stage has run."""
        lockstep = {"F": 0, "B": 0}
        """Forwards and backwards of the ending stage whose wrapped-around tensors this stage has posted for."""
        group = microbatch_group(self.point)
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

        due = dualpipev_posts(p.pp, microbatches)[stage] if self.placement.v_shape else []

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

        in_order = self.chunk_units(stage, layers)
        reversed_order = {chunk: units[::-1] for chunk, units in in_order.items()}
        trace_of = {unit: self.unit_trace(unit) for units in in_order.values() for _, unit in units}
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
        for i, (step, mb, chunk) in enumerate(steps):
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
                early = update_weights(units[0][1], units[0][0], mb) if self.param_gathers and units else ()
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
                    update = early if pos == 0 or not self.param_gathers else update_weights(unit, index, mb)
                    append(Call(block, (*inputs, *gathered, *update, *blocked), index, mb))
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
                if not last and self.placement.handed(stage, vstage + 1):
                    handed[("F", mb)] = prev
                elif not last:
                    if chunks > 1:
                        prefetch(i + 1)
                    send = self.p2p_block(OpKind.SEND, peer(vstage, +1), self.boundary(vstage))
                    blocked_after()
                    program.add(Call(send, (prev,), -1, mb, tag(mb, vstage, False)))
                continue
            if step == "W":
                # a zero-bubble schedule's deferred weight gradients: they free the activations and sync
                for index, unit in reversed_order[chunk]:
                    traced = trace_of[unit]
                    if traced.backward_weight is None:
                        continue
                    made_by = input_grad.pop((index, mb))
                    append(Call(traced.backward_weight, (made_by,), index, mb))
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
                inputs = (fwd_call[(index, mb)],) if prev is None else (prev, fwd_call[(index, mb)])
                gathered = gathers.ahead(units, issued, pos, 1, inputs, mb) if gathers.on else ()
                block = traced.backward if traced.unsynced is None or reducing else traced.unsynced
                append(Call(block, (*inputs, *gathered, *blocked), index, mb))
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
                    keep(names[index], (*unit, SAVED_FOR_INPUT_GRAD), fwd_call[(index, mb)], prev)
                    continue
                keep(names[index], saved_source[unit], fwd_call[(index, mb)], prev)
                if traced.sync is not None and (sync_every or mb == last_mb):
                    gradients.backward_ended(prev, mb, index)
            last_compute[:] = [] if prev is None else [prev]
            if not first and self.placement.handed(stage, vstage - 1):
                handed[("B", mb)] = prev
            elif not first:
                assert prev is not None
                if chunks > 1:
                    prefetch(i + 1)
                send = self.p2p_block(OpKind.SEND, peer(vstage, -1), self.boundary(vstage - 1))
                blocked_after()
                prev = program.add(Call(send, (prev,), -1, mb, tag(mb, vstage - 1, True)))
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
        tied = self.tied_sync.get(stage)
        if tied is not None:
            # after the last backward of the embedding (first stage) or the head (last stage)
            owner = -1 if stage == 0 else -2
            syncs.append(program.add(Call(tied, (last_backward[owner],), owner, microbatches - 1, TIED_SYNC_TAG)))
        if optimizer is not None:
            program.add(Call(optimizer, (*syncs, *waits()) or (len(program.calls) - 1,)))
        return sources
