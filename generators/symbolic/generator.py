"""Assembling traced blocks and a pipeline schedule into a Workload.

Each kind of layer (a mixer and an MLP: attention + dense, MLA + MoE, SSM, ...) is traced once per design point
and shared by every layer, micro-batch and stage that runs it; programs (one per pipeline stage) are sequences of
calls to those blocks in the order of the pipeline schedule. Training traces forward and the derived backward;
prefill and decode trace the forward only and hold KV caches (or SSM states) instead of gradients.
"""

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dse.modelstats import LayerKind, layer_kinds, model_flops
from dse.spec import DesignPoint
from dse.workload import (
    BLOCK_INPUT,
    Block,
    Call,
    CallShape,
    Op,
    OpKind,
    Program,
    RankLayout,
    Tensor,
    TensorKind,
    Workload,
)
from generators.symbolic.autodiff import Differentiator, saved_bytes
from generators.symbolic.dense import DenseModule
from generators.symbolic.dist import DUP, Dist, Partition, gradient_layout
from generators.symbolic.graph import Emitter, Node, STensor
from generators.symbolic.schedule import SCHEDULES, interleaved

OPTIMIZER_STATE_BYTES = 12
"""fp32 master weights, Adam momentum and variance per parameter (ZeRO paper's K = 12)."""
ADAM_FLOPS = 12
ADAM_BYTES = 28
"""Per parameter: read the bf16 gradient and the three fp32 states, write the states and the bf16 weight."""
DATA_AXES = ("dp", "ep")


@dataclass
class Traced:
    """A module traced once: its forward and backward blocks and what they imply for memory and sync."""

    forward: int
    backward: int | None
    sync: int | None
    saved_bytes: float
    params: list[STensor] = field(default_factory=list)
    cache_bytes: float = 0.0
    """KV cache (or SSM state) bytes one micro-batch of this module holds (inference)."""


def block_name(kind: LayerKind) -> str:
    """'layer' for the dense transformer layer (every dense model's only kind), else layer.<mixer>.<mlp>."""
    return "layer" if kind == ("attn", "dense") else f"layer.{kind[0]}.{kind[1]}"


def is_expert(param: STensor) -> bool:
    d = param.dist("ep")
    return isinstance(d, Partition) and d.dim == "e" and param.name.startswith("experts.")


class _Builder:
    def __init__(self, point: DesignPoint):
        self.point = point
        self.train = point.workload.mode == "train"
        self.module = DenseModule(point)
        self.tracer = self.module.tracer
        self.blocks: list[Block] = []
        self.synced: set[int] = set()
        self.p2p: dict[tuple[OpKind, int], int] = {}
        self._elems: dict[int, float] = {}

    def add_block(self, name: str, emitter: Emitter, output: int = -1) -> int:
        temp = emitter.peak_temp + emitter.gathered_params
        self.blocks.append(Block(name, tuple(emitter.ops), output, temp))
        return len(self.blocks) - 1

    def _replayed(self, name: str, tape: Sequence[Node]) -> tuple[list[Node], list[Node]]:
        """Nodes recomputed in backward, and those of them whose output is stored all the same."""
        policy = self.point.parallel.recompute
        if not name.startswith("layer") or policy == "none":
            return [], []
        if policy == "full":
            return list(tape), []
        attention = [n for n in tape if n.kind == "attention"]
        # Megatron's selective recompute re-runs the unfused core attention (QK^T, softmax, dropout, over V) and
        # keeps its output, which the output projection reads; a fused kernel's output is recomputed with it.
        kept = attention if not self.point.model.flash_attention else []
        return attention, kept

    def trace(self, name: str, inputs: Sequence[STensor], forward: Callable[[], STensor]) -> Traced:
        tr = self.tracer
        first_param = len(self.module.params)
        first_cache = len(self.module.caches)
        tr.tape, tr.recording = [], True
        tr.begin_block(inputs)
        out = forward()
        fwd = tr.end_block()
        tape = tr.tape
        params = self.module.params[first_param:]
        cache = sum(tr.nbytes(c) for c in self.module.caches[first_cache:])
        if not self.train:
            forward_block = self.add_block(f"{name}.forward", fwd)
            return Traced(forward_block, None, None, 0.0, params, cache)

        tr.recording = False
        layout = {axis: gradient_layout(out.dist(axis)) for axis in tr.degrees}
        grad_out = STensor(f"{out.name}.grad", out.dims, tuple(sorted(layout.items())), out.itemsize)
        grad_out = grad_out.relayout("tp", layout.get("tp", DUP))
        tr.begin_block([grad_out])
        diff = Differentiator(tr, tape, self.module.leaf_ids)
        replayed, kept = self._replayed(name, tape)
        diff.replay(replayed)
        grads = diff.run([(out, grad_out)], inputs)
        bwd = tr.end_block()
        input_grad_ops = [bwd.origin[id(g)] for g in grads.inputs.values() if id(g) in bwd.origin]
        output = max(input_grad_ops) if input_grad_ops else -1

        saved = saved_bytes(tr, tape, replayed, kept)
        forward_block = self.add_block(f"{name}.forward", fwd)
        backward_block = self.add_block(f"{name}.backward", bwd, output)
        sync = self.grad_sync(name, grads.params)
        return Traced(forward_block, backward_block, sync, saved, params)

    def grad_sync(self, name: str, grads: list[tuple[STensor, STensor]]) -> int | None:
        """One bucket per collective and axis: the gradient reduction of every parameter of the module.

        Dense weights reduce over every data-parallel rank (dp x ep, and cp, whose tokens also differ); expert
        weights only over the ranks that hold the same experts (dp / ep)."""
        tr, zero = self.tracer, self.point.parallel.zero
        tr.begin_block([g for _, g in grads])
        for param, grad in grads:
            if id(param) in self.synced:
                continue
            self.synced.add(id(param))
            target: dict[str, Dist] = {"tp": gradient_layout(param.dist("tp"))}
            for axis in DATA_AXES:
                if axis == "ep" and is_expert(param):
                    target[axis] = param.dist(axis)
                else:
                    target[axis] = DUP if zero == 0 else Partition(param.dims[0])
            tr.redistribute(grad, target, record=False)
        ops = tr.end_block().ops
        buckets: dict[tuple[str, str], float] = defaultdict(float)
        for op in ops:
            buckets[(op.category, op.axis)] += op.comm_bytes
        if not buckets:
            return None
        merged = Emitter()
        for (category, axis), size in sorted(buckets.items()):
            merged.emit(
                Op(
                    f"{name}.grad_sync.{category}",
                    OpKind.COLLECTIVE,
                    category,
                    comm_bytes=size,
                    axis=axis,
                    deps=(BLOCK_INPUT,),
                )
            )
        return self.add_block(f"{name}.grad_sync", merged)

    def p2p_block(self, kind: OpKind, peer: int, size: float) -> int:
        """A send to (recv from) the stage `peer` positions along pp; one block per direction and offset."""
        key = (kind, peer)
        if key not in self.p2p:
            direction = "fwd" if (peer > 0) == (kind is OpKind.SEND) else "bwd"
            name = f"{kind.value}_{direction}" + ("" if abs(peer) == 1 else f"_{peer:+d}")
            emitter = Emitter()
            deps = (BLOCK_INPUT,) if kind is OpKind.SEND else ()
            emitter.emit(Op(name, kind, kind.value, comm_bytes=size, axis="pp", peer=peer, deps=deps))
            self.p2p[key] = self.add_block(name, emitter)
        return self.p2p[key]

    def _replica_elems(self, w: STensor) -> float:
        """Elements of a weight on one rank before ZeRO shards it; every layer repeats the same weights."""
        elems = self._elems.get(id(w))
        if elems is None:
            unsharded = w.relayout("dp", DUP)
            if not is_expert(w):
                unsharded = unsharded.relayout("ep", DUP)
            elems = self._elems[id(w)] = self.tracer.elems(unsharded)
        return elems

    def optimizer_block(self, params: list[STensor]) -> tuple[int | None, dict[TensorKind, float]]:
        """The Adam step over this stage's share of the parameters, and the static memory of model states.

        A dense weight has dp (x ep) replicas, an expert weight dp / ep; ZeRO shards over the replicas."""
        p = self.point.parallel
        item = self.module.itemsize
        local = opt_elems = 0.0
        zero_share = 0.0
        by_group: dict[str, float] = defaultdict(float)
        data = "+".join(a for a in ("ep", "dp") if (p.ep if a == "ep" else p.dp // p.ep) > 1)
        for w in params:
            elems = self._replica_elems(w)
            replicas = p.dp // p.ep if is_expert(w) else p.dp
            local += elems
            zero_share += elems / replicas
            by_group["dp" if is_expert(w) else data] += elems
        opt_elems = zero_share if p.zero >= 1 else local
        memory = {TensorKind.PARAMETER: (zero_share if p.zero == 3 else local) * item}
        if not self.train:
            return None, memory
        memory[TensorKind.GRADIENT] = (zero_share if p.zero >= 2 else local) * item
        memory[TensorKind.OPTIMIZER_STATE] = opt_elems * OPTIMIZER_STATE_BYTES
        emitter = Emitter()
        adam = emitter.emit(
            Op(
                "adam",
                OpKind.COMPUTE,
                "optimizer",
                flops=ADAM_FLOPS * opt_elems,
                bytes=ADAM_BYTES * opt_elems,
                deps=(BLOCK_INPUT,),
            )
        )
        # ZeRO-1/2: every replica group gathers the updated weights it sharded (experts over dp / ep ranks)
        for axis, elems in sorted(by_group.items()) if p.zero in (1, 2) else ():
            if axis and (axis != "dp" or p.dp // p.ep > 1):
                emitter.emit(
                    Op(
                        "params.all_gather",
                        OpKind.COLLECTIVE,
                        "all_gather",
                        comm_bytes=elems * item,
                        axis=axis,
                        deps=(adam,),
                    )
                )
        return self.add_block("optimizer", emitter), memory

    def build(self) -> Workload:
        point, module = self.point, self.module
        p, m = point.parallel, point.model
        x = module.activation("x", ("b", "s", "h"))
        tokens = module.tokens()
        embed_table: list[STensor] = []

        def embed() -> STensor:
            out, table = module.embed(tokens)
            embed_table.append(table)
            return out

        kinds = layer_kinds(m)
        traced: dict[LayerKind, Traced] = {}
        for kind in dict.fromkeys(kinds):
            traced[kind] = self.trace(block_name(kind), [x], lambda kind=kind: module.layer(x, kind))
        embedding = self.trace("embed", [], embed)
        tie = embed_table[0] if m.tied_embeddings and p.pp == 1 else None
        head_in = module.activation("x_final", ("b", "s", "h"))
        head = self.trace("head", [head_in], lambda: module.head(head_in, tie))
        self.layer_traces = traced
        self.outside = [embedding, head]

        act_bytes = self.tracer.nbytes(x)
        chunks = p.virtual_stages if p.pp_schedule == "interleaved" else 1
        self.chunks = chunks
        self.sends = self.send_orders()
        per_chunk = m.layers // (p.pp * chunks)
        programs = []
        for stage in range(p.pp):
            vstages = [c * p.pp + stage for c in range(chunks)]
            layers = {c: list(range(v * per_chunk, (v + 1) * per_chunk)) for c, v in enumerate(vstages)}
            first, last = stage == 0, stage == p.pp - 1
            params = [w for c in layers for i in layers[c] for w in traced[kinds[i]].params]
            params += embedding.params if first else []
            params += head.params if last else []
            optimizer, static = self.optimizer_block(params)
            program = Program(stage, f"stage{stage}")
            for kind, size in static.items():
                program.tensors.append(Tensor(kind.value, kind, size))
            if not self.train:
                cache = sum(traced[kinds[i]].cache_bytes for c in layers for i in layers[c])
                if cache:
                    total = cache * point.micro_batches
                    program.tensors.append(Tensor("kv_cache", TensorKind.KV_CACHE, total))
            self.scheduled(program, stage, layers, kinds, embedding, head, act_bytes, optimizer)
            programs.append(program)

        axes = [("tp", p.tp), ("cp", p.cp)]
        axes += [("ep", p.ep), ("dp", p.dp // p.ep)] if p.ep > 1 else [("dp", p.dp)]
        layout = RankLayout((*axes, ("pp", p.pp)))
        class_of = np.arange(layout.world) // (p.tp * p.cp * p.dp)
        return Workload(
            point.key,
            layout,
            self.blocks,
            programs,
            class_of,
            point.workload.tokens if point.workload.mode != "decode" else point.workload.global_batch,
            model_flops(m, point.workload),
            m.dtype,
        )

    def steps(self, stage: int) -> list[tuple[str, int, int]]:
        """(F or B, micro-batch, chunk) in the order the stage runs them."""
        p, chunks, microbatches = self.point.parallel, self.chunks, self.point.micro_batches
        if not self.train:
            return [("F", mb, c) for c in range(chunks) for mb in range(microbatches)]
        if p.pp_schedule == "interleaved":
            return list(interleaved(p.pp, stage, microbatches, chunks))
        return [(s, mb, 0) for s, mb in SCHEDULES[p.pp_schedule](p.pp, stage, microbatches)]

    def tag(self, mb: int, vstage: int, backward: bool) -> int:
        """Both ends of a transfer compute the same tag, from the sender's forward virtual stage."""
        base = mb if self.chunks == 1 else mb * self.point.parallel.pp * self.chunks + vstage
        return 1 + 2 * base + (1 if backward else 0)

    def send_orders(self) -> dict[tuple[int, int], list[int]]:
        """Per (sender stage, receiver stage), the tags in the order the sender sends them.

        Sends and receives run in order on their streams (as NCCL p2p calls on one stream do), so a receiver
        posts its receives from a sender in that sender's order; with one chunk per stage this is simply
        micro-batch order, with interleaved chunks it lets a receive be posted before the step that reads it."""
        p = self.point.parallel
        vstages = p.pp * self.chunks
        orders: dict[tuple[int, int], list[int]] = defaultdict(list)
        for stage in range(p.pp):
            for step, mb, chunk in self.steps(stage):
                vstage = chunk * p.pp + stage
                if step == "F" and vstage < vstages - 1:
                    orders[(stage, (vstage + 1) % p.pp)].append(self.tag(mb, vstage, False))
                elif step == "B" and vstage > 0:
                    orders[(stage, (vstage - 1) % p.pp)].append(self.tag(mb, vstage - 1, True))
        return orders

    def scheduled(
        self,
        program: Program,
        stage: int,
        layers: dict[int, list[int]],
        kinds: list[LayerKind],
        embed: Traced,
        head: Traced,
        act_bytes: float,
        optimizer: int | None,
    ) -> None:
        """`schedule`, or its skeleton from an earlier point of the same shape with this point's sizes.

        The calls of a stage depend only on the shape of the step (stages, chunks, micro-batches, layer kinds,
        block numbering, when gradients sync), not on sizes; only the activation bytes differ, and those come
        from this point's traced blocks. A study's points share few shapes, so most generations skip the walk
        over every layer and micro-batch."""
        p = self.point.parallel
        traces = (embed, head, *self.layer_traces.values())
        key = (
            stage, p.pp, self.chunks, p.pp_schedule, self.point.micro_batches, self.train, p.zero >= 2,
            len(self.blocks), tuple(self.p2p.items()), optimizer, tuple(kinds),
            tuple((c, tuple(indices)) for c, indices in layers.items()),
            tuple((t.forward, t.backward, t.sync) for t in traces),
        )
        skeleton = _SKELETONS.get(key)
        if skeleton is None:
            first_p2p, first_tensor = len(self.p2p), len(program.tensors)
            sources = self.schedule(program, stage, layers, kinds, embed, head, act_bytes, optimizer)
            added = program.tensors[first_tensor:]
            skeleton = _Skeleton(
                CallShape(tuple(program.calls)),
                tuple(list(self.p2p)[first_p2p:]),
                tuple((t.name, source, t.producer, t.consumer) for t, source in zip(added, sources, strict=True)),
            )
            if len(_SKELETONS) >= SKELETON_CACHE_SIZE:
                _SKELETONS.clear()
            _SKELETONS[key] = skeleton
            skeleton.tensors[self._saved_bytes(embed, head)] = tuple(added)
            program.shape = skeleton.shape
            return
        sizes = self._saved_bytes(embed, head)
        for kind, peer in skeleton.p2p:
            self.p2p_block(kind, peer, act_bytes)
        program.calls = list(skeleton.shape.calls)
        program.shape = skeleton.shape
        # Tensors are immutable: points whose saved bytes match (another ZeRO stage, another network) share them.
        activations = skeleton.tensors.get(sizes)
        if activations is None:
            saved = dict(sizes)
            activations = tuple(
                Tensor(name, TensorKind.ACTIVATION, saved[source], producer, consumer)
                for name, source, producer, consumer in skeleton.activations
            )
            if len(skeleton.tensors) >= SKELETON_TENSOR_SETS:
                skeleton.tensors.clear()
            skeleton.tensors[sizes] = activations
        program.tensors += activations

    def _saved_bytes(self, embed: Traced, head: Traced) -> tuple[tuple[str | LayerKind, float], ...]:
        """The bytes each block kind's activation tensor holds, as the skeleton names them."""
        saved: dict[str | LayerKind, float] = {"embed": embed.saved_bytes, "head": head.saved_bytes}
        saved.update((kind, traced.saved_bytes) for kind, traced in self.layer_traces.items())
        return tuple(saved.items())

    def schedule(
        self,
        program: Program,
        stage: int,
        layers: dict[int, list[int]],
        kinds: list[LayerKind],
        embed: Traced,
        head: Traced,
        act_bytes: float,
        optimizer: int | None,
    ) -> list[str | LayerKind]:
        """Calls of one stage in its pipeline schedule order, with the activations they keep alive; returns the
        block (embed, head or a layer kind) whose saved bytes each activation tensor holds."""
        p = self.point.parallel
        microbatches = self.point.micro_batches
        chunks = self.chunks
        vstages = p.pp * chunks
        sync_every = p.zero >= 2
        fwd_call: dict[tuple[int, int], int] = {}
        syncs: list[int] = []
        synced: set[int] = set()

        sources: list[str | LayerKind] = []

        def keep(name: str, source: str | LayerKind, nbytes: float, producer: int, consumer: int) -> None:
            program.tensors.append(Tensor(name, TensorKind.ACTIVATION, nbytes, producer, consumer))
            sources.append(source)

        def sync(traced: Traced, after: int, mb: int, index: int) -> None:
            last_mb = mb == microbatches - 1
            if traced.sync is not None and (sync_every or last_mb) and (index, mb) not in synced:
                synced.add((index, mb))
                syncs.append(program.add(Call(traced.sync, (after,), index, mb)))

        tag = self.tag
        posted: dict[int, int] = {}
        cursor: dict[int, int] = defaultdict(int)

        def peer(vstage: int, step: int) -> int:
            """Offset along pp of the rank holding virtual stage vstage + step."""
            return (vstage + step) % p.pp - stage

        def post(source_vstage: int, wanted: int) -> None:
            """Post the receives from the stage holding source_vstage, in its send order, up to `wanted`."""
            source = source_vstage % p.pp
            order = self.sends[(source, stage)]
            while wanted not in posted:
                t = order[cursor[source]]
                cursor[source] += 1
                recv = self.p2p_block(OpKind.RECV, source - stage, act_bytes)
                mb_of = (t - 1) // 2 // (1 if chunks == 1 else vstages)
                posted[t] = program.add(Call(recv, (), -1, mb_of, t))

        def receive(source_vstage: int, wanted: int) -> int:
            post(source_vstage, wanted)
            return posted.pop(wanted)

        steps = self.steps(stage)

        def prefetch(i: int) -> None:
            """Before a step's send, post the receive the next step reads (Megatron's send_forward_recv_forward
            and send_backward_recv_backward), so neither end's send waits behind the other's."""
            if i >= len(steps):
                return
            step, mb, chunk = steps[i]
            vstage = chunk * p.pp + stage
            if step == "F" and vstage > 0:
                post(vstage - 1, tag(mb, vstage - 1, False))
            elif step == "B" and vstage < vstages - 1:
                post(vstage + 1, tag(mb, vstage, True))

        for i, (step, mb, chunk) in enumerate(steps):
            vstage = chunk * p.pp + stage
            first, last = vstage == 0, vstage == vstages - 1
            if step == "F":
                if first:
                    prev = program.add(Call(embed.forward, (), -1, mb))
                    fwd_call[(-1, mb)] = prev
                else:
                    prev = receive(vstage - 1, tag(mb, vstage - 1, False))
                for index in layers[chunk]:
                    prev = program.add(Call(self.layer_traces[kinds[index]].forward, (prev,), index, mb))
                    fwd_call[(index, mb)] = prev
                if last:
                    fwd_call[(-2, mb)] = program.add(Call(head.forward, (prev,), -2, mb))
                else:
                    if chunks > 1:
                        prefetch(i + 1)
                    send = self.p2p_block(OpKind.SEND, peer(vstage, +1), act_bytes)
                    program.add(Call(send, (prev,), -1, mb, tag(mb, vstage, False)))
                continue
            if last:
                assert head.backward is not None
                prev = program.add(Call(head.backward, (fwd_call[(-2, mb)],), -2, mb))
                keep("head", "head", head.saved_bytes, fwd_call[(-2, mb)], prev)
                sync(head, prev, mb, -2)
            else:
                prev = receive(vstage + 1, tag(mb, vstage, True))
            for index in reversed(layers[chunk]):
                traced = self.layer_traces[kinds[index]]
                assert traced.backward is not None
                prev = program.add(Call(traced.backward, (prev, fwd_call[(index, mb)]), index, mb))
                keep(f"layer{index}", kinds[index], traced.saved_bytes, fwd_call[(index, mb)], prev)
                sync(traced, prev, mb, index)
            if first:
                assert embed.backward is not None
                done = program.add(Call(embed.backward, (prev, fwd_call[(-1, mb)]), -1, mb))
                keep("embed", "embed", embed.saved_bytes, fwd_call[(-1, mb)], done)
                sync(embed, done, mb, -1)
            else:
                if chunks > 1:
                    prefetch(i + 1)
                send = self.p2p_block(OpKind.SEND, peer(vstage, -1), act_bytes)
                program.add(Call(send, (prev,), -1, mb, tag(mb, vstage - 1, True)))
        if optimizer is not None:
            program.add(Call(optimizer, tuple(syncs) or (len(program.calls) - 1,)))
        return sources


@dataclass(frozen=True, slots=True)
class _Skeleton:
    """One stage's schedule without sizes: its calls, the p2p blocks it made, its activation tensors' lifetimes
    and the block whose saved bytes each holds. Every program built from it carries its `shape`, on which cost
    models keep what they derive from the calls alone."""

    shape: CallShape
    p2p: tuple[tuple[OpKind, int], ...]
    activations: tuple[tuple[str, str | LayerKind, int, int], ...]
    tensors: dict[tuple, tuple[Tensor, ...]] = field(default_factory=dict)
    """The activation tensors built for recent points, by their blocks' saved bytes."""


SKELETON_CACHE_SIZE = 256
SKELETON_TENSOR_SETS = 4
_SKELETONS: dict[tuple, _Skeleton] = {}
"""Per process (an evaluator actor keeps it across trials); emptied when full."""


class SymbolicGenerator:
    name = "symbolic"

    def generate(self, point: DesignPoint) -> Workload:
        return _Builder(point).build()


def count_parameters(point: DesignPoint) -> int:
    """Parameters of the model as the generated graph holds them (full, unsharded sizes)."""
    builder = _Builder(point)
    builder.build()
    tr, item = builder.tracer, builder.module.itemsize
    kinds = layer_kinds(point.model)
    total = 0.0
    for kind, traced in builder.layer_traces.items():
        total += kinds.count(kind) * sum(tr.full_bytes(w) for w in traced.params) / item
    tied_copy = "lm_head" if point.model.tied_embeddings else None
    for traced in builder.outside:
        total += sum(tr.full_bytes(w) for w in traced.params if w.name != tied_copy) / item
    return round(total)
