"""The pipeline schedule of a step: per stage, the calls of its traced blocks in the order its schedule runs forwards
and backwards over micro-batches and model chunks, the pipeline sends and receives between stages, the gradient
syncs and ZeRO-3's prefetched weight gathers, and the activations and gathered weights each call keeps alive.
A stage's schedule is walked (`walk`) once per shape (`skeleton`) and given the sizes of later points.
"""

from typing import NamedTuple

import numpy as np

from dse.spec import DesignPoint
from dse.workload import BLOCK_INPUT, Block, Op, OpKind, Program, SteadyForm, Tensor
from generators.symbolic.blocks import LayerKey, Traced, block_of, made_block
from generators.symbolic.buckets import Bucket, gradient_buckets
from generators.symbolic.dense import DenseModule
from generators.symbolic.emitter import Emitter
from generators.symbolic.layers import LayerLayout
from generators.symbolic.schedule import (
    Placement,
    steady_form,
)
from generators.symbolic.sharding import Sharding
from generators.symbolic.skeleton import (
    Skeleton,
    Source,
    StepShape,
    StepSkeletons,
    Unit,
    keep_skeleton,
    keep_step,
    kept_shorter,
    schedule_shape,
    skeleton_for,
    step_for,
    traced_bytes,
)
from generators.symbolic.splice import fewest_microbatches, splice
from generators.symbolic.walk import walk


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
        layout: LayerLayout,
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
        self.layout = layout
        self.keys = layout.keys
        """Per layer, the traced layer it runs."""
        self.tied_sync = tied_sync
        """By stage, the block exchanging a tied weight's gradient (`ModelStates.tied_sync_blocks`)."""
        self.param_gathers = param_gathers or {}
        """By forward block, the block gathering its module's updated weights ahead of the step's first forward
        of the module (`ModelStates.param_gather_blocks`, Megatron's overlap_param_gather)."""
        self.microbatches = point.micro_batches
        """How many micro-batches the programs being scheduled run (see `programs`)."""
        self.sends: dict[tuple[int, int], list[int]] | None = None
        """Send orders of the micro-batches being scheduled, found when a stage is walked (`walk`): a
        skeleton reused from an earlier point needs none."""
        self.p2p: dict[tuple[OpKind, int, str], int] = {}
        self.p2p_bytes: dict[str, float] = {}
        """By the strategy of the layer before the boundary, the bytes a pipeline transfer moves across it: every p2p
        block across such boundaries moves the same."""
        self.buckets: dict[int, list[Bucket]] = {}
        """By stage, its gradient buckets (`gradient_buckets`), made once so that every program of the stage, the
        steady form's and the full step's, issues the same blocks."""
        self.bucket_blocks: dict[Block, int] = {}
        self.formed: dict[int, list[Skeleton]] = {}
        """By micro-batches, the skeletons the stages took for programs over them (see `spliced`)."""
        self.sharding = Sharding.of(point.parallel)
        self.placement = Placement.of(point)
        self.chunks = self.placement.chunks
        self.vstage_starts = layout.vstage_starts
        self.shape = self.step_shape()

    def programs(self, stages: list[Stage], microbatches: int) -> list[Program]:
        """One program per pipeline stage, running `microbatches` micro-batches."""
        self.microbatches = microbatches
        self.sends = None
        programs = [Program(stage, f"stage{stage}", tensors=list(fixed)) for stage, (_, _, fixed) in enumerate(stages)]
        first = self.scheduled(programs[0], 0, stages[0].layers, stages[0].optimizer)
        # the stages' skeletons as one: their keys follow from the first's with the step's optimizer blocks, unless
        # gradient buckets sized by this point's bytes add blocks between the stages
        keyed = not self.train or self.point.parallel.grad_bucket_mb is None
        optimizers = tuple(s.optimizer for s in stages)
        key = (self.shape, microbatches, len(self.blocks), tuple(self.p2p.items()), optimizers, first)
        step = step_for(key) if keyed else None
        if step is not None:
            for kind, peer, strategy in step.p2p:
                self.p2p_block(kind, peer, strategy)
            step.fill(programs, [self.source_bytes(source) for source in step.sources])
            self.formed[microbatches] = list(step.skeletons)
            return programs
        after_first, skeletons = len(self.p2p), [first]
        for stage, (layers, optimizer, _) in enumerate(stages[1:], start=1):
            skeletons.append(self.scheduled(programs[stage], stage, layers, optimizer))
        self.formed[microbatches] = skeletons
        if keyed:
            keep_step(key, StepSkeletons.of(skeletons, tuple(list(self.p2p)[after_first:])))
        return programs

    def step_shape(self) -> StepShape:
        """What every stage's skeleton is keyed by besides the stage's own and the micro-batches (see
        `scheduled`)."""
        traces = (self.embed, self.head, *self.layer_traces.values())
        return StepShape.of(
            (
                schedule_shape(self.point),
                tuple(self.param_gathers.items()),
                self.layout.runs,
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
            size = self.p2p_bytes.get(strategy)
            if size is None:
                size = self.p2p_bytes[strategy] = self.tracer.nbytes(
                    self.module.activation("x", ("b", "s", "h"), strategy)
                )
            # a blocking receive (without overlap_p2p_comm) is posted once the compute before it has ended
            blocking = not self.point.parallel.overlap_p2p_comm
            deps = (BLOCK_INPUT,) if kind is OpKind.SEND or blocking else ()

            def make() -> Block:
                emitter = Emitter()
                emitter.emit(Op(name, kind, kind.value, comm_bytes=size, axis="pp", peer=peer, deps=deps))
                return block_of(name, emitter)

            self.blocks.append(made_block((name, kind, size, type(size), peer, deps), make))
            self.p2p[key] = len(self.blocks) - 1
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

    def scheduled(self, program: Program, stage: int, layers: dict[int, list[int]], optimizer: int | None) -> Skeleton:
        """The stage walked (`walk`), spliced from its skeleton over fewer micro-batches (`spliced`), or its skeleton
        from an earlier point of the same shape and micro-batches with this point's sizes; returns the skeleton.

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
        stage_shape = StepShape.of(
            (
                stage,
                self.shape,
                len(self.blocks),
                tuple(self.p2p.items()),
                optimizer,
                tuple((c, tuple(indices)) for c, indices in layers.items()),
                buckets,
            )
        )
        key = (stage_shape, self.microbatches)
        skeleton = skeleton_for(key)
        if skeleton is None:
            skeleton = self.spliced(stage, stage_shape)
            if skeleton is not None:
                skeleton.fill(program, np.array([self.source_bytes(s) for s in skeleton.sources], dtype=float))
                keep_skeleton(key, skeleton)
                return skeleton
            first_p2p = len(self.p2p)
            rows, sources, marks = walk(self, program, stage, layers, optimizer)
            skeleton = Skeleton.of_walk(program, rows, sources, tuple(list(self.p2p)[first_p2p:]), marks)
            keep_skeleton(key, skeleton)
            return skeleton
        for kind, peer, strategy in skeleton.p2p:
            self.p2p_block(kind, peer, strategy)
        skeleton.fill(program, np.array([self.source_bytes(source) for source in skeleton.sources]))
        return skeleton

    def spliceable(self) -> bool:
        """Whether a stage's skeleton over more micro-batches may be spliced from its skeleton over fewer
        (`splice`): training 1F1B, whose steady pairs repeat whatever the micro-batches, with nothing issued per
        micro-batch outside them: no gradient sync per micro-batch (ZeRO-2 and up), whose collectives without
        overlap_grad_reduce wait for the backward's end, no weight gathers (ZeRO-3, FSDP) or gathers of updated
        weights, no gradient buckets sized by bytes and no deferred weight gradients."""
        p = self.point.parallel
        traces = (self.embed, self.head, *self.layer_traces.values())
        traces += tuple(t.unrecomputed for t in traces if t.unrecomputed is not None)
        return (
            self.train
            and p.pp_schedule == "1f1b"
            and self.chunks == 1
            and p.grad_bucket_mb is None
            and not (p.zero >= 2 and not self.sharding.grad_per_step)
            and not self.sharding.reduce_after_stage
            and not self.param_gathers
            and all(t.gathers == (None, None) and t.backward_weight is None for t in traces)
        )

    def spliced(self, stage: int, stage_shape: StepShape) -> Skeleton | None:
        """The stage's skeleton spliced from one over fewer micro-batches (`splice`), if it may be: the one it took
        for a shorter form on this pipeline (the steady form's, which a point makes before its longer form or
        whole step), else one kept from an earlier point of the stage's shape over fewer micro-batches
        (`kept_shorter`: its step, or its longer form; 1F1B points of one shape share their steady form). It makes
        the p2p blocks that one's walk made and this pipeline has not: those of a kept one, none of its own shorter
        form's."""
        if not self.spliceable():
            return None
        pp = self.point.parallel.pp
        fewer = [m for m in self.formed if m < self.microbatches and len(self.formed[m]) > stage]
        if fewer:
            shorter = min(fewer)
            short = self.formed[shorter][stage]
        else:
            kept = kept_shorter(stage_shape, self.microbatches, fewest_microbatches(pp, stage))
            if kept is None:
                return None
            shorter, short = kept
        made = tuple(p2p for p2p in short.p2p if p2p not in self.p2p)
        skeleton = splice(short, pp, stage, shorter, self.microbatches - shorter, made)
        if skeleton is not None:
            for kind, peer, strategy in made:
                self.p2p_block(kind, peer, strategy)
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
