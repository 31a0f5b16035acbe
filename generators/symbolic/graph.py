"""Symbolic tensors, the ops over them, and reverse-mode differentiation that derives the backward pass.

Tensors have named dimensions whose sizes come from the design point, and a layout (`Dist`) per parallel axis.
Each op states what layouts it needs; the matcher in `dist` inserts the collectives that get there. The backward
pass is derived, not written: the gradient of an einsum is two einsums whose layouts (a partial sum where a
partitioned index is contracted) bring in the TP all-reduces, the SP reduce-scatters and the DP gradient sync on
their own, and the adjoint of a redistribution is the redistribution back.

A `Tracer` records one block at a time: ops go to the current `Emitter`, and the forward tape it keeps is what
the backward block differentiates.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from math import prod
from typing import Literal

from dse.spec import DTYPE_BYTES
from dse.workload import BLOCK_INPUT, Collective, Op, OpKind
from generators.symbolic.dist import DUP, PARTIAL, Dist, Duplicated, PartialSum, Partition, collective_for
from generators.symbolic.fsdp import FsdpCopies, chained
from generators.symbolic.tape import larger

Layout = tuple[tuple[str, Dist], ...]
AXIS_ORDER = ("tp", "cp", "ep", "dp", "pp")
"""Rank layout order, innermost first (Megatron: tp, cp, then the data axes, pp outermost)."""
JOINABLE = frozenset({"cp", "ep", "dp"})
FP32 = DTYPE_BYTES["fp32"]
"""Bytes of the fp32 intermediates eager kernels and the cross-entropy work in."""
OUTPUT = -1
"""In `Partial.reads`: the node's output (rsqrt's gradient is formed from its result)."""


@dataclass(frozen=True, slots=True, eq=False)
class STensor:
    """A symbolic tensor; identity matters (two tensors of one shape are different values)."""

    name: str
    dims: tuple[str, ...]
    layout: Layout
    itemsize: int
    param: bool = False

    def dist(self, axis: str) -> Dist:
        for name, dist in self.layout:
            if name == axis:
                return dist
        return DUP

    def relayout(self, axis: str, dist: Dist) -> "STensor":
        layout = tuple((a, d) for a, d in self.layout if a != axis)
        if dist != DUP:
            layout = tuple(sorted((*layout, (axis, dist)), key=lambda item: item[0]))
        return STensor(self.name, self.dims, layout, self.itemsize, self.param)


def make_layout(**dists: Dist) -> Layout:
    return tuple(sorted((a, d) for a, d in dists.items() if d != DUP))


NodeKind = Literal[
    "einsum", "pointwise", "norm", "attention", "embedding", "loss", "redistribute", "dropout", "relabel", "shift"
]


@dataclass(frozen=True, slots=True)
class Partial:
    """How PyTorch eager autograd forms the gradient of one input of an op: its derivatives.yaml formula run one
    kernel per aten op. The formula reads the incoming gradient and `reads` (indices into the node's inputs, or
    OUTPUT), after `prep` kernels over those (pow's `exponent * self.pow(exponent - 1)` is two); an input smaller
    than the output (broadcast) gets its gradient at the output's shape and then summed down to its own
    (sum_to_size), a reduction's input at its own shape (mean's expand and divide)."""

    reads: tuple[int, ...] = ()
    prep: int = 0
    view: bool = False
    """The gradient is the incoming one viewed at the input's shape (sum's expand): no kernel, and the next
    gradient kernel reads it at its own size."""


SCALED = Partial()
"""A gradient formed from the incoming one alone: a dtype cast's, a product with a constant's (RoPE's rotation)."""
PRODUCT = (Partial((1,)), Partial((0,)))
"""a * b: each input's gradient is the incoming one times the other input."""
EXPAND = Partial(view=True)
"""A sum's: the incoming gradient expanded back over the summed dimension, a view."""
SOFTMAX_FLOPS = 5.0
"""Per score, Megatron's fused scale-mask-softmax: the scaling, the mask, the row maximum, the exponential and the
normalisation (few beside the kernel's HBM traffic, which bounds it)."""
SOFTMAX_BACKWARD_FLOPS = 3.0
"""Per score, softmax's backward y * (dy - sum(y * dy)): a product, the row sum, a difference and a product."""
MERGE_FLOPS = 3.0
"""Per output element, folding one ring step's partial attention into the running output: two rescalings by the
softmax statistics (whose exponentials are per row) and a sum."""


@dataclass(slots=True, eq=False)
class Node:
    """One recorded forward op: enough to emit it again (recompute) and to differentiate it."""

    kind: NodeKind
    name: str
    inputs: tuple[STensor, ...]
    output: STensor
    category: str = "elementwise"
    flops_per_elem: float = 0.0
    linear: bool = False
    axis: str = ""
    ops: tuple[Op, ...] = ()
    """The ops this node emitted (empty for a local slice), for recomputation."""
    extra_saved: float = 0.0
    """Bytes the node keeps for its backward beyond its input and output tensors (unfused attention's s x s
    probabilities, dropout mask and dropped probabilities)."""
    peer: int = 0
    """A shift's offset along its axis."""
    final: "STensor | None" = None
    """For one step of a ring attention, the combined output its backward reads (with the softmax statistics)
    instead of the step's partial output, as flash attention's backward does."""
    dropout: bool = False
    """Unfused attention drops out its probabilities (keeping the mask and the dropped copy)."""
    partials: tuple[Partial | None, ...] = ()
    """Per input, how eager autograd forms its gradient (one kernel per op); None: a constant input (RoPE's
    rotation table), which gets none; empty: one fused backward kernel."""


@dataclass
class Emitter:
    """Collects the ops of one block; tensors produced outside it are resident (no dependency)."""

    ops: list[Op] = field(default_factory=list)
    origin: dict[int, int] = field(default_factory=dict)
    moved: dict[tuple[int, str, Dist], STensor] = field(default_factory=dict)
    """Redistributions already done in this block: a value gathered once serves every consumer."""
    peak_temp: float = 0.0
    gathered_params: float = 0.0
    """Bytes of parameters all-gathered for this block (ZeRO-3): held while it runs, or from the start of its
    prefetch call to its end when `prefetch` is on."""
    prefetch: bool = False
    """Emit the ZeRO-3 parameter all-gathers into `gathers`, a block of their own that the schedule issues one
    module ahead (FSDP's prefetch), instead of into this block; the gathered weights are inputs of this block."""
    gathers: list[Op] = field(default_factory=list)
    fsdp: FsdpCopies | None = None
    """The copies FSDP runs around each weight all-gather (ZeRO-3), if any."""
    alive: list[STensor] = field(default_factory=list)
    """Every tensor keyed above by id(), kept alive so that no id is reused by a newer tensor."""

    def deps(self, tensors: Iterable[STensor]) -> tuple[int, ...]:
        found = {self.origin[id(t)] for t in tensors if id(t) in self.origin}
        return tuple(sorted(found))

    def emit(self, op: Op, outputs: Sequence[STensor] = ()) -> int:
        self.ops.append(op)
        index = len(self.ops) - 1
        for t in outputs:
            self.produced(t, index)
        return index

    def produced(self, t: STensor, index: int) -> None:
        self.origin[id(t)] = index
        self.alive.append(t)

    def same_origin(self, new: STensor, old: STensor) -> None:
        """new is a view of old (a local slice): it is ready when old is."""
        if id(old) in self.origin:
            self.produced(new, self.origin[id(old)])

    def mark_input(self, t: STensor) -> None:
        self.produced(t, BLOCK_INPUT)

    def emit_param_gather(self, op: Op, outputs: Sequence[STensor]) -> None:
        """A ZeRO-3 weight all-gather: into this block, or with `prefetch` into the gather block whose call feeds
        this one (its outputs are then ready when this block's inputs are). FSDP's copy-in goes before it, its
        copy-out (FSDP2) after it, into this block, on the compute stream where the module waits for its weights.
        A prefetched gather's copy-in runs on FSDP's own stream beside the compute before this block; it is
        priced in this block all the same (it takes the same SMs and HBM), and the all-gather does not wait for
        it (a shard's copy, short beside the gather)."""
        self.gathered_params += op.comm_bytes
        copy_in = self.fsdp.gather_in(op) if self.fsdp else []
        copy_out = self.fsdp.gather_out(op) if self.fsdp else None
        if self.prefetch:
            self.gathers.append(replace(op, deps=(BLOCK_INPUT,)))
            for copy in chained(copy_in, (BLOCK_INPUT,), len(self.ops)):
                self.emit(copy)
            ready: tuple[int, ...] = (BLOCK_INPUT,)
        else:
            for copy in chained(copy_in, op.deps, len(self.ops)):
                self.emit(copy)
            ready = (self.emit(replace(op, deps=(len(self.ops) - 1,) if copy_in else op.deps)),)
        if copy_out is not None:
            self.emit(replace(copy_out, deps=ready), outputs)
        elif self.prefetch:
            for t in outputs:
                self.mark_input(t)
        else:
            for t in outputs:
                self.produced(t, ready[0])

    def emit_grad_reduce(self, op: Op, outputs: Sequence[STensor]) -> int:
        """A weight gradient's reduce-scatter over the data axes (ZeRO-3), sent in FSDP's reduce dtype, with the
        copies FSDP runs before it and after it (those with no dependency: they run on the reduce-scatter
        stream, beside the compute that follows); the index of the reduce-scatter."""
        if self.fsdp is None:
            return self.emit(op, outputs)
        before, after = self.fsdp.reduce_scatter(op.name, op.comm_bytes, op.axis)
        for copy in chained(before, op.deps, len(self.ops)):
            self.emit(copy)
        sent = op.comm_bytes * self.fsdp.reduce_itemsize / self.fsdp.itemsize
        index = self.emit(replace(op, comm_bytes=sent, deps=(len(self.ops) - 1,)), outputs)
        for copy in chained(after, (), len(self.ops)):
            self.emit(copy)
        return index

    def remember_move(self, src: STensor, axis: str, dist: Dist, moved: STensor) -> None:
        self.moved[(id(src), axis, dist)] = moved
        self.alive.append(src)


class Tracer:
    """Emits the ops of symbolic computations for one rank and keeps the forward tape for differentiation."""

    def __init__(self, sizes: dict[str, int], degrees: dict[str, int]):
        self.sizes = sizes
        self.degrees = {axis: deg for axis, deg in degrees.items() if deg > 1}
        self.emitter = Emitter()
        self.tape: list[Node] = []
        self.recording = True
        self._per_shape: dict[tuple, float] = {}
        """Elements (keyed by dims and layout) and bytes (and itemsize) of the shapes asked so far."""

    # -- sizes ---------------------------------------------------------------------------------------------
    def use_sizes(self, sizes: dict, degrees: dict) -> None:
        """Trace from here on with these sizes and degrees (of the same axes): plain numbers, or `tape.Sym`s that
        record what is made of them. What is kept per shape was made of the old ones."""
        self.sizes, self.degrees = sizes, degrees
        self._per_shape = {}

    def local_size(self, t: STensor, dim: str) -> float:
        split = prod(self.degrees.get(a, 1) for a, d in t.layout if isinstance(d, Partition) and d.dim == dim)
        return self.sizes[dim] / split

    def elems(self, t: STensor) -> float:
        """Elements of t on one rank; tracing asks this of every tensor several times, so it is kept per shape."""
        key = (t.dims, t.layout)
        elems = self._per_shape.get(key)
        if elems is None:
            elems = self._per_shape[key] = prod(self.local_size(t, d) for d in t.dims)
        return elems

    def nbytes(self, t: STensor) -> float:
        key = (t.dims, t.layout, t.itemsize)
        nbytes = self._per_shape.get(key)
        if nbytes is None:
            nbytes = self._per_shape[key] = self.elems(t) * t.itemsize
        return nbytes

    def full_bytes(self, t: STensor) -> float:
        """Bytes of the whole (unsharded) tensor."""
        return prod(self.sizes[d] for d in t.dims) * t.itemsize

    # -- blocks --------------------------------------------------------------------------------------------
    def begin_block(self, inputs: Sequence[STensor] = ()) -> None:
        self.emitter = Emitter()
        for t in inputs:
            self.emitter.mark_input(t)

    def end_block(self) -> Emitter:
        done, self.emitter = self.emitter, Emitter()
        return done

    def _record(self, node: Node, first_op: int, ops: tuple[Op, ...] | None = None) -> None:
        """Put node on the tape with the ops emitted since first_op (or `ops`, those it routed elsewhere)."""
        if self.recording:
            node.ops = tuple(self.emitter.ops[first_op:]) if ops is None else ops
            self.tape.append(node)

    @property
    def _mark(self) -> int:
        return len(self.emitter.ops)

    def _temp(self, t: STensor) -> None:
        self.emitter.peak_temp = larger(self.emitter.peak_temp, self.nbytes(t))

    # -- communication -------------------------------------------------------------------------------------
    def redistribute(
        self, t: STensor, target: dict[str, Dist], record: bool = True, weight_grad: bool = False
    ) -> STensor:
        """Bring t to the target layout (axes not named stay Duplicated), one collective per axis that differs;
        outside the forward tape, the same collective on adjacent data axes (cp, ep, dp) is one collective over
        their joint group (the dp x cp gradient all-reduce). weight_grad: t is a weight's gradient, whose
        reduce-scatter is ZeRO-3's gradient sync (`Emitter.emit_grad_reduce`)."""
        current = t
        last: tuple[int, Op] | None = None
        for axis in sorted(self.degrees):
            src, dst = current.dist(axis), target.get(axis, DUP)
            if src == dst:
                continue
            cached = self.emitter.moved.get((id(current), axis, dst))
            if cached is not None:
                current = cached
                continue
            collective = collective_for(src, dst)
            moved = current.relayout(axis, dst)
            routed: tuple[Op, ...] | None = None
            self.emitter.remember_move(current, axis, dst, moved)
            mark = self._mark
            if collective is None:
                self.emitter.same_origin(moved, current)
                last = None
            elif last is not None and not record and last[1].category == collective.value and axis in JOINABLE:
                index, previous = last
                size = self.nbytes(moved if collective is Collective.ALL_GATHER else current)
                axes = set(previous.axis.split("+")) | {axis}
                merged = replace(
                    previous,
                    axis="+".join(a for a in AXIS_ORDER if a in axes),
                    comm_bytes=larger(size, previous.comm_bytes),
                )
                self.emitter.ops[index] = merged
                self.emitter.produced(moved, index)
                if collective is Collective.ALL_GATHER and t.param:
                    self.emitter.gathered_params += merged.comm_bytes - previous.comm_bytes
                last = (index, merged)
            else:
                size = self.nbytes(moved if collective is Collective.ALL_GATHER else current)
                op = Op(
                    f"{t.name}.{collective.value}",
                    OpKind.COLLECTIVE,
                    collective.value,
                    comm_bytes=size,
                    axis=axis,
                    deps=self.emitter.deps([current]),
                )
                if collective is Collective.ALL_GATHER and t.param:
                    self.emitter.emit_param_gather(op, [moved])
                    routed = (op,)
                    last = None
                else:
                    if weight_grad and collective is Collective.REDUCE_SCATTER:
                        index = self.emitter.emit_grad_reduce(op, [moved])
                    else:
                        index = self.emitter.emit(op, [moved])
                    last = (index, self.emitter.ops[index]) if axis in JOINABLE else None
            if record:
                node = Node("redistribute", f"{t.name}.{axis}", (current,), moved, axis=axis)
                self._record(node, mark, routed)
            current = moved
        return current

    def shift(self, t: STensor, axis: str, peer: int, record: bool = True) -> STensor:
        """Send t `peer` positions along the axis's ring and receive the neighbour's chunk from `peer` positions
        back in its place: one step of a ring (every rank of the axis runs it at once)."""
        moved = STensor(f"{t.name}.shift", t.dims, t.layout, t.itemsize, t.param)
        size = self.nbytes(t)
        mark = self._mark
        send = Op(f"{t.name}.send", OpKind.SEND, "send", comm_bytes=size, axis=axis, peer=peer)
        self.emitter.emit(replace(send, deps=self.emitter.deps([t])))
        self.emitter.emit(Op(f"{t.name}.recv", OpKind.RECV, "recv", comm_bytes=size, axis=axis, peer=-peer), [moved])
        if record:
            self._record(Node("shift", f"{t.name}.{axis}", (t,), moved, axis=axis, peer=peer), mark)
        return moved

    # -- compute -------------------------------------------------------------------------------------------
    def _compute(
        self,
        name: str,
        category: str,
        flops: float,
        inputs: Sequence[STensor],
        outputs: Sequence[STensor],
        density: float = 1.0,
    ) -> None:
        written = sum(self.nbytes(t) for t in outputs)
        read = sum(self.nbytes(t) for t in inputs)
        self._kernel(name, category, flops, read + written, written, self.emitter.deps(inputs), outputs, density)
        for t in outputs:
            self._temp(t)

    def _kernel(
        self,
        name: str,
        category: str,
        flops: float,
        nbytes: float,
        written: float,
        deps: tuple[int, ...],
        outputs: Sequence[STensor] = (),
        density: float = 1.0,
    ) -> int:
        """A compute op whose traffic is given (it reads or writes values that are not tensors of the tape)."""
        op = Op(
            name, OpKind.COMPUTE, category, flops=flops, bytes=nbytes, density=density, deps=deps, out_bytes=written
        )
        return self.emitter.emit(op, outputs)

    def einsum(
        self,
        name: str,
        a: STensor,
        b: STensor,
        out_dims: tuple[str, ...],
        category: str = "gemm",
        record: bool = True,
    ) -> STensor:
        """out = sum over the indices missing from out_dims of a * b. b's partitioning leads (the weight)."""
        target_a: dict[str, Dist] = {}
        target_b: dict[str, Dist] = {}
        out: dict[str, Dist] = {}
        for axis in self.degrees:
            da, db = a.dist(axis), b.dist(axis)
            lead = db if isinstance(db, Partition) else da
            index = lead.dim if isinstance(lead, Partition) else None
            target_a[axis] = Partition(index) if index in a.dims else DUP
            target_b[axis] = Partition(index) if index in b.dims else DUP
            if index is None:
                out[axis] = DUP
            else:
                out[axis] = Partition(index) if index in out_dims else PARTIAL
        a2 = self.redistribute(a, target_a, record)
        b2 = self.redistribute(b, target_b, record)
        mark = self._mark
        result = STensor(name, out_dims, make_layout(**out), a.itemsize)
        indices = dict.fromkeys((*a2.dims, *b2.dims))
        local = {i: self.local_size(a2 if i in a2.dims else b2, i) for i in indices}
        self._compute(name, category, 2 * prod(local.values()), (a2, b2), (result,))
        if record:
            self._record(Node("einsum", name, (a2, b2), result, category=category), mark)
        return result

    def pointwise(
        self,
        name: str,
        inputs: Sequence[STensor],
        flops_per_elem: float,
        category: str = "elementwise",
        linear: bool = False,
        itemsize: int | None = None,
        partials: tuple[Partial | None, ...] = (),
        dims: tuple[str, ...] | None = None,
    ) -> STensor:
        """An elementwise op laid out like its first input; other inputs follow it (broadcast where smaller).
        itemsize: the output's (a dtype cast), default the first input's; partials: an eager op's gradients;
        dims: the output's when a broadcast makes it wider than the first input (those extra dims unsplit)."""
        main = inputs[0]
        moved = [main]
        for other in inputs[1:]:
            target = {}
            for axis in self.degrees:
                d = main.dist(axis)
                if isinstance(d, Partition):
                    target[axis] = d if d.dim in other.dims else DUP
                else:
                    target[axis] = d if other.dims == main.dims else DUP
            moved.append(self.redistribute(other, target))
        result = STensor(name, dims or main.dims, main.layout, itemsize or main.itemsize)
        mark = self._mark
        self._compute(name, category, flops_per_elem * self.elems(result), moved, (result,))
        node = Node("pointwise", name, tuple(moved), result, category, flops_per_elem, linear, partials=partials)
        self._record(node, mark)
        return result

    def mean(self, name: str, x: STensor, category: str = "elementwise") -> STensor:
        """The mean over the last dimension (not partitioned) as its own kernel; its gradient is the incoming one
        expanded back and divided, one kernel writing a tensor of x's size."""
        return self._reduce_last(name, x, category, SCALED)

    def sum_last(self, name: str, x: STensor, category: str = "elementwise") -> STensor:
        """The sum over the last dimension (not partitioned) as its own kernel; its gradient is the incoming one
        expanded back, a view (no kernel)."""
        return self._reduce_last(name, x, category, EXPAND)

    def _reduce_last(self, name: str, x: STensor, category: str, partial: Partial) -> STensor:
        self._check_whole(name, x)
        result = STensor(name, x.dims[:-1], x.layout, x.itemsize)
        mark = self._mark
        self._compute(name, category, self.elems(x), (x,), (result,))
        self._record(Node("pointwise", name, (x,), result, category, 1.0, partials=(partial,)), mark)
        return result

    def _check_whole(self, name: str, x: STensor) -> None:
        hidden = x.dims[-1]
        if any(isinstance(d, Partition) and d.dim == hidden for _, d in x.layout):
            raise ValueError(f"{name}: the normalised dimension '{hidden}' is partitioned")

    def norm(self, name: str, x: STensor, weights: Sequence[STensor], flops_per_elem: float) -> STensor:
        """A normalisation over the last dimension, which must not be partitioned."""
        self._check_whole(name, x)
        ws = [self.redistribute(w, {}) for w in weights]
        result = STensor(name, x.dims, x.layout, x.itemsize)
        mark = self._mark
        self._compute(name, "norm", flops_per_elem * self.elems(result), (x, *ws), (result,))
        self._record(Node("norm", name, (x, *ws), result, "norm", flops_per_elem), mark)
        return result

    def attention(
        self,
        name: str,
        q: STensor,
        k: STensor,
        v: STensor,
        causal: bool = True,
        fused: bool = True,
        dropout: bool = False,
        value_dim: str | None = None,
        ring: str | None = None,
    ) -> STensor:
        """Attention of q [b,s,n,dq] over k [b,t,g,dk], v [b,t,g,dv]; the output is [b,s,n,dv].

        value_dim: the values are the first value_dim channels of the keys (v is k, read once: MLA's absorbed
        decode attends over its latent cache).

        Heads split over an axis split the kv heads alike; a query sequence split (context parallelism) needs
        every key and value, so they are all-gathered over that axis (the backward reduce-scatters their
        gradients), or, over the `ring` axis, passed around it (see `_ring_attention`). Fused (flash) attention
        keeps no s x t tensor; unfused keeps the softmax output (and with dropout its 1-byte mask and the
        dropped probabilities), the 5 a s^2 b of Korthikanti et al.
        """
        ring = ring if ring in self.degrees and q.dist(ring) == Partition(q.dims[1]) else None
        kv_target: dict[str, Dist] = {}
        for axis in self.degrees:
            d = q.dist(axis)
            if isinstance(d, Partition) and d.dim == q.dims[2]:
                kv_target[axis] = Partition(k.dims[2])
            elif isinstance(d, Partition) and d.dim != q.dims[1]:
                kv_target[axis] = d
            elif axis == ring:
                kv_target[axis] = Partition(k.dims[1])
        k2 = self.redistribute(k, kv_target)
        v2 = self.redistribute(v, kv_target)
        if ring is not None:
            return self._ring_attention(name, q, k2, v2, ring, causal, fused, dropout)
        out, _ = self._attention_step(name, q, k2, v2, causal, fused, dropout, value_dim)
        return out

    def _ring_attention(
        self, name: str, q: STensor, k: STensor, v: STensor, axis: str, causal: bool, fused: bool, dropout: bool
    ) -> STensor:
        """Ring attention over a query-sequence split (ring-flash-attention, Megatron-CP's p2p variant): in step j
        each rank attends to the key/value chunk it holds while sending it to the next rank and receiving the
        previous one's, so the transfer for step j + 1 runs beside the compute of step j; the partial outputs
        are folded into one by their softmax statistics.

        Causal balance (the zigzag of Megatron-CP): the sequence is cut into 2 cp chunks and rank r holds chunks
        r and 2 cp - 1 - r, so every step computes half of its query x key block: the diagonal step its two
        causal triangles plus one full quarter, a step with an earlier rank's chunks both query chunks against
        the first key chunk, a step with a later rank's the last query chunk against both key chunks.

        The backward is derived: each step's backward reads the chunk it used again (backward re-sends it rather
        than keeping it, round the ring the other way: `Differentiator._around_the_ring`), and the adjoint of
        each shift carries the chunk's key/value gradient one hop back towards the rank that owns the chunk."""
        steps: list[Node] = []
        out: STensor | None = None
        for j in range(self.degrees[axis]):
            received = (self.shift(k, axis, 1), self.shift(v, axis, 1)) if j + 1 < self.degrees[axis] else None
            partial, node = self._attention_step(f"{name}.step{j}", q, k, v, causal, fused, dropout)
            steps.append(node)
            if out is None:
                out = partial
            else:
                out = self.pointwise(f"{name}.merge{j}", (out, partial), MERGE_FLOPS, linear=True)
            if received is not None:
                k, v = received
        assert out is not None
        for node in steps:
            node.final = out
        return out

    def _attention_step(
        self,
        name: str,
        q: STensor,
        k: STensor,
        v: STensor,
        causal: bool,
        fused: bool,
        dropout: bool,
        value_dim: str | None = None,
    ) -> tuple[STensor, Node]:
        """One attention kernel of q over the keys and values as laid out here."""
        out_dims = (*q.dims[:3], value_dim or v.dims[3])
        out = STensor(name, out_dims, q.layout, q.itemsize)
        b, sq, n, dq = (self.local_size(q, dim) for dim in q.dims)
        skv, dv = self.local_size(k, k.dims[1]), self.local_size(out, out_dims[3])
        reads = (q, k) if value_dim else (q, k, v)
        mark = self._mark
        if fused:
            density = 0.5 if causal and sq > 1 else 1.0
            self._compute(name, "attention", 2 * b * sq * skv * n * (dq + dv), reads, (out,), density=density)
            node = Node("attention", name, (q, k, v), out, "attention", density)
        else:
            probs = b * sq * skv * n
            self._unfused_attention(name, q, k, v, out, probs, dq, dv, dropout)
            extra = probs * (q.itemsize + (1 + q.itemsize if dropout else 0))
            node = Node("attention", name, (q, k, v), out, "attention", extra_saved=extra, dropout=dropout)
        self._record(node, mark)
        return out, node

    def _unfused_attention(
        self,
        name: str,
        q: STensor,
        k: STensor,
        v: STensor,
        out: STensor,
        probs: float,
        dq: float,
        dv: float,
        dropout: bool,
    ) -> None:
        """Attention as Megatron ran it before fused kernels (Korthikanti et al.'s setting): Q K^T into an s x t
        score matrix in HBM, a fused scale-mask-softmax kernel, dropout with its 1-byte mask, and the
        probabilities times V. Every one of the s x t entries is computed (the causal mask is applied, not
        skipped) and each kernel reads or writes the matrix through HBM, which bounds them on long sequences
        rather than their FLOPs."""
        matrix = probs * q.itemsize
        last = self._matrix_matmul(f"{name}.scores", 2 * probs * dq, matrix, (q, k), (), self.emitter.deps((q, k)))
        last = self._kernel(f"{name}.softmax", "elementwise", SOFTMAX_FLOPS * probs, 2 * matrix, matrix, (last,))
        if dropout:
            last = self._kernel(
                f"{name}.dropout", "elementwise", 2 * probs, 2 * matrix + probs, matrix + probs, (last,)
            )
        deps = tuple(sorted({last, *self.emitter.deps((v,))}))
        self._matrix_matmul(name, 2 * probs * dv, matrix, (v,), (out,), deps)
        self.emitter.peak_temp = larger(self.emitter.peak_temp, 2 * matrix)  # scores and probabilities at once

    def _matrix_matmul(
        self,
        name: str,
        flops: float,
        matrix: float,
        reads: Sequence[STensor],
        writes: Sequence[STensor],
        deps: tuple[int, ...],
    ) -> int:
        """A matmul of unfused attention: it reads `reads` and writes `writes` (tensors of the tape), and writes
        the s x t matrix (`matrix` bytes) when `writes` is empty, else reads it."""
        written = sum(self.nbytes(t) for t in writes) if writes else matrix
        moved = matrix + sum(self.nbytes(t) for t in (*reads, *writes))
        return self._kernel(name, "gemm", flops, moved, written, deps, writes)

    def unfused_attention_backward(
        self,
        name: str,
        g: STensor,
        q: STensor,
        k: STensor,
        v: STensor,
        out: STensor,
        dq: STensor,
        dk: STensor,
        dv: STensor,
        dropout: bool,
    ) -> None:
        """The backward of `_unfused_attention` from its kept probabilities (ready with `out`): dP = dO V^T and
        dV = P^T dO, dropout's and softmax's backward over the s x t matrix, then dQ = dS K and dK = dS^T Q: four
        matmuls (twice the forward's FLOPs), and every kernel reads or writes the matrix through HBM."""
        b, sq, n, d_q = (self.local_size(q, dim) for dim in q.dims)
        probs = b * sq * self.local_size(k, k.dims[1]) * n
        matrix = probs * q.itemsize
        d_v = self.local_size(out, out.dims[3])
        deps = self.emitter.deps
        last = self._matrix_matmul(f"{name}.backward.probs", 2 * probs * d_v, matrix, (g, v), (), deps((g, v)))
        self._matrix_matmul(f"{name}.backward.values", 2 * probs * d_v, matrix, (g,), (dv,), deps((g, out)))
        if dropout:
            last = self._kernel(f"{name}.backward.dropout", "elementwise", probs, 2 * matrix + probs, matrix, (last,))
        last = self._kernel(
            f"{name}.backward.softmax", "elementwise", SOFTMAX_BACKWARD_FLOPS * probs, 3 * matrix, matrix, (last,)
        )
        for part, grad, other in (("queries", dq, k), ("keys", dk, q)):
            deps_after = tuple(sorted({last, *deps((other,))}))
            self._matrix_matmul(f"{name}.backward.{part}", 2 * probs * d_q, matrix, (other,), (grad,), deps_after)
        self.emitter.peak_temp = larger(self.emitter.peak_temp, 2 * matrix)  # dP and dS at once

    def dropout(self, name: str, x: STensor) -> STensor:
        """Dropout: keeps a 1-byte mask for backward (the output is not needed)."""
        mask = STensor(f"{name}.mask", x.dims, x.layout, 1)
        out = STensor(name, x.dims, x.layout, x.itemsize)
        mark = self._mark
        self._compute(name, "elementwise", 2 * self.elems(x), (x,), (out, mask))
        self._record(Node("dropout", name, (x, mask), out, "elementwise", 2.0), mark)
        return out

    def relabel(
        self,
        name: str,
        x: STensor,
        out_dims: tuple[str, ...],
        dim_map: dict[str, str],
        flops_per_elem: float = 0.0,
        side: Sequence[STensor] = (),
        category: str = "other",
        overrides: dict[str, Dist] | None = None,
    ) -> STensor:
        """A permutation or regrouping of x's elements into new dimensions (MoE dispatch and combine, reshapes):
        x's partitioning follows dim_map; side inputs (routing weights) are read too. Linear in x."""
        layout: dict[str, Dist] = {}
        for axis, d in x.layout:
            layout[axis] = Partition(dim_map.get(d.dim, d.dim)) if isinstance(d, Partition) else d
        layout |= overrides or {}
        out = STensor(name, out_dims, make_layout(**layout), x.itemsize)
        mark = self._mark
        self._compute(name, category, flops_per_elem * self.elems(out), (x, *side), (out,))
        self._record(Node("relabel", name, (x, *side), out, category, flops_per_elem), mark)
        return out

    def embedding(self, name: str, tokens: STensor, table: STensor, out_dims: tuple[str, ...]) -> STensor:
        """A table lookup; a vocabulary-partitioned table yields partial sums (zeros off-shard)."""
        vocab = table.dims[0]
        layout = dict(tokens.layout)
        for axis in self.degrees:
            if table.dist(axis) == Partition(vocab):
                layout[axis] = PARTIAL
        out = STensor(name, out_dims, make_layout(**layout), table.itemsize)
        mark = self._mark
        self._compute(name, "embedding", 0.0, (tokens,), (out,))
        self._record(Node("embedding", name, (tokens, table), out, "embedding"), mark)
        return out

    def loss(self, name: str, logits: STensor) -> STensor:
        """Cross-entropy over a vocabulary that may be partitioned: two small all-reduces (max and sum-exp)."""
        vocab = logits.dims[-1]
        tokens_dims = logits.dims[:-1]
        mark = self._mark
        stats = STensor(f"{name}.stats", tokens_dims, logits.layout, 4)
        for axis in sorted(self.degrees):
            if logits.dist(axis) == Partition(vocab):
                for what in ("max", "sumexp"):
                    deps = self.emitter.deps([logits, stats])
                    op = Op(
                        f"{name}.{what}.all_reduce",
                        OpKind.COLLECTIVE,
                        "all_reduce",
                        comm_bytes=self.nbytes(stats),
                        axis=axis,
                        deps=deps,
                    )
                    self.emitter.emit(op, [stats])
        out = STensor(name, (), (), 4)
        self._compute(name, "elementwise", 5 * self.elems(logits), (logits, stats), (out,))
        # The cross-entropy runs in fp32 (PyTorch's on logits.float(), Megatron's vocab-parallel one likewise):
        # the fp32 copy of the logits is held beside them while the fp32 log-probabilities are formed, and
        # those are what backward reads.
        log_probs = FP32 * self.elems(logits)
        self.emitter.peak_temp = larger(self.emitter.peak_temp, self.nbytes(logits) + log_probs)
        self._record(Node("loss", name, (logits,), out, "elementwise", 5, extra_saved=log_probs), mark)
        return out


def reduction_layout(source: STensor, kept: tuple[str, ...]) -> Layout:
    """Layout of a reduction of source onto the dims in kept: partial sums where a reduced dim was split."""
    out: dict[str, Dist] = {}
    for axis, d in source.layout:
        if isinstance(d, Partition):
            out[axis] = d if d.dim in kept else PARTIAL
        elif isinstance(d, PartialSum):
            out[axis] = d
    return make_layout(**out)


__all__ = [
    "DUP",
    "PARTIAL",
    "Duplicated",
    "Node",
    "Partial",
    "PartialSum",
    "Partition",
    "STensor",
    "Tracer",
    "make_layout",
    "reduction_layout",
]
