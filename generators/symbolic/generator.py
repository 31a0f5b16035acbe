"""Assembling traced blocks and a pipeline schedule into a Workload."""

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dse.modelstats import model_flops
from dse.spec import DesignPoint
from dse.workload import (
    BLOCK_INPUT,
    Block,
    Call,
    Op,
    OpKind,
    Program,
    RankLayout,
    Tensor,
    TensorKind,
    Workload,
)
from generators.symbolic.autodiff import Differentiator, saved_activations
from generators.symbolic.dense import DenseModule
from generators.symbolic.dist import DUP, Dist, Partition, gradient_layout
from generators.symbolic.graph import Emitter, Node, STensor
from generators.symbolic.schedule import SCHEDULES

OPTIMIZER_STATE_BYTES = 12
"""fp32 master weights, Adam momentum and variance per parameter (ZeRO paper's K = 12)."""
ADAM_FLOPS = 12
ADAM_BYTES = 28
"""Per parameter: read the bf16 gradient and the three fp32 states, write the states and the bf16 weight."""


@dataclass
class Traced:
    """A module traced once: its forward and backward blocks and what they imply for memory and sync."""

    forward: int
    backward: int
    sync: int | None
    saved_bytes: float
    params: list[STensor] = field(default_factory=list)


class _Builder:
    def __init__(self, point: DesignPoint):
        self.point = point
        self.module = DenseModule(point)
        self.tracer = self.module.tracer
        self.blocks: list[Block] = []
        self.synced: set[int] = set()

    def add_block(self, name: str, emitter: Emitter, output: int = -1) -> int:
        temp = emitter.peak_temp + emitter.gathered_params
        self.blocks.append(Block(name, tuple(emitter.ops), output, temp))
        return len(self.blocks) - 1

    def _replayed(self, name: str, tape: Sequence[Node]) -> list[Node]:
        policy = self.point.parallel.recompute
        if name != "layer" or policy == "none":
            return []
        if policy == "full":
            return list(tape)
        return [n for n in tape if n.kind == "attention"]

    def trace(self, name: str, inputs: Sequence[STensor], forward: Callable[[], STensor]) -> Traced:
        tr = self.tracer
        first_param = len(self.module.params)
        tr.tape, tr.recording = [], True
        tr.begin_block(inputs)
        out = forward()
        fwd = tr.end_block()
        tape = tr.tape
        params = self.module.params[first_param:]

        tr.recording = False
        layout = {axis: gradient_layout(out.dist(axis)) for axis in tr.degrees}
        grad_out = STensor(f"{out.name}.grad", out.dims, tuple(sorted(layout.items())), out.itemsize)
        grad_out = grad_out.relayout("tp", layout.get("tp", DUP))
        tr.begin_block([grad_out])
        diff = Differentiator(tr, tape, self.module.leaf_ids)
        replayed = self._replayed(name, tape)
        diff.replay(replayed)
        grads = diff.run([(out, grad_out)], inputs)
        bwd = tr.end_block()
        input_grad_ops = [bwd.origin[id(g)] for g in grads.inputs.values() if id(g) in bwd.origin]
        output = max(input_grad_ops) if input_grad_ops else -1

        saved = sum(tr.nbytes(t) for t in saved_activations(tape, replayed))
        forward_block = self.add_block(f"{name}.forward", fwd)
        backward_block = self.add_block(f"{name}.backward", bwd, output)
        sync = self.grad_sync(name, grads.params)
        return Traced(forward_block, backward_block, sync, saved, params)

    def grad_sync(self, name: str, grads: list[tuple[STensor, STensor]]) -> int | None:
        """One bucket per collective and axis: the gradient reduction of every parameter of the module."""
        tr, zero = self.tracer, self.point.parallel.zero
        tr.begin_block([g for _, g in grads])
        for param, grad in grads:
            if id(param) in self.synced:
                continue
            self.synced.add(id(param))
            target: dict[str, Dist] = {"tp": gradient_layout(param.dist("tp"))}
            target["dp"] = DUP if zero == 0 else Partition(param.dims[0])
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

    def p2p_block(self, name: str, kind: OpKind, peer: int, size: float) -> int:
        emitter = Emitter()
        deps = (BLOCK_INPUT,) if kind is OpKind.SEND else ()
        emitter.emit(Op(name, kind, kind.value, comm_bytes=size, axis="pp", peer=peer, deps=deps))
        return self.add_block(name, emitter)

    def optimizer_block(self, params: list[STensor]) -> tuple[int, dict[TensorKind, float]]:
        """The Adam step over this stage's share of the parameters, and the static memory of model states."""
        tr, p = self.tracer, self.point.parallel
        tp_local = sum(tr.elems(w.relayout("dp", DUP)) for w in params)
        item = self.module.itemsize
        opt_elems = tp_local / p.dp if p.zero >= 1 else tp_local
        memory = {
            TensorKind.PARAMETER: tp_local * item / (p.dp if p.zero == 3 else 1),
            TensorKind.GRADIENT: tp_local * item / (p.dp if p.zero >= 2 else 1),
            TensorKind.OPTIMIZER_STATE: opt_elems * OPTIMIZER_STATE_BYTES,
        }
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
        if p.zero in (1, 2) and p.dp > 1:
            emitter.emit(
                Op(
                    "params.all_gather",
                    OpKind.COLLECTIVE,
                    "all_gather",
                    comm_bytes=tp_local * item,
                    axis="dp",
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

        layer = self.trace("layer", [x], lambda: module.layer(x))
        stage_layers = m.layers // p.pp
        embedding = self.trace("embed", [], embed)
        tie = embed_table[0] if m.tied_embeddings and p.pp == 1 else None
        head_in = module.activation("x_final", ("b", "s", "h"))
        head = self.trace("head", [head_in], lambda: module.head(head_in, tie))

        act_bytes = self.tracer.nbytes(x)
        sends = {
            "send_fwd": self.p2p_block("send_fwd", OpKind.SEND, +1, act_bytes),
            "recv_fwd": self.p2p_block("recv_fwd", OpKind.RECV, -1, act_bytes),
            "send_bwd": self.p2p_block("send_bwd", OpKind.SEND, -1, act_bytes),
            "recv_bwd": self.p2p_block("recv_bwd", OpKind.RECV, +1, act_bytes),
        }
        programs = []
        for stage in range(p.pp):
            first, last = stage == 0, stage == p.pp - 1
            params = layer.params * stage_layers
            params += embedding.params if first else []
            params += head.params if last else []
            optimizer, static = self.optimizer_block(params)
            program = Program(stage, f"stage{stage}")
            for kind, size in static.items():
                program.tensors.append(Tensor(kind.value, kind, size))
            self.schedule(
                program,
                stage,
                layer,
                embedding if first else None,
                head if last else None,
                sends,
                stage_layers,
                optimizer,
            )
            programs.append(program)

        layout = RankLayout((("tp", p.tp), ("cp", p.cp), ("dp", p.dp), ("pp", p.pp)))
        class_of = np.arange(layout.world) // (p.tp * p.cp * p.dp)
        return Workload(
            point.key,
            layout,
            self.blocks,
            programs,
            class_of,
            point.workload.tokens,
            model_flops(m, point.workload),
            m.dtype,
        )

    def schedule(
        self,
        program: Program,
        stage: int,
        layer: Traced,
        embed: Traced | None,
        head: Traced | None,
        sends: dict[str, int],
        stage_layers: int,
        optimizer: int,
    ) -> None:
        """Calls of one stage in its pipeline schedule order, with the activations they keep alive."""
        p = self.point.parallel
        microbatches = self.point.micro_batches
        sync_every = p.zero >= 2
        fwd_call: dict[tuple[int, int], int] = {}
        syncs: list[int] = []
        first_layer = stage * stage_layers
        layers = range(first_layer, first_layer + stage_layers)

        def keep(name: str, nbytes: float, producer: int, consumer: int) -> None:
            program.tensors.append(Tensor(name, TensorKind.ACTIVATION, nbytes, producer, consumer))

        def sync(traced: Traced, after: int, mb: int, index: int) -> None:
            if traced.sync is not None and (sync_every or mb == microbatches - 1):
                syncs.append(program.add(Call(traced.sync, (after,), index, mb)))

        for step, mb in SCHEDULES[p.pp_schedule](p.pp, stage, microbatches):
            tag_base = 1 + 2 * mb
            if step == "F":
                if embed is not None:
                    prev = program.add(Call(embed.forward, (), -1, mb))
                    fwd_call[(-1, mb)] = prev
                else:
                    prev = program.add(Call(sends["recv_fwd"], (), -1, mb, tag_base))
                for index in layers:
                    prev = program.add(Call(layer.forward, (prev,), index, mb))
                    fwd_call[(index, mb)] = prev
                if head is not None:
                    fwd_call[(-2, mb)] = program.add(Call(head.forward, (prev,), -2, mb))
                else:
                    program.add(Call(sends["send_fwd"], (prev,), -1, mb, tag_base))
                continue
            if head is not None:
                prev = program.add(Call(head.backward, (fwd_call[(-2, mb)],), -2, mb))
                keep("head", head.saved_bytes, fwd_call[(-2, mb)], prev)
                sync(head, prev, mb, -2)
            else:
                prev = program.add(Call(sends["recv_bwd"], (), -1, mb, tag_base + 1))
            for index in reversed(layers):
                prev = program.add(Call(layer.backward, (prev, fwd_call[(index, mb)]), index, mb))
                keep(f"layer{index}", layer.saved_bytes, fwd_call[(index, mb)], prev)
                sync(layer, prev, mb, index)
            if embed is not None:
                done = program.add(Call(embed.backward, (prev, fwd_call[(-1, mb)]), -1, mb))
                keep("embed", embed.saved_bytes, fwd_call[(-1, mb)], done)
                sync(embed, done, mb, -1)
            else:
                program.add(Call(sends["send_bwd"], (prev,), -1, mb, tag_base + 1))
        program.add(Call(optimizer, tuple(syncs) or (len(program.calls) - 1,)))


class SymbolicGenerator:
    name = "symbolic"

    def generate(self, point: DesignPoint) -> Workload:
        return _Builder(point).build()


def count_parameters(point: DesignPoint) -> int:
    """Parameters of the model as the generated graph holds them (full, unsharded sizes)."""
    builder = _Builder(point)
    builder.build()
    module = builder.module
    outside = ("wte", "wpe", "lm_head", "ln_f")
    layer_params = [w for w in module.params if not w.name.startswith(outside)]
    per_layer = sum(builder.tracer.full_bytes(w) for w in layer_params) / module.itemsize
    tied_copy = "lm_head" if point.model.tied_embeddings else None
    others = sum(
        builder.tracer.full_bytes(w) for w in module.params if w.name.startswith(outside) and w.name != tied_copy
    )
    return round(per_layer * point.model.layers + others / module.itemsize)
