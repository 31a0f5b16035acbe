"""Tracing a point's modules: every distinct layer, the embedding and the head, each once, into the workload's first
blocks (forward; in training also the derived backward with what it recomputes, the gradient sync, and ZeRO-3's
prefetched weight gathers), or replaying a recording of the same structure (`recording`).

Each kind of layer (a mixer and an MLP: attention + dense, MLA + MoE, SSM, ...) is traced once and shared by every
layer, micro-batch and stage that runs it. Training traces forward and the derived backward; prefill and decode
trace the forward only and hold KV caches (or SSM states) instead of gradients.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from dse.fields import DTYPE_BYTES
from dse.spec import DesignPoint
from dse.workload import Block, Collective
from generators.symbolic.autodiff import (
    Differentiator,
    Gradients,
    read_by_backward,
    saved_activations,
    saved_bytes,
)
from generators.symbolic.blocks import (
    GradPiece,
    LayerKey,
    Modules,
    Traced,
    add_block,
    block_of,
    layer_block_name,
    only_ops,
    split_weight_gradients,
)
from generators.symbolic.dense import DenseModule
from generators.symbolic.dist import DUP, gradient_layout
from generators.symbolic.emitter import Emitter
from generators.symbolic.fsdp import FsdpCopies
from generators.symbolic.optimizer import gradient_sync, weight_elements
from generators.symbolic.recording import RECORDED_DEGREES, Recording, keep_recording, recorded_modules, trace_structure
from generators.symbolic.sharding import Sharding, without_ops
from generators.symbolic.tape import Tape
from generators.symbolic.tensors import Node, STensor
from generators.symbolic.tp_overlap import overlap_tp_comm


@dataclass
class ZeroSibling:
    """While a trace of ZeRO 0 (or of ZeRO 1 or 2) is recorded, the gradient syncs of the other side, so that one
    walk records both: the two traces differ only there (an all-reduce of each gradient or a reduce-scatter; what
    ZeRO 1 and 2 keep is the schedule's and the optimizer's business), and the syncs are a small part of a trace.
    Its numbers go on the same tape, so a replay of either checks the guards of both (a superset of its own)."""

    zero: int
    """The other side's ZeRO stage: 0, or 1 for ZeRO 1 and 2 (`gradient_sync` reads only whether it is 0)."""
    synced: set[int] = field(default_factory=set)
    """`ModuleTracer.synced` of the other side."""
    blocks: dict[int, Block] = field(default_factory=dict)
    """By the index of a module's gradient-sync block, the other side's block there."""
    pieces: dict[int, tuple[GradPiece, ...]] = field(default_factory=dict)
    """By that index, the other side's `Traced.grad_pieces`."""
    alike: bool = True
    """Whether the two sides have gradient syncs in the same modules (else the blocks are numbered otherwise, and
    the other side is not kept)."""

    def add(self, sync: int | None, ops: Emitter | None, pieces: tuple[GradPiece, ...], name: str) -> None:
        """The other side's gradient sync of the module whose own sync block is `sync`."""
        if (ops is None) != (sync is None):
            self.alike = False
        elif sync is not None and ops is not None:
            self.blocks[sync] = block_of(name, ops)
            self.pieces[sync] = pieces

    def modules(self, own: Modules) -> Modules:
        """The other side's modules: `own` with its gradient syncs."""

        def traced(t: Traced) -> Traced:
            if t.sync is None:
                return t
            unrecomputed = None if t.unrecomputed is None else traced(t.unrecomputed)
            return replace(t, grad_pieces=self.pieces[t.sync], unrecomputed=unrecomputed)

        blocks = [self.blocks.get(index, block) for index, block in enumerate(own.blocks)]
        layers = {key: traced(t) for key, t in own.layers.items()}
        return Modules(blocks, layers, traced(own.embedding), traced(own.head), own.table, own.tied, own.weights)


class ModuleTracer:
    """Traces the modules of one point into `blocks`, each distinct one once."""

    def __init__(self, point: DesignPoint):
        self.point = point
        self.train = point.workload.mode == "train"
        self.module = DenseModule(point)
        self.tracer = self.module.tracer
        self.blocks: list[Block] = []
        self.synced: set[int] = set()
        """Ids of the parameters whose gradients a module traced before syncs (a tied weight syncs once)."""
        self.sibling: ZeroSibling | None = None
        """While recording a trace of ZeRO below 3, the other side's gradient syncs (`ZeroSibling`)."""
        p = point.parallel
        self.sharding = Sharding.of(p)
        shard = self.sharding.shard if self.sharding.shard < p.dp else None
        self.fsdp = (
            FsdpCopies(p.fsdp, self.tracer.degrees, self.module.itemsize, DTYPE_BYTES[p.fsdp_reduce_dtype], shard)
            if p.zero == 3
            else None
        )

    def gather_block(self, name: str, emitter: Emitter) -> int | None:
        """The weight all-gathers a prefetching block's ops read, as a block of their own."""
        if not emitter.gathers:
            return None
        self.blocks.append(Block(f"{name}.gather", tuple(emitter.gathers)))
        return len(self.blocks) - 1

    def _add(self, block: Block) -> int:
        self.blocks.append(block)
        return len(self.blocks) - 1

    def _replayed(self, name: str, tape: Sequence[Node]) -> tuple[list[Node], list[Node]]:
        """Nodes recomputed in backward, and those of them whose output is stored all the same."""
        policy = self.point.parallel.recompute
        if not name.startswith("layer") or policy == "none":
            return [], []
        if policy == "full":
            return list(tape), []
        if policy == "selective_op":
            replayed = _per_op_recomputed(tape)
            return (replayed if self.module.eager else read_by_backward(tape, replayed)), []
        attention = [n for n in tape if n.kind == "attention"]
        # Megatron's selective recompute re-runs the unfused core attention (QK^T, softmax, dropout, over V) and
        # keeps its output, which the output projection reads; a fused kernel's output is recomputed with it.
        kept = attention if not self.point.model.flash_attention else []
        return attention, kept

    def trace(self, name: str, inputs: Sequence[STensor], forward: Callable[[], STensor]) -> Traced:
        """The module `forward` computes from `inputs`, traced into the blocks of its forward and, in training, of
        its derived backward, gradient sync and prefetched weight gathers."""
        tr = self.tracer
        first_param = len(self.module.params)
        first_cache = len(self.module.caches)
        tr.tape, tr.recording = [], True
        tr.begin_block(inputs)
        # ZeRO-3 weight gathers get calls of their own, issued `parallel.fsdp_prefetch` modules ahead (FSDP's
        # forward and backward prefetch); see `weight_gathers`.
        tr.emitter.prefetch = self.train and self.point.parallel.zero == 3
        tr.emitter.fsdp = self.fsdp
        out = forward()
        fwd = tr.end_block()
        tape = tr.tape
        params = self.module.params[first_param:]
        cache = sum(tr.nbytes(c) for c in self.module.caches[first_cache:])
        if not self.train:
            forward_block = add_block(self.blocks, f"{name}.forward", fwd)
            return Traced(forward_block, None, None, 0.0, params, cache)

        tr.recording = False
        replayed, kept = self._replayed(name, tape)
        bwd, grads, output = self._derive(tape, out, inputs, replayed, fwd.prefetch)
        saved = saved_bytes(tr, tape, replayed, kept)
        forward_block = self._add_layer_block(f"{name}.forward", fwd)
        backward_block, weight_block, unsynced, post_backward = self.backward_blocks(f"{name}.backward", bwd, output)
        sync_ops, pieces = gradient_sync(tr, name, grads.params, self.point.parallel.zero, self.synced)
        sync = None if sync_ops is None else add_block(self.blocks, f"{name}.grad_sync", sync_ops)
        sibling = self.sibling
        if sibling is not None:
            sibling_ops, sibling_pieces = gradient_sync(tr, name, grads.params, sibling.zero, sibling.synced)
            sibling.add(sync, sibling_ops, sibling_pieces, f"{name}.grad_sync")
        gathers = (self.gather_block(f"{name}.forward", fwd), self.gather_block(f"{name}.backward", bwd))
        gathered = (fwd.gathered_params, bwd.gathered_params) if fwd.prefetch else (0.0, 0.0)
        traced = Traced(forward_block, backward_block, sync, saved, params, 0.0, gathers, gathered)
        traced.unsynced, traced.post_backward, traced.grad_pieces = unsynced, post_backward, pieces
        traced.held_forward = self.held_forward(f"{name}.forward", fwd)
        if weight_block is not None:
            traced.backward_weight = weight_block
            traced.held_for_weight = self.held_for_weight(tape, replayed, kept, grads)
        if replayed and self.point.parallel.recompute_every > 1:
            plain, plain_grads, plain_output = self._derive(tape, out, inputs, [], fwd.prefetch)
            plain_block, plain_weight, unsynced, post_backward = self.backward_blocks(
                f"{name}.backward.unrecomputed", plain, plain_output
            )
            traced.unrecomputed = replace(
                traced,
                backward=plain_block,
                backward_weight=plain_weight,
                held_for_weight=self.held_for_weight(tape, [], [], plain_grads) if plain_weight else (0.0, 0.0),
                unsynced=unsynced,
                post_backward=post_backward,
                saved_bytes=saved_bytes(tr, tape, [], []),
                gathers=(gathers[0], self.gather_block(f"{name}.backward.unrecomputed", plain)),
                gathered_bytes=(gathered[0], plain.gathered_params if fwd.prefetch else 0.0),
            )
        return traced

    def held_forward(self, name: str, emitter: Emitter) -> int | None:
        """With weights kept gathered over the step (`Sharding.hold` step), the forward of the micro-batches after
        the first: without FSDP's copies around the gathers, which it does not run."""
        if self.sharding.hold_of(name.partition(".")[0]) != "step" or not emitter.gather_copies:
            return None
        held = without_ops(block_of(name, emitter), set(emitter.gather_copies), f"{name}.held")
        return self._add(self._tp_overlapped(f"{name}.held", held))

    def backward_blocks(
        self, name: str, emitter: Emitter, output: int
    ) -> tuple[int, int | None, int | None, int | None]:
        """A module's backward block, and the blocks some schedules run instead of it or beside it, else None:
        - with a zero-bubble schedule, the backward is its input-gradient half and its weight-gradient half is a
          block of its own (`split_weight_gradients`; feasibility keeps ZeRO 3 away from it);
        - with gradients reduced once per step (`Sharding.grad_per_step`), the backward of the micro-batches before
          the last: without its ZeRO-3 gradient reduce-scatters and their copies (FSDP2 with requires_gradient_sync
          False accumulates the unsharded gradients); and under pipelining those reduce-scatters as a block of
          their own (`Sharding.reduce_after_stage`).
        With weights kept gathered from the forward (`Sharding.hold`) a backward runs no copies around gathers.
        (backward, weight half, unsynced backward, post-backward reduce-scatters)."""
        block = block_of(name, emitter, output)
        if self.point.parallel.pp_schedule in ("zb_h1", "dualpipev"):
            backward, weight = split_weight_gradients(self._tp_overlapped(name, block))
            return self._add(backward), None if weight is None else self._add(weight), None, None
        kept = self.sharding.hold_of(name.partition(".")[0]) in ("microbatch", "step")
        held = set(emitter.gather_copies) if kept else set()
        backward = self._add(self._tp_overlapped(name, without_ops(block, held, name) if held else block))
        reduces = emitter.grad_reduces if self.sharding.grad_per_step else []
        if not reduces:
            return backward, None, None, None
        unsynced_name = f"{name}.unsynced"
        unsynced = self._add(self._tp_overlapped(unsynced_name, without_ops(block, held | set(reduces), unsynced_name)))
        if not self.sharding.reduce_after_stage:
            return backward, None, unsynced, None
        return backward, None, unsynced, self._add(only_ops(block, reduces, f"{name}.post_backward"))

    def held_for_weight(
        self, tape: list[Node], replayed: list[Node], kept: list[Node], grads: Gradients
    ) -> tuple[float, float]:
        """Bytes a deferred weight-gradient half keeps alive: of the saved activations (held from the forward),
        and of what the input-gradient half makes for it (output gradients, recomputed inputs)."""
        saved = {id(t) for t in saved_activations(tape, replayed, kept)}
        reads = grads.weight_reads
        nbytes = self.tracer.nbytes
        return (
            sum(nbytes(t) for key, t in reads.items() if key in saved),
            sum(nbytes(t) for key, t in reads.items() if key not in saved),
        )

    def _add_layer_block(self, name: str, emitter: Emitter, output: int = -1) -> int:
        """Add a traced block, its TP collectives overlapped where `_tp_overlapped` says."""
        return self._add(self._tp_overlapped(name, block_of(name, emitter, output)))

    def _tp_overlapped(self, name: str, block: Block) -> Block:
        """With `tp_comm_overlap`, a layer's TP collectives overlapped as TransformerEngine's userbuffers run them
        (`tp_overlap`; the embedding and the head are not TE layers)."""
        p = self.point.parallel
        return overlap_tp_comm(block, p.tp) if p.tp_comm_overlap and name.startswith("layer") else block

    def _derive(
        self, tape: list[Node], out: STensor, inputs: Sequence[STensor], replayed: list[Node], prefetch: bool
    ) -> tuple[Emitter, Gradients, int]:
        """The backward block of a traced forward that recomputes `replayed` first, its gradients, and the op
        whose end hands the input gradients on."""
        tr = self.tracer
        layout = {axis: gradient_layout(out.dist(axis)) for axis in tr.degrees}
        grad_out = STensor(f"{out.name}.grad", out.dims, tuple(sorted(layout.items())), out.itemsize)
        grad_out = grad_out.relayout("tp", layout.get("tp", DUP))
        # The forward's values are the call's inputs too (the forward call it reads), so what backward does with
        # them alone (recompute, a K/V regather) waits for the call to start, as autograd only reaches a module once
        # the gradient of its output exists, rather than running ahead of the gradient it is part of.
        tr.begin_block([grad_out, *inputs, *(node.output for node in tape)])
        tr.emitter.prefetch = prefetch
        tr.emitter.fsdp = self.fsdp
        diff = Differentiator(tr, tape, self.module.leaf_ids)
        diff.replay(replayed)
        grads = diff.run([(out, grad_out)], inputs)
        bwd = tr.end_block()
        input_grad_ops = [bwd.origin[id(g)] for g in grads.inputs.values() if id(g) in bwd.origin]
        return bwd, grads, max(input_grad_ops) if input_grad_ops else -1

    def trace_modules(self, keys: list[LayerKey]) -> Modules:
        """Every distinct layer, the embedding and the head, traced: their blocks (the first of the workload's)
        and what they imply."""
        point, module = self.point, self.module
        p, m = point.parallel, point.model
        tokens = module.tokens()
        embed_table: list[STensor] = []

        def embed() -> STensor:
            out, table = module.embed(tokens)
            embed_table.append(table)
            return out

        traced: dict[LayerKey, Traced] = {}
        for key in dict.fromkeys(keys):
            x_in = module.activation("x", ("b", "s", "h"), key[2])
            traced[key] = self.trace(
                layer_block_name(key), [x_in], lambda key=key, x_in=x_in: module.layer(x_in, key[0], key[1])
            )
        # the tokens are the embedding's input, so that its lookup waits for what its call waits for (the step's
        # gather of the updated table, a blocking pipeline transfer before it)
        embedding = self.trace("embed", [tokens], embed)
        # a tied table is one weight where the embedding and the head share a stage: one stage, or DualPipeV's V
        tie = embed_table[0] if m.tied_embeddings and (p.pp == 1 or p.pp_schedule == "dualpipev") else None
        head_in = module.activation("x_final", ("b", "s", "h"), p.layer_strategy(m.layers - 1))
        head = self.trace("head", [head_in], lambda: module.head(head_in, tie))
        return Modules(self.blocks, traced, embedding, head, embed_table[0], tie is not None)

    def modules(self, keys: list[LayerKey]) -> Modules:
        """`trace_modules` for this point: replayed from the recording of an earlier point of the same structure
        (see `recording`), or traced with recording sizes and kept for later points.

        The recorded sizes are the tracer's dimension sizes and the degrees of the tp, ep and dp axes; which axes
        are split, the cp degree (its ring has a step per rank) and everything else are the structure."""
        tracer = self.tracer
        sizes, degrees, fsdp = tracer.sizes, tracer.degrees, self.fsdp
        recorded = {name: degree for name, degree in degrees.items() if name in RECORDED_DEGREES}
        numbers = {**sizes, **{f"degree.{name}": degree for name, degree in recorded.items()}}
        key = (trace_structure(self.point, keys), tuple(sorted(degrees)))
        zero = self.point.parallel.zero
        shards = zero > 0 if self.train and zero < 3 else None
        modules = recorded_modules(key, numbers, shards)
        if modules is not None:
            return modules
        tape = Tape()
        tracer.use_sizes(
            {name: tape.leaf(name, value) for name, value in sizes.items()},
            degrees | {name: tape.leaf(f"degree.{name}", d) for name, d in recorded.items()},
        )
        if fsdp is not None:
            self.fsdp = replace(fsdp, degrees=tracer.degrees)
        self.sibling = None if shards is None else ZeroSibling(0 if shards else 1)
        traced = self.trace_modules(keys)
        weights = {
            id(w): weight_elements(tracer, w)
            for t in (*traced.layers.values(), traced.embedding, traced.head)
            for w in t.params
        }
        traced = replace(traced, weights=weights)
        tracer.use_sizes(sizes, degrees)
        self.fsdp = fsdp
        sibling, self.sibling = self.sibling, None
        other = sibling.modules(traced) if sibling is not None and sibling.alike else None
        recording = Recording(tape, traced, shards, other)
        keep_recording(key, recording)
        return recording.numeric(tape.values, shards)


def _per_op_recomputed(tape: Sequence[Node]) -> list[Node]:
    """torchtitan's per-op selective checkpointing (`selective_ac_option: op`, its `_save_list`): the outputs of
    attention, of the matmuls except every second one (the 2nd, 4th, ... of the layer) and of the tensor-parallel
    reduce-scatters are saved; every other op is recomputed in backward from what is saved."""
    saved: set[int] = set()
    matmuls = 0
    for node in tape:
        if node.kind == "einsum":
            matmuls += 1
            if matmuls % 2:
                saved.add(id(node))
        elif node.kind == "attention" or any(op.category == Collective.REDUCE_SCATTER for op in node.ops):
            saved.add(id(node))
    return [node for node in tape if id(node) not in saved]
