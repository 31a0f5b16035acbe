"""Assembling traced blocks and a pipeline schedule into a Workload.

Each kind of layer (a mixer and an MLP: attention + dense, MLA + MoE, SSM, ...) is traced once and shared by
every layer, micro-batch and stage that runs it; programs (one per pipeline stage) are sequences of calls to those
blocks in the order of the pipeline schedule. Training traces forward and the derived backward; prefill and
decode trace the forward only and hold KV caches (or SSM states) instead of gradients.

The trace is a structure (layouts, collectives, the derived backward) with numbers made of the point's sizes. It
is recorded once per model family, parallel layout and kind of step, over the sizes (the model's widths among
them) and the tp, ep and dp degrees, and later points of that structure replay the recording with their own
(`tape`, `trace_structure`): the walk runs once, the arithmetic per point. The pipeline schedule is likewise
walked once per shape (`_Skeleton`).
"""

from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from dse.modelstats import LayerKind, layer_kinds, model_flops
from dse.spec import DTYPE_BYTES, DesignPoint, MLASpec, ModelSpec, MoESpec, ParallelSpec, Spec, SSMSpec
from dse.workload import (
    BLOCK_INPUT,
    Block,
    Call,
    CallShape,
    Collective,
    DeferredPrograms,
    Op,
    OpKind,
    Program,
    RankLayout,
    SteadyForm,
    TableTensors,
    Tensor,
    TensorKind,
    TensorTable,
    Workload,
    tensor_columns,
)
from generators.symbolic.autodiff import Differentiator, Gradients, read_by_backward, saved_bytes
from generators.symbolic.dense import DenseModule
from generators.symbolic.dist import DUP, Dist, Partition, gradient_layout
from generators.symbolic.fsdp import FsdpCopies
from generators.symbolic.graph import Emitter, Node, STensor
from generators.symbolic.schedule import SCHEDULES, interleaved
from generators.symbolic.tape import Sym, Tape

OPTIMIZER_STATE_BYTES = 12
"""fp32 master weights, Adam momentum and variance per parameter (ZeRO paper's K = 12)."""
ADAM_FLOPS = 12
ADAM_BYTES = 28
"""Per parameter: read the bf16 gradient and the three fp32 states, write the states and the bf16 weight."""
DATA_AXES = ("dp", "ep")
TIED_SYNC_TAG = 0
"""The tied-weight gradient exchange's p2p tag: pipeline transfers' tags start at 1 (`_Builder.tag`)."""
Unit = tuple[str | LayerKind, bool]
"""A traced module a call runs: "embed", "head" or a layer kind, and whether it is the layer's variant whose
backward recomputes nothing (see `_Builder.unrecomputed`)."""
Source = tuple[str | LayerKind, bool, int]
"""What sizes a scheduled tensor: a unit and what of it: -1 its saved activations, 0 and 1 the weights its
forward and its backward gather."""


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
    gathers: tuple[int | None, int | None] = (None, None)
    """The blocks of ZeRO-3 weight all-gathers its forward and its backward read, issued one module ahead."""
    gathered_bytes: tuple[float, float] = (0.0, 0.0)
    """Bytes those gathers bring in, held from the gather's start to the end of the call that reads them."""
    unrecomputed: "Traced | None" = None
    """The same layer with a backward that recomputes nothing, for the layers `recompute_every` skips."""


def block_name(kind: LayerKind) -> str:
    """'layer' for the dense transformer layer (every dense model's only kind), else layer.<mixer>.<mlp>."""
    return "layer" if kind == ("attn", "dense") else f"layer.{kind[0]}.{kind[1]}"


LayerKey = tuple[LayerKind, str, str]
"""A layer's kind, its strategy for the tp ranks, and the previous layer's (whose layout its input comes in)."""


def layer_keys(kinds: list[LayerKind], p: ParallelSpec) -> list[LayerKey]:
    """Per layer, what it is traced for: layers alike in all three share one trace. The embedding hands on in
    the tp layout."""
    strategies = [p.layer_strategy(i) for i in range(len(kinds))]
    previous = ["tp", *strategies[:-1]]
    return list(zip(kinds, strategies, previous, strict=True))


def layer_block_name(key: LayerKey) -> str:
    """block_name, marked '.dp' for a layer using the tp ranks as data parallel and '.from_<s>' when its input
    changes layout from the previous layer's strategy s."""
    kind, strategy, previous = key
    name = block_name(kind) + ("" if strategy == "tp" else f".{strategy}")
    return name + ("" if previous == strategy else f".from_{previous}")


def is_expert(param: STensor) -> bool:
    d = param.dist("ep")
    return isinstance(d, Partition) and d.dim == "e" and param.name.startswith("experts.")


@dataclass(frozen=True)
class _Modules:
    """What tracing the modules gives (`_Builder.trace_modules`): the workload's first blocks, and the Traced of
    every layer kind, of the embedding and of the head; with `Sym` numbers when recorded on a tape."""

    blocks: list[Block]
    layers: dict[LayerKey, Traced]
    embedding: Traced
    head: Traced
    table: STensor
    """The embedding's token table."""
    tied: bool
    """Whether the head reads that table (tied embeddings on a single stage)."""


@dataclass
class _Recording:
    """Modules traced with recording sizes (`Sym` numbers), their tape, and per block the slot of every number
    its ops carry (constants have slots too), so that a replay's values make the blocks without a type test
    per field."""

    tape: Tape
    modules: _Modules
    blocks: list[tuple[str, int, int, tuple[tuple, ...]]] = field(init=False)

    def __post_init__(self) -> None:
        slot = self.tape.slot
        self.blocks = [
            (
                b.name,
                b.output,
                slot(b.temp_bytes),
                tuple(
                    (
                        op.name,
                        op.kind,
                        op.category,
                        slot(op.flops),
                        slot(op.bytes),
                        slot(op.density),
                        slot(op.comm_bytes),
                        op.axis,
                        op.peer,
                        op.deps,
                        slot(op.out_bytes),
                    )
                    for op in b.ops
                ),
            )
            for b in self.modules.blocks
        ]

    def numeric(self, values: list) -> _Modules:
        """The modules with every recorded number read from `values` (a replay of the tape)."""
        v = values

        def num(x: Any) -> Any:
            return v[x.slot] if type(x) is Sym else x

        def traced(t: Traced) -> Traced:
            return replace(
                t,
                saved_bytes=num(t.saved_bytes),
                cache_bytes=num(t.cache_bytes),
                gathered_bytes=(num(t.gathered_bytes[0]), num(t.gathered_bytes[1])),
                unrecomputed=None if t.unrecomputed is None else traced(t.unrecomputed),
            )

        blocks = [
            Block(
                name,
                tuple(
                    [
                        Op(n, k, c, v[f], v[b], v[d], v[m], ax, pe, de, v[o])
                        for n, k, c, f, b, d, m, ax, pe, de, o in ops
                    ]
                ),
                output,
                v[temp],
            )
            for name, output, temp, ops in self.blocks
        ]
        m = self.modules
        layers = {key: traced(t) for key, t in m.layers.items()}
        return _Modules(blocks, layers, traced(m.embedding), traced(m.head), m.table, m.tied)


RECORDED_DEGREES = ("tp", "ep", "dp")
"""The parallel degrees a module trace is recorded over (`_Builder.modules`), like the sizes."""


MODEL_SIZES: dict[type, tuple[str, ...]] = {
    ModelSpec: ("name", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "max_seq"),
    MoESpec: ("experts", "expert_ffn", "shared_experts", "first_dense_layers"),
    MLASpec: ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    SSMSpec: ("expand", "dt_rank", "attention_every"),
}
"""Model fields a module trace reads only as the tracer's sizes (DenseModule), or, for the layer counts and
patterns, through which layer kinds there are: the fields a model family's members differ in."""


def _family(spec: Spec) -> Spec:
    """The spec with its size fields blanked (nested sections too): what members of a family share."""
    update: dict[str, Any] = dict.fromkeys(MODEL_SIZES[type(spec)])
    for name in ("moe", "mla", "ssm"):
        section = getattr(spec, name, None)
        if section is not None:
            update[name] = _family(section)
    return spec.model_copy(update=update)


def trace_structure(point: DesignPoint, keys: list[LayerKey]) -> tuple:
    """What a module trace depends on besides the sizes and degrees it is recorded over: the model family and
    the layer kinds there are, the parallel layout but for those degrees, and the kind of step. The model's
    widths, micro-batch size and sequence length are sizes; the few size relations that decide structure are
    named here (grouped-query or not, shared experts or none, a compressed query or a full one)."""
    m, p = point.model, point.parallel
    relations = (
        m.n_kv_heads == m.heads,
        m.moe is not None and m.moe.shared_experts > 0,
        m.mla is not None and m.mla.q_lora_rank is None,
        p.layer_strategy(m.layers - 1),
    )
    # ZeRO 1 and 2 shard the same gradient reductions (the stage decides when they run and what is kept: the
    # schedule's and the optimizer's business, not the trace's)
    layout = tuple(
        (name, min(value, 1) if name == "zero" and value < 3 else value)
        for name, value in p
        if name not in RECORDED_DEGREES
    )
    kinds = tuple(dict.fromkeys(keys))
    return (_family(m), relations, kinds, layout, point.workload.mode, point.workload.kernels)


RECORDING_CACHE_SIZE = 256
RECORDING_VARIANTS = 4
"""Recordings kept per structure whose comparisons came out differently (FSDP1's gradient divide factors with dp
4, 8 and 16), so that points alternating between them replay instead of recording again."""
_RECORDINGS: dict[tuple, list[_Recording]] = {}
"""Per process, like the skeletons; emptied when full."""


class _Builder:
    def __init__(self, point: DesignPoint):
        self.point = point
        self.train = point.workload.mode == "train"
        self.module = DenseModule(point)
        self.tracer = self.module.tracer
        self.microbatches = point.micro_batches
        """How many micro-batches the programs being scheduled run (see `programs`)."""
        self.sends: dict[tuple[int, int], list[int]] | None = None
        """Send orders of the micro-batches being scheduled, found when a stage is walked (`schedule`): a
        skeleton reused from an earlier point needs none."""
        self.blocks: list[Block] = []
        self._shared_blocks: dict[Block, int] = {}
        self.synced: set[int] = set()
        self.p2p: dict[tuple[OpKind, int, str], int] = {}
        self._elems: dict[int, float] = {}
        p = point.parallel
        self.fsdp = (
            FsdpCopies(p.fsdp, self.tracer.degrees, self.module.itemsize, DTYPE_BYTES[p.fsdp_reduce_dtype])
            if p.zero == 3
            else None
        )

    def add_block(self, name: str, emitter: Emitter, output: int = -1, share: bool = False) -> int:
        """The new block's index; with `share`, an equal block added before is reused, so that cost models price
        it once (the optimizer step of pipeline stages that hold alike layers)."""
        temp = emitter.peak_temp + (0.0 if emitter.prefetch else emitter.gathered_params)
        block = Block(name, tuple(emitter.ops), output, temp)
        if share and (index := self._shared_blocks.get(block)) is not None:
            return index
        self.blocks.append(block)
        if share:
            self._shared_blocks[block] = len(self.blocks) - 1
        return len(self.blocks) - 1

    def gather_block(self, name: str, emitter: Emitter) -> int | None:
        """The weight all-gathers a prefetching block's ops read, as a block of their own."""
        if not emitter.gathers:
            return None
        self.blocks.append(Block(f"{name}.gather", tuple(emitter.gathers)))
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
        tr = self.tracer
        first_param = len(self.module.params)
        first_cache = len(self.module.caches)
        tr.tape, tr.recording = [], True
        tr.begin_block(inputs)
        # ZeRO-3 weight gathers get calls of their own, issued one module ahead (FSDP's forward and backward
        # prefetch, FSDP2's implicit prefetch); see `schedule`.
        tr.emitter.prefetch = self.train and self.point.parallel.zero == 3
        tr.emitter.fsdp = self.fsdp
        out = forward()
        fwd = tr.end_block()
        tape = tr.tape
        params = self.module.params[first_param:]
        cache = sum(tr.nbytes(c) for c in self.module.caches[first_cache:])
        if not self.train:
            forward_block = self.add_block(f"{name}.forward", fwd)
            return Traced(forward_block, None, None, 0.0, params, cache)

        tr.recording = False
        replayed, kept = self._replayed(name, tape)
        bwd, grads, output = self._derive(tape, out, inputs, replayed, fwd.prefetch)
        saved = saved_bytes(tr, tape, replayed, kept)
        forward_block = self.add_block(f"{name}.forward", fwd)
        backward_block = self.add_block(f"{name}.backward", bwd, output)
        sync = self.grad_sync(name, grads.params)
        gathers = (self.gather_block(f"{name}.forward", fwd), self.gather_block(f"{name}.backward", bwd))
        gathered = (fwd.gathered_params, bwd.gathered_params) if fwd.prefetch else (0.0, 0.0)
        traced = Traced(forward_block, backward_block, sync, saved, params, 0.0, gathers, gathered)
        if replayed and self.point.parallel.recompute_every > 1:
            plain, _, plain_output = self._derive(tape, out, inputs, [], fwd.prefetch)
            traced.unrecomputed = replace(
                traced,
                backward=self.add_block(f"{name}.backward.unrecomputed", plain, plain_output),
                saved_bytes=saved_bytes(tr, tape, [], []),
                gathers=(gathers[0], self.gather_block(f"{name}.backward.unrecomputed", plain)),
                gathered_bytes=(gathered[0], plain.gathered_params if fwd.prefetch else 0.0),
            )
        return traced

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

    def unrecomputed(self, kind: LayerKind, index: int) -> bool:
        """Whether layer `index` runs its backward without recompute: with `recompute_every` n only every n-th
        layer recomputes (layers n-1, 2n-1, ..., as torchtitan's layer-level selective checkpointing and the FSDP
        blog's checkpointing of every n-th block); the others keep every activation their backward reads."""
        every = self.point.parallel.recompute_every
        return self.layer_traces[kind].unrecomputed is not None and (index + 1) % every != 0

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

    def tied_sync_blocks(self, table: STensor) -> dict[int, int]:
        """With pipeline stages, the first stage's token table and the last stage's LM head are two copies of one
        tied weight: after backward the two stages add up each other's gradient (Megatron's embedding-group
        all-reduce, which over its two ranks moves what one send each way does). By stage, the block doing it."""
        p = self.point.parallel
        if not self.train or p.pp == 1:
            return {}
        size = self._replica_elems(table) * self.module.itemsize
        blocks = {}
        for stage, peer in ((0, p.pp - 1), (p.pp - 1, 1 - p.pp)):
            emitter = Emitter()
            send = Op("tied_grad.send", OpKind.SEND, "send", comm_bytes=size, axis="pp", peer=peer, deps=(BLOCK_INPUT,))
            emitter.emit(send)
            emitter.emit(replace(send, name="tied_grad.recv", kind=OpKind.RECV, category="recv", deps=()))
            blocks[stage] = self.add_block("tied_grad_sync", emitter)
        return blocks

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
            deps = (BLOCK_INPUT,) if kind is OpKind.SEND else ()
            emitter.emit(Op(name, kind, kind.value, comm_bytes=size, axis="pp", peer=peer, deps=deps))
            self.p2p[key] = self.add_block(name, emitter)
        return self.p2p[key]

    def boundary(self, vstage: int) -> str:
        """The strategy of the last layer of a virtual stage: how what crosses to the next one is laid out."""
        return self.point.parallel.layer_strategy(self.vstage_starts[vstage + 1] - 1)

    def _replica_elems(self, w: STensor) -> float:
        """Elements of a weight on one rank before ZeRO shards it; every layer repeats the same weights."""
        elems = self._elems.get(id(w))
        if elems is None:
            unsharded = w.relayout("dp", DUP)
            if not is_expert(w):
                unsharded = unsharded.relayout("ep", DUP)
            elems = self._elems[id(w)] = self.tracer.elems(unsharded)
        return elems

    def optimizer_block(self, modules: list[tuple[Traced, int]]) -> tuple[int | None, dict[TensorKind, float]]:
        """The Adam step over this stage's share of the parameters, and the static memory of model states; the
        stage's modules come with how many layers run each (layers of a kind share their weights' STensors).

        A dense weight has dp (x ep) replicas, an expert weight dp / ep; ZeRO shards over the replicas."""
        p = self.point.parallel
        item = self.module.itemsize
        local = opt_elems = 0.0
        zero_share = 0.0
        by_group: dict[str, float] = defaultdict(float)
        data = "+".join(a for a in ("ep", "dp") if (p.ep if a == "ep" else p.dp // p.ep) > 1)
        uses: dict[int, list] = {}  # a tied table is one weight of two modules: count each weight once
        for traced, layers in modules:
            for w in traced.params:
                use = uses.get(id(w))
                if use is None:
                    uses[id(w)] = [w, layers]
                else:
                    use[1] += layers
        for w, count in uses.values():
            elems = self._replica_elems(w) * count
            expert = is_expert(w)
            local += elems
            zero_share += elems / (p.dp // p.ep if expert else p.dp)
            by_group["dp" if expert else data] += elems
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
        return self.add_block("optimizer", emitter, share=True), memory

    def trace_modules(self) -> "_Modules":
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
        for key in dict.fromkeys(self.layer_keys):
            x_in = module.activation("x", ("b", "s", "h"), key[2])
            traced[key] = self.trace(
                layer_block_name(key), [x_in], lambda key=key, x_in=x_in: module.layer(x_in, key[0], key[1])
            )
        embedding = self.trace("embed", [], embed)
        tie = embed_table[0] if m.tied_embeddings and p.pp == 1 else None
        head_in = module.activation("x_final", ("b", "s", "h"), p.layer_strategy(m.layers - 1))
        head = self.trace("head", [head_in], lambda: module.head(head_in, tie))
        return _Modules(self.blocks, traced, embedding, head, embed_table[0], tie is not None)

    def modules(self) -> "_Modules":
        """`trace_modules` for this point: replayed from the recording of an earlier point of the same structure
        (see `tape`), or traced with recording sizes and kept for later points.

        The recorded sizes are the tracer's dimension sizes and the degrees of the tp, ep and dp axes; which axes
        are split, the cp degree (its ring has a step per rank) and everything else are the structure."""
        tracer = self.tracer
        sizes, degrees, fsdp = tracer.sizes, tracer.degrees, self.fsdp
        recorded = {name: degree for name, degree in degrees.items() if name in RECORDED_DEGREES}
        numbers = {**sizes, **{f"degree.{name}": degree for name, degree in recorded.items()}}
        key = (trace_structure(self.point, self.layer_keys), tuple(sorted(degrees)))
        variants = _RECORDINGS.get(key, [])
        for recording in variants:
            values = recording.tape.replay(numbers)
            if values is not None:
                return recording.numeric(values)
        tape = Tape()
        tracer.use_sizes(
            {name: tape.leaf(name, value) for name, value in sizes.items()},
            degrees | {name: tape.leaf(f"degree.{name}", d) for name, d in recorded.items()},
        )
        if fsdp is not None:
            self.fsdp = replace(fsdp, degrees=tracer.degrees)
        recording = _Recording(tape, self.trace_modules())
        tracer.use_sizes(sizes, degrees)
        self.fsdp = fsdp
        if not variants:
            if len(_RECORDINGS) >= RECORDING_CACHE_SIZE:
                _RECORDINGS.clear()
            _RECORDINGS[key] = variants
        variants.append(recording)
        del variants[:-RECORDING_VARIANTS]
        return recording.numeric(tape.values)

    def build(self) -> Workload:
        point = self.point
        p, m = point.parallel, point.model
        kinds = self.layer_keys = layer_keys(layer_kinds(m), p)
        modules = self.modules()
        self.blocks = list(modules.blocks)
        traced, embedding, head = modules.layers, modules.embedding, modules.head
        self.layer_traces = traced
        self.outside = [embedding, head]
        self.tied_sync = self.tied_sync_blocks(modules.table) if not modules.tied and m.tied_embeddings else {}

        chunks = p.virtual_stages if p.pp_schedule == "interleaved" else 1
        self.chunks = chunks
        # Virtual stage v (chunk v // pp of stage v % pp) runs layers [starts[v], starts[v + 1]); a stage's layers
        # split evenly over its chunks, the first chunks taking one more where they do not divide (uneven stages).
        per_stage = p.stage_layers(m.layers)
        starts = self.vstage_starts = [0]
        for v in range(p.pp * chunks):
            count, chunk = per_stage[v % p.pp], v // p.pp
            starts.append(starts[-1] + count // chunks + (chunk < count % chunks))
        stages: list[_Stage] = []
        for stage in range(p.pp):
            vstages = [c * p.pp + stage for c in range(chunks)]
            layers = {c: list(range(starts[v], starts[v + 1])) for c, v in enumerate(vstages)}
            first, last = stage == 0, stage == p.pp - 1
            counts = Counter(kinds[i] for c in layers for i in layers[c])
            held = [(traced[key], count) for key, count in counts.items()]
            held += [(embedding, 1)] if first else []
            held += [(head, 1)] if last else []
            optimizer, static = self.optimizer_block(held)
            fixed = [Tensor(kind.value, kind, size) for kind, size in static.items()]
            if not self.train:
                cache = sum(traced[kinds[i]].cache_bytes for c in layers for i in layers[c])
                if cache:
                    fixed.append(Tensor("kv_cache", TensorKind.KV_CACHE, cache * point.micro_batches))
            stages.append(_Stage(layers, optimizer, tuple(fixed)))
        steady = self.steady_form(stages, kinds, embedding, head)
        programs: Sequence[Program]
        if steady is None:
            programs = self.programs(stages, point.micro_batches, kinds, embedding, head)
        else:
            programs = DeferredPrograms(
                p.pp, lambda: self.programs(stages, point.micro_batches, kinds, embedding, head)
            )

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
            steady,
        )

    def programs(
        self, stages: "list[_Stage]", microbatches: int, kinds: list[LayerKind], embed: Traced, head: Traced
    ) -> list[Program]:
        """One program per pipeline stage, running `microbatches` micro-batches."""
        self.microbatches = microbatches
        self.sends = None
        programs = []
        for stage, (layers, optimizer, fixed) in enumerate(stages):
            program = Program(stage, f"stage{stage}", tensors=list(fixed))
            self.scheduled(program, stage, layers, kinds, embed, head, optimizer)
            programs.append(program)
        return programs

    def steady_form(
        self, stages: "list[_Stage]", kinds: list[LayerKind], embed: Traced, head: Traced
    ) -> SteadyForm | None:
        """The step with fewer micro-batches that shows its whole pipeline steady state (see SteadyForm and
        `steady_microbatches`). The cost model checks the periods on the timeline and prices the full step where
        they do not show."""
        short = steady_microbatches(self.point)
        if short is None:
            return None
        period = steady_period(self.point)
        repeats = (self.point.micro_batches - short) // period
        return SteadyForm(self.programs(stages, short, kinds, embed, head), short, period, repeats)

    def steps(self, stage: int) -> list[tuple[str, int, int]]:
        """(F or B, micro-batch, chunk) in the order the stage runs them."""
        p, chunks, microbatches = self.point.parallel, self.chunks, self.microbatches
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
        optimizer: int | None,
    ) -> None:
        """`schedule`, or its skeleton from an earlier point of the same shape with this point's sizes.

        The calls of a stage depend only on the shape of the step (stages, chunks, micro-batches, layer kinds,
        block numbering, when gradients sync), not on sizes; only the activation bytes differ, and those come
        from this point's traced blocks. A study's points share few shapes, so most generations skip the walk
        over every layer and micro-batch."""
        traces = (embed, head, *self.layer_traces.values())
        key = (
            stage,
            schedule_shape(self.point),
            self.microbatches,
            len(self.blocks),
            tuple(self.p2p.items()),
            optimizer,
            tuple(kinds),
            tuple((c, tuple(indices)) for c, indices in layers.items()),
            tuple((t.forward, t.backward, t.sync, t.gathers) for t in traces),
        )
        skeleton = _SKELETONS.get(key)
        if skeleton is None:
            first_p2p, first_tensor = len(self.p2p), len(program.tensors)
            sources = self.schedule(program, stage, layers, kinds, embed, head, optimizer)
            own, added = program.tensors[:first_tensor], program.tensors[first_tensor:]
            distinct = tuple(dict.fromkeys(sources))
            place = {source: i for i, source in enumerate(distinct)}
            columns = tensor_columns(added)
            table = TensorTable(
                tuple(t.name for t in added),
                tuple(t.kind for t in added),
                columns.producer,
                columns.consumer,
                columns.kind,
            )
            skeleton = _Skeleton(
                CallShape(tuple(program.calls)),
                tuple(list(self.p2p)[first_p2p:]),
                table,
                distinct,
                np.array([place[source] for source in sources], dtype=np.intp),
            )
            if len(_SKELETONS) >= SKELETON_CACHE_SIZE:
                _SKELETONS.clear()
            _SKELETONS[key] = skeleton
            program.shape = skeleton.shape
            program.tensors = TableTensors(own, table, columns.bytes)
            return
        for kind, peer, strategy in skeleton.p2p:
            self.p2p_block(kind, peer, strategy)
        program.calls = list(skeleton.shape.calls)
        program.shape = skeleton.shape
        nbytes = np.array([self.source_bytes(source, embed, head) for source in skeleton.sources])
        program.tensors = TableTensors(program.tensors, skeleton.table, nbytes[skeleton.source_of])

    def source_bytes(self, source: Source, embed: Traced, head: Traced) -> float:
        """The bytes of a scheduled tensor, from what sizes it (see `Source`)."""
        key, unrecomputed, what = source
        traced = self.unit_trace((key, unrecomputed), embed, head)
        return traced.saved_bytes if what < 0 else traced.gathered_bytes[what]

    def unit_trace(self, unit: Unit, embed: Traced, head: Traced) -> Traced:
        """The traced module a unit of the schedule runs."""
        key, unrecomputed = unit
        if key == "embed":
            return embed
        if key == "head":
            return head
        traced = self.layer_traces[key]  # type: ignore[index]
        if unrecomputed:
            assert traced.unrecomputed is not None
            return traced.unrecomputed
        return traced

    def schedule(
        self,
        program: Program,
        stage: int,
        layers: dict[int, list[int]],
        kinds: list[LayerKind],
        embed: Traced,
        head: Traced,
        optimizer: int | None,
    ) -> list[Source]:
        """Calls of one stage in its pipeline schedule order, with the activations (and prefetched weights) they
        keep alive; returns what sizes each of those tensors (a `Source`)."""
        p = self.point.parallel
        microbatches = self.microbatches
        chunks = self.chunks
        vstages = p.pp * chunks
        sync_every = p.zero >= 2
        fwd_call: dict[tuple[int, int], int] = {}
        last_backward: dict[int, int] = {}
        syncs: list[int] = []
        synced: set[int] = set()

        sources: list[Source] = []

        def keep(
            name: str,
            source: Source,
            nbytes: float,
            producer: int,
            consumer: int,
            kind: TensorKind = TensorKind.ACTIVATION,
        ) -> None:
            program.tensors.append(Tensor(name, kind, nbytes, producer, consumer))
            sources.append(source)

        names = {-1: "embed", -2: "head"} | {i: f"layer{i}" for indices in layers.values() for i in indices}

        def gather(
            units: list[tuple[int, Unit]], pos: int, way: int, after: tuple[int, ...], mb: int
        ) -> tuple[int, ...]:
            """The call that all-gathers the weights of units[pos] for its forward (way 0) or backward (1), if it
            prefetches. It is issued before the unit run ahead of it (`after` is that unit's input), as FSDP
            issues the next module's all-gather before the current one's compute and gradient reduce-scatter, so
            at most two modules' weights are gathered at once (FSDP's one-module prefetch; the weights are freed
            when their module ends)."""
            if not gathering or pos >= len(units):
                return ()
            index, unit = units[pos]
            block = trace_of[unit].gathers[way]
            if block is None:
                return ()
            return (program.add(Call(block, after, index, mb)),)

        def hold(unit: Unit, way: int, index: int, gathered: tuple[int, ...], consumer: int) -> None:
            for producer in gathered:
                nbytes = trace_of[unit].gathered_bytes[way]
                keep(f"{names[index]}.weights", (*unit, way), nbytes, producer, consumer, TensorKind.TEMPORARY)

        def sync(traced: Traced, after: int, mb: int, index: int) -> None:
            """The module's gradient sync after its backward, once per micro-batch that syncs (see its caller)."""
            if (index, mb) not in synced:
                synced.add((index, mb))
                syncs.append(program.add(Call(traced.sync, (after,), index, mb)))

        tag = self.tag
        posted: dict[int, int] = {}
        cursor: dict[int, int] = defaultdict(int)

        def peer(vstage: int, step: int) -> int:
            """Offset along pp of the rank holding virtual stage vstage + step."""
            return (vstage + step) % p.pp - stage

        if self.sends is None:
            self.sends = self.send_orders()
        sends = self.sends

        def post(source_vstage: int, wanted: int) -> None:
            """Post the receives from the stage holding source_vstage, in its send order, up to `wanted`."""
            source = source_vstage % p.pp
            order = sends[(source, stage)]
            while wanted not in posted:
                t = order[cursor[source]]
                cursor[source] += 1
                base, backward = divmod(t - 1, 2)
                # the boundary the transfer crosses: tags of interleaved schedules name it, else the sender's stage
                crossed = base % vstages if chunks > 1 else source - backward
                recv = self.p2p_block(OpKind.RECV, source - stage, self.boundary(crossed))
                mb_of = base // (1 if chunks == 1 else vstages)
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

        in_order: dict[int, list[tuple[int, Unit]]] = {}
        """Per chunk, the modules a forward runs (a backward runs them reversed)."""
        for chunk, indices in layers.items():
            vstage = chunk * p.pp + stage
            units: list[tuple[int, Unit]] = [(-1, ("embed", False))] if vstage == 0 else []
            units += [(index, (kinds[index], self.unrecomputed(kinds[index], index))) for index in indices]
            in_order[chunk] = units + ([(-2, ("head", False))] if vstage == vstages - 1 else [])
        reversed_order = {chunk: units[::-1] for chunk, units in in_order.items()}
        trace_of = {unit: self.unit_trace(unit, embed, head) for units in in_order.values() for _, unit in units}
        saved_source = {unit: (*unit, -1) for unit in trace_of}
        last_mb = microbatches - 1
        # whether any module prefetches its weights (ZeRO-3): without, `gather` has nothing to do
        gathering = any(traced.gathers != (None, None) for traced in trace_of.values())

        calls, append = program.calls, program.calls.append  # the walk's two hot loops add calls inline
        for i, (step, mb, chunk) in enumerate(steps):
            vstage = chunk * p.pp + stage
            first, last = vstage == 0, vstage == vstages - 1
            if step == "F":
                units = in_order[chunk]
                prev = None if first else receive(vstage - 1, tag(mb, vstage - 1, False))
                # the first module's gather starts with the step, once its input has arrived (Megatron waits for
                # the receive before it runs the micro-batch)
                gathered = gather(units, 0, 0, () if prev is None else (prev,), mb)
                for pos, (index, unit) in enumerate(units):
                    inputs = () if prev is None else (prev,)
                    ahead = gather(units, pos + 1, 0, inputs, mb) if gathering else ()
                    append(Call(trace_of[unit].forward, (*inputs, *gathered), index, mb))
                    prev = len(calls) - 1
                    if gathered:
                        hold(unit, 0, index, gathered, prev)
                    fwd_call[(index, mb)] = prev
                    gathered = ahead
                if not last:
                    if chunks > 1:
                        prefetch(i + 1)
                    send = self.p2p_block(OpKind.SEND, peer(vstage, +1), self.boundary(vstage))
                    program.add(Call(send, (prev,), -1, mb, tag(mb, vstage, False)))
                continue
            prev = None if last else receive(vstage + 1, tag(mb, vstage, True))
            received = () if prev is None else (prev,)
            units = reversed_order[chunk]
            # a module is gathered again for its backward once its forward has freed its weights
            # (and, like the forward's, once the gradient it starts from has arrived)
            gathered = gather(units, 0, 1, (*received, fwd_call[(units[0][0], mb)]), mb) if units else ()
            for pos, (index, unit) in enumerate(units):
                traced = trace_of[unit]
                assert traced.backward is not None
                inputs = (fwd_call[(index, mb)],) if prev is None else (prev, fwd_call[(index, mb)])
                ahead = gather(units, pos + 1, 1, inputs, mb) if gathering else ()
                append(Call(traced.backward, (*inputs, *gathered), index, mb))
                prev = last_backward[index] = len(calls) - 1
                if gathered:
                    hold(unit, 1, index, gathered, prev)
                keep(names[index], saved_source[unit], traced.saved_bytes, fwd_call[(index, mb)], prev)
                gathered = ahead
                if traced.sync is not None and (sync_every or mb == last_mb):
                    sync(traced, prev, mb, index)
            if not first:
                assert prev is not None
                if chunks > 1:
                    prefetch(i + 1)
                send = self.p2p_block(OpKind.SEND, peer(vstage, -1), self.boundary(vstage - 1))
                program.add(Call(send, (prev,), -1, mb, tag(mb, vstage - 1, True)))
        tied = self.tied_sync.get(stage)
        if tied is not None:
            # after the last backward of the embedding (first stage) or the head (last stage)
            owner = -1 if stage == 0 else -2
            syncs.append(program.add(Call(tied, (last_backward[owner],), owner, microbatches - 1, TIED_SYNC_TAG)))
        if optimizer is not None:
            program.add(Call(optimizer, tuple(syncs) or (len(program.calls) - 1,)))
        return sources


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


class _Stage(NamedTuple):
    """What a pipeline stage's programs share, whatever their number of micro-batches."""

    layers: dict[int, list[int]]
    """Per model chunk, the layers the stage holds."""
    optimizer: int | None
    fixed: tuple[Tensor, ...]
    """Tensors held for the whole step: weights, gradients, optimizer states, KV cache."""


@dataclass(frozen=True, slots=True, eq=False)
class _Skeleton:
    """One stage's schedule without sizes: its calls, the p2p blocks it made, and its activation tensors' lifetimes
    with what sizes each (the bytes a source's block saves or gathers). Every program built from it carries its
    `shape`, on which cost models keep what they derive from the calls alone, and its `table` of tensors, to
    which a point adds only the sizes."""

    shape: CallShape
    p2p: tuple[tuple[OpKind, int, str], ...]
    table: TensorTable
    sources: tuple[Source, ...]
    """The distinct sources of the tensors' sizes."""
    source_of: np.ndarray
    """Per row of the table, its source's place in `sources`."""


LINK_CYCLE = 6
"""Periods after which the state of shared network links repeats, at most, as the analytical model schedules
them: calls repeat every period, but which transfer last used a link shared by pipeline sends and collectives (or
ring-attention sends) can cycle over 2 or 3 periods, and the drain after the steady state starts where in that
cycle the step is. A steady form with a whole number of such cycles fewer than the step starts its drain in the
same place."""


def steady_microbatches(point: DesignPoint) -> int | None:
    """Micro-batches of the step's SteadyForm, or None when it has none (see `_Builder.steady_form`).

    A 1F1B stage runs up to p - 1 warm-up forwards and as many drain backwards, and its timing settles within
    about p micro-batches of steady state, so 2p + 2 micro-batches leave a few steady periods on every stage;
    interleaved stages repeat every p micro-batches and warm up and drain for up to about two of those groups
    each, so they take 6p. To those, as many periods as make the difference to the step a multiple of LINK_CYCLE.
    Only training with those schedules has one: GPipe holds every micro-batch's activations, so its memory grows
    with them, and inference holds a KV cache per micro-batch."""
    p = point.parallel
    if point.workload.mode != "train" or p.pp_schedule not in ("1f1b", "interleaved"):
        return None
    period = steady_period(point)
    base = 6 * p.pp if period > 1 else 2 * p.pp + 2
    short = base + (point.micro_batches - base) % (LINK_CYCLE * period)
    return short if point.micro_batches > short else None


def steady_period(point: DesignPoint) -> int:
    """Micro-batches after which a steady pipeline stage repeats its calls: one for 1F1B, a group of p for
    interleaved 1F1B (each chunk's micro-batches go through the stages in groups of p)."""
    p = point.parallel
    return p.pp if p.pp_schedule == "interleaved" and p.virtual_stages > 1 else 1


def schedule_shape(point: DesignPoint) -> tuple:
    """The fields of a point that its stages' schedule skeletons are keyed by, besides the model's structure and
    the number of micro-batches scheduled."""
    p = point.parallel
    return (
        point.model.name,
        p.pp,
        p.virtual_stages if p.pp_schedule == "interleaved" else 1,
        p.pp_schedule,
        point.workload.mode,
        p.zero >= 2,
        p.recompute_every,
        p.first_stage_layers,
        p.last_stage_layers,
    )


def schedule_affinity(point: DesignPoint) -> tuple:
    """The schedule skeletons a cost model prices a point from: its shape and the micro-batches of its steady
    form (or of the step, without one). The first point of each pays the walk over every layer and micro-batch,
    most of a cold generation, and the cost model keeps its segment layouts on the skeletons' call shapes, so
    points alike in these run best in one process: the generator's `affinity`."""
    return (*schedule_shape(point), steady_microbatches(point) or point.micro_batches)


SKELETON_CACHE_SIZE = 256
_SKELETONS: dict[tuple, _Skeleton] = {}
"""Per process (an evaluator actor keeps it across trials); emptied when full."""


WORKLOAD_CACHE_SIZE = 16


class SymbolicGenerator:
    """A workload depends on the model, the workload and the parallel layout, never on the system, so a study
    that sweeps HBM sizes, link bandwidths or topologies prices one generated workload many times. The last
    WORKLOAD_CACHE_SIZE are kept per instance (an evaluator actor keeps its instance across trials); a hit is a
    shallow copy carrying the new point's key. Cost models only read workloads."""

    name = "symbolic"

    def __init__(self) -> None:
        self._workloads: OrderedDict[str, Workload] = OrderedDict()

    def generate(self, point: DesignPoint) -> Workload:
        key = point.workload_key
        workload = self._workloads.get(key)
        if workload is None:
            workload = self._workloads[key] = _Builder(point).build()
            if len(self._workloads) > WORKLOAD_CACHE_SIZE:
                self._workloads.popitem(last=False)
        else:
            self._workloads.move_to_end(key)
        return replace(workload, point_key=point.key)

    @staticmethod
    def affinity(point: DesignPoint) -> tuple:
        return schedule_affinity(point)


def count_parameters(point: DesignPoint) -> int:
    """Parameters of the model as the generated graph holds them (full, unsharded sizes)."""
    builder = _Builder(point)
    builder.build()
    tr, item = builder.tracer, builder.module.itemsize
    total = 0.0
    for key, traced in builder.layer_traces.items():
        total += builder.layer_keys.count(key) * sum(tr.full_bytes(w) for w in traced.params) / item
    tied_copy = "lm_head" if point.model.tied_embeddings else None
    for traced in builder.outside:
        total += sum(tr.full_bytes(w) for w in traced.params if w.name != tied_copy) / item
    return round(total)
