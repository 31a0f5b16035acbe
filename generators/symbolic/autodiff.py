"""Reverse-mode differentiation of a recorded forward tape into backward ops.

Gradients carry layouts like any tensor; before a node's rule runs, the sum of its output's gradients is brought
to the layout the output had (partial sums become duplicated), which is where the backward collectives of tensor
parallelism come from. Weight gradients are returned, not synchronised: when and how they are reduced across data
parallel ranks (once per step, per micro-batch, all-reduce or reduce-scatter) is the schedule's decision.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import reduce

from dse.workload import Collective, Op
from generators.symbolic.attention import unfused_attention_backward
from generators.symbolic.dist import PARTIAL, Dist, Partition, gradient_layout
from generators.symbolic.graph import Tracer
from generators.symbolic.tape import larger
from generators.symbolic.tensors import OUTPUT, Node, STensor, make_layout, reduction_layout

FUSED_ATTENTION_BACKWARD = 2.5
"""FLOPs fused (flash) attention's backward executes per forward FLOP: it keeps no probabilities, so it computes
Q K^T again besides dP = dO V^T, dV = P^T dO, dQ = dS K and dK = dS^T Q, five s x t matmuls to the forward's
two (FlashAttention-2's own count, whose fwd+bwd TFLOP/s divide 3.5 forward FLOPs). The op keeps the
conventional count (twice the forward, what unfused attention executes from its kept probabilities) and says
the rest through its density. A fused node is one that keeps nothing extra; an unfused one's backward is its own
kernels (`attention.unfused_attention_backward`)."""


@dataclass
class Gradients:
    inputs: dict[int, STensor] = field(default_factory=dict)
    """Gradient of each block input, by id of the input tensor."""
    params: list[tuple[STensor, STensor]] = field(default_factory=list)
    """(parameter, its local gradient) for every parameter the tape used."""
    weight_reads: dict[int, STensor] = field(default_factory=dict)
    """By id, what the weight-gradient GEMMs read, as held until they run: each GEMM's input (as saved, or as
    recomputed) and the gradient of its output. A zero-bubble schedule keeps these from the input-gradient half
    of the backward to its deferred weight-gradient half."""


def needed(node: Node) -> tuple[STensor, ...]:
    """Forward values the node's backward reads."""
    match node.kind:
        case "einsum" | "norm":
            return node.inputs
        case "loss":
            return ()  # the fp32 log-probabilities, kept as the node's extra_saved
        case "pointwise" if node.partials:
            reads = dict.fromkeys(j for partial in node.partials if partial for j in partial.reads)
            return tuple(node.output if j == OUTPUT else node.inputs[j] for j in reads)
        case "pointwise":
            return () if node.linear else node.inputs
        case "attention":
            return (*node.inputs, node.final or node.output)
        case "dropout":
            return (node.inputs[1],)
        case "relabel":
            return node.inputs if len(node.inputs) > 1 else ()
    return ()


def _is_gather(node: Node) -> bool:
    """A value brought from other ranks, which backward brings again rather than keeping; and a copy (a linear
    pointwise op with a backward kernel of its own: a regrouping of gathered slots), which backward forms again
    from what it copies, as a compiled backward re-forms the regathered value's reshuffle."""
    gather = node.kind == "redistribute" and any(op.category == Collective.ALL_GATHER for op in node.ops)
    return gather or _is_copy(node) or node.kind == "shift"


def _is_copy(node: Node) -> bool:
    return node.kind == "pointwise" and node.linear and bool(node.partials)


def saved_activations(tape: Sequence[Node], replayed: Sequence[Node], kept: Sequence[Node] = ()) -> list[STensor]:
    """The activations kept from forward to backward: what backward reads and what recomputation starts from,
    minus what it recomputes, with all-gathered tensors stored in their pre-gather shard (backward gathers them
    again, as Megatron SP does). kept: replayed nodes whose output is stored all the same (Megatron's selective
    recompute keeps the core attention output that the output projection reads)."""
    gathered_from = {id(n.output): n.inputs[0] for n in tape if _is_gather(n)}
    kept_ids = {id(n) for n in kept}
    recomputed = {id(n.output) for n in replayed if id(n) not in kept_ids}
    recomputed |= {id(n.inputs[1]) for n in replayed if n.kind == "dropout"}
    replayed_ids = {id(n) for n in replayed}
    saved: dict[int, STensor] = {}
    for node in tape:
        reads = (*needed(node), *node.inputs) if id(node) in replayed_ids else needed(node)
        for t in reads:
            while id(t) in gathered_from:
                t = gathered_from[id(t)]
            if not t.param and id(t) not in recomputed and t.dims:
                saved[id(t)] = t
    return list(saved.values())


def read_by_backward(tape: Sequence[Node], replayed: Sequence[Node]) -> list[Node]:
    """The replayed nodes whose outputs backward reads, directly or through other replayed nodes: what a compiled
    backward recomputes (AOTAutograd's partitioner puts in the backward graph only what it needs). Eager
    checkpointing replays the whole region instead, and a saved output only recomputation reads (the MLP's output
    before the residual add, whose gradient reads no values) is then kept as well."""
    required = {id(t) for node in tape for t in needed(node)}
    kept: list[Node] = []
    for node in reversed(replayed):
        if id(node.output) in required:
            kept.append(node)
            required |= {id(t) for t in node.inputs}
    return kept[::-1]


def saved_bytes(tracer: Tracer, tape: Sequence[Node], replayed: Sequence[Node], kept: Sequence[Node] = ()) -> float:
    """Bytes of saved activations, with what nodes keep beyond their tensors (unfused attention internals)."""
    replayed_ids = {id(n) for n in replayed}
    extra = sum(n.extra_saved for n in tape if id(n) not in replayed_ids)
    return sum(tracer.nbytes(t) for t in saved_activations(tape, replayed, kept)) + extra


class Differentiator:
    """Emits the backward of one tape into the tracer's current block."""

    def __init__(self, tracer: Tracer, tape: Sequence[Node], leaf_params: set[int]):
        self.tr = tracer
        self.tape = tape
        self.leaf_params = leaf_params
        self.alias: dict[int, STensor] = {}
        self.gathered_from = {id(n.output): n for n in tape if _is_gather(n)}
        self.ring_back = _ring_neighbours(tape, tracer.degrees)
        self.grads: dict[int, list[STensor]] = {}
        self.result = Gradients()

    def replay(self, nodes: Sequence[Node]) -> None:
        """Recompute forward nodes: their ops again, reading recomputed values where there are some."""
        for node in nodes:
            inputs = [self.value(t) for t in node.inputs]
            out = STensor(
                node.output.name + ".recompute",
                node.output.dims,
                node.output.layout,
                node.output.itemsize,
                node.output.param,
            )
            self._emit_again(node, self.tr.emitter.deps(inputs), "recompute", out)
            if not node.ops:
                self.tr.emitter.same_origin(out, inputs[0])
            self.alias[id(node.output)] = out

    def value(self, t: STensor) -> STensor:
        """A forward value for backward to read: recomputed, gathered again, or kept from forward."""
        if id(t) in self.alias:
            return self.alias[id(t)]
        if id(t) in self.ring_back:
            return self._around_the_ring(t)
        node = self.gathered_from.get(id(t))
        if node is not None:
            source = self.value(node.inputs[0])
            again = STensor(t.name + ".regather", t.dims, t.layout, t.itemsize, t.param)
            self._emit_again(node, self.tr.emitter.deps([source]), "regather", again)
            self.alias[id(t)] = again
            return again
        return t

    def _as_held(self, t: STensor) -> STensor:
        """A forward value as backward holds it before reading it: recomputed, or as kept from forward (a
        gathered value is kept as the shard it is gathered from again)."""
        while id(t) not in self.alias and id(t) in self.gathered_from:
            t = self.gathered_from[id(t)].inputs[0]
        return self.alias.get(id(t), t)

    def _around_the_ring(self, t: STensor) -> STensor:
        """A chunk passed around a ring in forward, received again in backward: from the neighbour holding the
        chunk one step further on when that one is at hand (backward visits the ring's steps last to first, so
        it goes round the other way, one hop per step, as ring-flash-attention's backward does), else along the
        forward's own path."""
        node = self.gathered_from[id(t)]
        further = self.ring_back[id(t)]
        if further is not None and (id(further) in self.alias or id(further) not in self.ring_back):
            source, peer = self.value(further), -node.peer
        else:
            source, peer = self.value(node.inputs[0]), node.peer
        again = self.tr.shift(source, node.axis, peer, record=False)
        self.alias[id(t)] = again
        return again

    def _emit_again(self, node: Node, deps: tuple[int, ...], suffix: str, out: STensor) -> None:
        """Emit a forward node's ops again, the first after `deps` and each after the one before, as they first
        ran (a node's ops feed one another: unfused attention's kernels, a redistribution's collectives); a
        weight's all-gather goes where the block's weight gathers go (prefetch)."""
        for op in node.ops:
            again = _with_deps(op, deps, suffix)
            if _is_gather(node) and node.output.param:
                self.tr.emitter.emit_param_gather(again, [out])
            else:
                deps = (self.tr.emitter.emit(again, [out]),)

    def run(self, seeds: Sequence[tuple[STensor, STensor]], inputs: Sequence[STensor]) -> Gradients:
        for tensor, grad in seeds:
            self._contribute(tensor, grad)
        for node in reversed(self.tape):
            grads = self.grads.pop(id(node.output), None)
            if grads:
                self._backward(node, grads)
        for t in inputs:
            grads = self.grads.pop(id(t), None)
            if grads:
                self.result.inputs[id(t)] = self._settle(t, grads)
        return self.result

    # -- gradient bookkeeping --------------------------------------------------------------------------------
    def _contribute(self, tensor: STensor, grad: STensor) -> None:
        if id(tensor) in self.leaf_params:
            self.result.params.append((tensor, grad))
        else:
            self.grads.setdefault(id(tensor), []).append(grad)

    def _sum(self, grads: list[STensor]) -> STensor:
        total = grads[0]
        for g in grads[1:]:
            if g.layout != total.layout:
                target = {a: gradient_layout(total.dist(a)) for a in self.tr.degrees}
                total = self.tr.redistribute(total, target, record=False)
                g = self.tr.redistribute(g, target, record=False)
            out = STensor(total.name + "+", total.dims, total.layout, total.itemsize)
            self.tr.compute(f"{total.name}.accumulate", "elementwise", self.tr.elems(out), (total, g), (out,))
            total = out
        return total

    def _settle(self, forward: STensor, grads: list[STensor]) -> STensor:
        """Sum a value's gradients and bring them to the value's own layout."""
        total = self._sum(grads)
        target = {a: gradient_layout(forward.dist(a)) for a in self.tr.degrees}
        return self.tr.redistribute(total, target, record=False)

    # -- rules -----------------------------------------------------------------------------------------------
    def _backward(self, node: Node, grads: list[STensor]) -> None:
        tr = self.tr
        if node.kind == "shift":
            total = self._sum(grads)
            self._contribute(node.inputs[0], tr.shift(total, node.axis, -node.peer, record=False))
            return
        if node.kind == "redistribute":
            total = self._sum(grads)
            source = node.inputs[0]
            target = {a: total.dist(a) for a in tr.degrees}
            for axis in node.axis.split("+"):  # a joint gather's adjoint: one reduce-scatter over its group
                target[axis] = gradient_layout(source.dist(axis))
            self._contribute(source, tr.redistribute(total, target, record=False, weight_grad=source.param))
            return
        # a copy (linear, with a kernel of its own in backward) hands partial sums on: they are reduced after it
        g = self._sum(grads) if _is_copy(node) else self._settle(node.output, grads)
        name = node.name
        match node.kind:
            case "einsum":
                a, b = node.inputs
                da = tr.einsum(f"{name}.dgrad", g, self.value(b), a.dims, node.category, record=False)
                db = tr.einsum(f"{name}.wgrad", self.value(a), g, b.dims, node.category, record=False)
                if id(b) in self.leaf_params:
                    for held in (self._as_held(a), g):
                        self.result.weight_reads[id(held)] = held
                self._contribute(a, da)
                self._contribute(b, db)
            case "pointwise" if node.partials:
                self._eager_backward(node, g)
            case "pointwise" if node.linear:
                for t in node.inputs:
                    self._contribute(t, self._broadcast_grad(g, t))
            case "pointwise" | "norm" | "loss":
                reads = [self.value(t) for t in node.inputs]
                outs = [self._input_grad(g, t) for t in node.inputs]
                flops = 2 * node.flops_per_elem * reduce(larger, [tr.elems(t) for t in node.inputs])
                tr.compute(f"{name}.backward", node.category, flops, (g, *reads), outs)
                if node.kind == "loss":  # log-softmax's backward: fp32 gradients in and out, both held at once
                    tr.emitter.peak_temp = larger(tr.emitter.peak_temp, 2 * node.extra_saved)
                for t, d in zip(node.inputs, outs, strict=True):
                    self._contribute(t, d)
            case "attention":
                q, k, v = node.inputs
                reads = [self.value(t) for t in (q, k, v, node.final or node.output)]
                outs = [_grad_like(q), *(self._kv_grad(q, t) for t in (k, v))]
                if node.extra_saved:
                    unfused_attention_backward(tr, name, g, *reads, *outs, node.dropout)
                else:
                    fwd = node.ops[0]
                    flops = 2 * fwd.flops
                    density = fwd.density * FUSED_ATTENTION_BACKWARD / 2
                    shape = None if fwd.attention is None else fwd.attention._replace(backward=True)
                    tr.compute(f"{name}.backward", "attention", flops, (g, *reads), outs, density, shape)
                for t, d in zip((q, k, v), outs, strict=True):
                    self._contribute(t, d)
            case "dropout":
                x, mask = node.inputs
                dx = _grad_like(x)
                tr.compute(f"{name}.backward", "elementwise", tr.elems(x), (g, self.value(mask)), (dx,))
                self._contribute(x, dx)
            case "relabel":
                x, *side = node.inputs
                layout: dict[str, Dist] = {}
                for axis, d in g.layout:
                    if isinstance(d, Partition):
                        own = x.dist(axis)
                        back = next((k for k, v in self._dim_map(node).items() if v == d.dim), d.dim)
                        layout[axis] = own if isinstance(own, Partition) else Partition(back)
                    else:
                        layout[axis] = d
                dx = STensor(f"{x.name}.grad", x.dims, make_layout(**layout), x.itemsize)
                side_grads = [_grad_like(t) for t in side]
                reads = [self.value(t) for t in node.inputs] if side else []
                flops = 2 * node.flops_per_elem * tr.elems(g)
                tr.compute(f"{name}.backward", node.category, flops, (g, *reads), (dx, *side_grads))
                self._contribute(x, dx)
                for t, d in zip(side, side_grads, strict=True):
                    self._contribute(t, d)
            case "embedding":
                tokens, table = node.inputs
                layout: dict[str, Dist] = {}
                for axis in tr.degrees:
                    if isinstance(table.dist(axis), Partition):
                        layout[axis] = table.dist(axis)
                    elif isinstance(tokens.dist(axis), Partition):
                        layout[axis] = PARTIAL
                dtable = STensor(f"{table.name}.grad", table.dims, make_layout(**layout), table.itemsize)
                tr.compute(f"{name}.backward", "embedding", 0.0, (g,), (dtable,))
                self._contribute(table, dtable)

    def _eager_backward(self, node: Node, g: STensor) -> None:
        """Each input's gradient by its own formula, one kernel per op (see `Partial`), as eager autograd runs it.
        A broadcast input's gradient is formed at the output's shape, reading the incoming gradient at its own
        (smaller when it is a view expanded by a sum's backward)."""
        tr = self.tr
        for t, partial in zip(node.inputs, node.partials, strict=True):
            if partial is None:
                continue
            if partial.view:
                self._contribute(t, g)
                continue
            reads = [self.value(node.output if j == OUTPUT else node.inputs[j]) for j in partial.reads]
            broadcast = set(t.dims) < set(node.output.dims)
            shape, layout = (node.output, g.layout) if broadcast else (t, t.layout)
            for step in range(partial.prep):
                prepared = STensor(f"{t.name}.grad.prep{step}", shape.dims, layout, t.itemsize)
                tr.compute(f"{node.name}.backward.prep{step}", node.category, tr.elems(prepared), reads, (prepared,))
                reads = [prepared]
            grad = self._input_grad(g, t)
            if node.linear and not broadcast:  # a linear op (a copy) hands a partial sum's gradient on as it is
                grad = STensor(grad.name, grad.dims, g.layout, grad.itemsize)
            if broadcast:
                wide = STensor(f"{t.name}.grad.wide", node.output.dims, g.layout, t.itemsize)
                tr.compute(f"{node.name}.backward", node.category, tr.elems(wide), (g, *reads), (wide,))
                tr.compute(f"{t.name}.grad_reduce", node.category, tr.elems(wide), (wide,), (grad,))
            else:
                tr.compute(f"{node.name}.backward", node.category, tr.elems(grad), (g, *reads), (grad,))
            self._contribute(t, grad)

    def _kv_grad(self, q: STensor, t: STensor) -> STensor:
        """Keys and values gathered over a query-sequence split (context parallelism) receive a partial gradient
        from each rank's queries: a partial sum, which the gather's adjoint reduce-scatters."""
        layout = dict(t.layout)
        for axis in self.tr.degrees:
            if q.dist(axis) == Partition(q.dims[1]) and not isinstance(t.dist(axis), Partition):
                layout[axis] = PARTIAL
        return STensor(f"{t.name}.grad", t.dims, make_layout(**layout), t.itemsize)

    @staticmethod
    def _dim_map(node: Node) -> dict[str, str]:
        x, out = node.inputs[0], node.output
        found: dict[str, str] = {}
        for axis, d in x.layout:
            o = out.dist(axis)
            if isinstance(d, Partition) and isinstance(o, Partition):
                found[d.dim] = o.dim
        return found

    def _input_grad(self, g: STensor, t: STensor) -> STensor:
        """An input broadcast into the output (a weight, a bias) gets a reduced gradient; others their own."""
        if t.param or set(t.dims) < set(g.dims):
            return STensor(f"{t.name}.grad", t.dims, reduction_layout(g, t.dims), t.itemsize)
        return _grad_like(t)

    def _broadcast_grad(self, g: STensor, t: STensor) -> STensor:
        if t.dims == g.dims:
            return g
        reduced = STensor(f"{t.name}.grad", t.dims, reduction_layout(g, t.dims), t.itemsize)
        self.tr.compute(f"{t.name}.grad_reduce", "elementwise", self.tr.elems(g), (g,), (reduced,))
        return reduced


def _ring_neighbours(tape: Sequence[Node], degrees: dict[str, int]) -> dict[int, STensor | None]:
    """For each chunk received in a ring of shifts: the chunk one step further on, or, for the ring's last step,
    its start (one more step would bring it back); None when the chain does not close the ring."""
    shifts = [n for n in tape if n.kind == "shift"]
    source = {id(n.output): n.inputs[0] for n in shifts}
    further: dict[int, STensor | None] = {id(n.inputs[0]): n.output for n in shifts}
    out: dict[int, STensor | None] = {}
    for n in shifts:
        start, hops = n.output, 0
        while id(start) in source:
            start, hops = source[id(start)], hops + 1
        closes = (hops + 1) * n.peer % degrees.get(n.axis, 1) == 0
        out[id(n.output)] = further.get(id(n.output), start if closes else None)
    return out


def _grad_like(t: STensor) -> STensor:
    return STensor(f"{t.name}.grad", t.dims, t.layout, t.itemsize)


def _with_deps(op: Op, deps: tuple[int, ...], suffix: str) -> Op:
    return replace(op, name=f"{op.name}.{suffix}", deps=deps)
