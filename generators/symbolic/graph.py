"""The Tracer: emits the ops of symbolic computations for one rank, one block at a time, and keeps the forward tape
that the backward block differentiates.

Tensors have named dimensions whose sizes come from the design point, and a layout (`Dist`) per parallel axis.
Each op states what layouts it needs; the matcher in `dist` inserts the collectives that get there. The backward
pass is derived, not written (`autodiff`): the gradient of an einsum is two einsums whose layouts (a partial sum
where a partitioned index is contracted) bring in the TP all-reduces, the SP reduce-scatters and the DP gradient
sync on their own, and the adjoint of a redistribution is the redistribution back.

Ops go to the current `Emitter`; the tensors and recorded nodes are in `tensors`, attention's kernels in
`attention`.
"""

from collections.abc import Sequence
from dataclasses import replace
from math import prod

from dse.fields import DTYPE_BYTES
from dse.workload import AttentionShape, Collective, Op, OpKind
from generators.symbolic.dist import DUP, PARTIAL, Dist, Partition, collective_for
from generators.symbolic.emitter import Emitter
from generators.symbolic.tape import larger
from generators.symbolic.tensors import EXPAND, SCALED, Node, Partial, STensor, make_layout

AXIS_ORDER = ("tp", "cp", "ep", "dp", "pp")
"""Rank layout order, innermost first (Megatron: tp, cp, then the data axes, pp outermost)."""
JOINABLE = frozenset({"cp", "ep", "dp"})
FP32 = DTYPE_BYTES["fp32"]
"""Bytes of the fp32 intermediates eager kernels and the cross-entropy work in."""


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

    def record(self, node: Node, first_op: int, ops: tuple[Op, ...] | None = None) -> None:
        """Put node on the tape with the ops emitted since first_op (or `ops`, those it routed elsewhere)."""
        if self.recording:
            node.ops = tuple(self.emitter.ops[first_op:]) if ops is None else ops
            self.tape.append(node)

    @property
    def mark(self) -> int:
        """Where the next op goes in the block: a node's ops are those from its mark on (`record`)."""
        return len(self.emitter.ops)

    def _temp(self, t: STensor) -> None:
        self.emitter.peak_temp = larger(self.emitter.peak_temp, self.nbytes(t))

    # -- communication -------------------------------------------------------------------------------------
    def redistribute(
        self, t: STensor, target: dict[str, Dist], record: bool = True, weight_grad: bool = False
    ) -> STensor:
        """Bring t to the target layout (axes not named stay Duplicated), one collective per axis that differs;
        outside the forward tape, and for a weight's gathers (t a parameter: ZeRO-3's) and its gradient's
        reduce-scatters, the same collective on data axes (cp, ep, dp) is one collective over their joint group
        (`_moves`): the dp x cp gradient all-reduce, and ZeRO's shard group of the data-parallel and the cp ranks
        (`DenseModule.param`). weight_grad: t is a weight's gradient, whose reduce-scatter is ZeRO-3's gradient
        sync (`Emitter.emit_grad_reduce`)."""
        current = t
        for axes, dst, collective in self._moves(t, target, join=not record or t.param or weight_grad):
            axis = "+".join(a for a in AXIS_ORDER if a in axes)
            cached = self.emitter.moved.get((id(current), axis, dst))
            if cached is not None:
                current = cached
                continue
            moved = current
            for a in axes:
                moved = moved.relayout(a, dst)
            routed: tuple[Op, ...] | None = None
            self.emitter.remember_move(current, axis, dst, moved)
            mark = self.mark
            if collective is None:
                self.emitter.same_origin(moved, current)
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
                elif weight_grad and collective is Collective.REDUCE_SCATTER:
                    self.emitter.emit_grad_reduce(op, [moved])
                else:
                    self.emitter.emit(op, [moved])
            if record:
                node = Node("redistribute", f"{t.name}.{axis}", (current,), moved, axis=axis)
                self.record(node, mark, routed)
            current = moved
        return current

    def _moves(
        self, t: STensor, target: dict[str, Dist], join: bool
    ) -> list[tuple[tuple[str, ...], Dist, Collective | None]]:
        """The layout changes that take t to `target`: per axis that differs, its axes, the layout they reach and
        the collective (None: a local slice). With `join`, one collective to one layout on several data axes is
        a single move over their joint group: the ranks that split a batch or a sequence hold the same weights,
        so their gradient reduction, and ZeRO's gathers and reduce-scatters over those ranks, are one collective
        in the frameworks (Megatron-LM's data-parallel-with-cp group, torchtitan's FSDP mesh)."""
        moves: list[tuple[tuple[str, ...], Dist, Collective | None]] = []
        for axis in sorted(self.degrees):
            src, dst = t.dist(axis), target.get(axis, DUP)
            if src == dst:
                continue
            collective = collective_for(src, dst)
            if join and moves and collective is not None and axis in JOINABLE:
                axes, last_dst, last_collective = moves[-1]
                if last_collective is collective and last_dst == dst and axes[-1] in JOINABLE:
                    moves[-1] = ((*axes, axis), dst, collective)
                    continue
            moves.append(((axis,), dst, collective))
        return moves

    def shift(self, t: STensor, axis: str, peer: int, record: bool = True) -> STensor:
        """Send t `peer` positions along the axis's ring and receive the neighbour's chunk from `peer` positions
        back in its place: one step of a ring (every rank of the axis runs it at once)."""
        moved = STensor(f"{t.name}.shift", t.dims, t.layout, t.itemsize, t.param)
        size = self.nbytes(t)
        mark = self.mark
        send = Op(f"{t.name}.send", OpKind.SEND, "send", comm_bytes=size, axis=axis, peer=peer)
        self.emitter.emit(replace(send, deps=self.emitter.deps([t])))
        self.emitter.emit(Op(f"{t.name}.recv", OpKind.RECV, "recv", comm_bytes=size, axis=axis, peer=-peer), [moved])
        if record:
            self.record(Node("shift", f"{t.name}.{axis}", (t,), moved, axis=axis, peer=peer), mark)
        return moved

    # -- compute -------------------------------------------------------------------------------------------
    def compute(
        self,
        name: str,
        category: str,
        flops: float,
        inputs: Sequence[STensor],
        outputs: Sequence[STensor],
        density: float = 1.0,
        attention: AttentionShape | None = None,
        gemm: tuple | None = None,
    ) -> None:
        """A compute op reading `inputs` and writing `outputs`, tensors of the tape, which it is the producer of;
        gemm: a matrix product's (batch, m, n, k)."""
        written = sum(self.nbytes(t) for t in outputs)
        read = sum(self.nbytes(t) for t in inputs)
        deps = self.emitter.deps(inputs)
        self.kernel(name, category, flops, read + written, written, deps, outputs, density, attention, gemm)
        for t in outputs:
            self._temp(t)

    def kernel(
        self,
        name: str,
        category: str,
        flops: float,
        nbytes: float,
        written: float,
        deps: tuple[int, ...],
        outputs: Sequence[STensor] = (),
        density: float = 1.0,
        attention: AttentionShape | None = None,
        gemm: tuple | None = None,
    ) -> int:
        """A compute op whose traffic is given (it reads or writes values that are not tensors of the tape)."""
        op = Op(
            name,
            OpKind.COMPUTE,
            category,
            flops=flops,
            bytes=nbytes,
            density=density,
            deps=deps,
            out_bytes=written,
            attention=attention,
            gemm=gemm,
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
        mark = self.mark
        result = STensor(name, out_dims, make_layout(**out), a.itemsize)
        indices = dict.fromkeys((*a2.dims, *b2.dims))
        local = {i: self.local_size(a2 if i in a2.dims else b2, i) for i in indices}
        free_a = [i for i in a2.dims if i not in b2.dims]
        free_b = [i for i in b2.dims if i not in a2.dims]
        batch = [i for i in a2.dims if i in b2.dims and i in out_dims]
        summed = [i for i in a2.dims if i in b2.dims and i not in out_dims]
        shape = tuple(prod(local[i] for i in group) for group in (batch, free_a, free_b, summed))
        self.compute(name, category, 2 * prod(local.values()), (a2, b2), (result,), gemm=shape)
        if record:
            self.record(Node("einsum", name, (a2, b2), result, category=category), mark)
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
        fused: bool = False,
    ) -> STensor:
        """An elementwise op laid out like its first input; other inputs follow it (broadcast where smaller).
        itemsize: the output's (a dtype cast), default the first input's; partials: an eager op's gradients;
        dims: the output's when a broadcast makes it wider than the first input (those extra dims unsplit);
        fused: done inside the kernel that writes its first input or reads its output (a GEMM's bias epilogue, a
        fused bias-dropout-add), so it moves no bytes of its own; its gradient is what it would be apart."""
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
        mark = self.mark
        if fused:
            self.kernel(name, category, 0.0, 0.0, 0.0, self.emitter.deps(moved), (result,))
            self._temp(result)
        else:
            self.compute(name, category, flops_per_elem * self.elems(result), moved, (result,))
        node = Node("pointwise", name, tuple(moved), result, category, flops_per_elem, linear, partials=partials)
        self.record(node, mark)
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
        mark = self.mark
        self.compute(name, category, self.elems(x), (x,), (result,))
        self.record(Node("pointwise", name, (x,), result, category, 1.0, partials=(partial,)), mark)
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
        mark = self.mark
        self.compute(name, "norm", flops_per_elem * self.elems(result), (x, *ws), (result,))
        self.record(Node("norm", name, (x, *ws), result, "norm", flops_per_elem), mark)
        return result

    def dropout(self, name: str, x: STensor, fused_reads: Sequence[STensor] = ()) -> STensor:
        """Dropout: keeps a 1-byte mask for backward (the output is not needed). fused_reads: tensors the same
        kernel also reads for ops fused into it (the residual of a fused bias-dropout-add)."""
        mask = STensor(f"{name}.mask", x.dims, x.layout, 1)
        out = STensor(name, x.dims, x.layout, x.itemsize)
        mark = self.mark
        self.compute(name, "elementwise", 2 * self.elems(x), (x, *fused_reads), (out, mask))
        self.record(Node("dropout", name, (x, mask), out, "elementwise", 2.0), mark)
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
        mark = self.mark
        self.compute(name, category, flops_per_elem * self.elems(out), (x, *side), (out,))
        self.record(Node("relabel", name, (x, *side), out, category, flops_per_elem), mark)
        return out

    def embedding(self, name: str, tokens: STensor, table: STensor, out_dims: tuple[str, ...]) -> STensor:
        """A table lookup; a vocabulary-partitioned table yields partial sums (zeros off-shard)."""
        vocab = table.dims[0]
        layout = dict(tokens.layout)
        for axis in self.degrees:
            if table.dist(axis) == Partition(vocab):
                layout[axis] = PARTIAL
        out = STensor(name, out_dims, make_layout(**layout), table.itemsize)
        mark = self.mark
        self.compute(name, "embedding", 0.0, (tokens, out), (out,))  # reads the rows it writes
        self.record(Node("embedding", name, (tokens, table), out, "embedding"), mark)
        return out

    def loss(self, name: str, logits: STensor) -> STensor:
        """Cross-entropy over a vocabulary that may be partitioned, as Megatron's fused vocab-parallel cross-entropy
        runs it (core/fusions/fused_cross_entropy.py): three passes over the logits in fp32, the maximum per token
        (reading the logits), the shifted exponentials and their sum (reading the logits, writing the exponentials)
        and the softmax (reading and writing those), which backward reads. Over a vocabulary split it all-reduces
        three fp32 values per token on the split's axis: the maximum after the first pass, the target's logit (only
        the rank holding the target has it) and the sum of exponentials after the second."""
        vocab = logits.dims[-1]
        mark = self.mark
        stats = STensor(f"{name}.stats", logits.dims[:-1], logits.layout, FP32)
        axes = [axis for axis in sorted(self.degrees) if logits.dist(axis) == Partition(vocab)]
        elems, probs = self.elems(logits), FP32 * self.elems(logits)
        passes = (
            ("max", elems, self.nbytes(logits), ("max",)),
            ("exp_sum", 3 * elems, self.nbytes(logits) + probs, ("target", "sumexp")),
            ("softmax", elems, 2 * probs, ()),
        )
        for what, flops, moved, reduced in passes:
            written = 0.0 if what == "max" else probs
            deps = self.emitter.deps([logits, stats])
            self.kernel(f"{name}.{what}", "elementwise", flops, moved, written, deps, (stats,))
            for axis, statistic in ((axis, statistic) for axis in axes for statistic in reduced):
                op = Op(
                    f"{name}.{statistic}.all_reduce",
                    OpKind.COLLECTIVE,
                    "all_reduce",
                    comm_bytes=self.nbytes(stats),
                    axis=axis,
                    deps=self.emitter.deps([logits, stats]),
                )
                self.emitter.emit(op, [stats])
        out = STensor(name, (), (), FP32)
        self.emitter.same_origin(out, stats)
        # held at once: the logits and their fp32 copy, then that copy and the exponentials formed from it (what a
        # fused kernel, torch.compile's or Megatron's cross_entropy_loss_fusion, writes apart); the softmax made
        # from those is what backward reads
        held = larger(self.nbytes(logits) + probs, 2 * probs)
        self.emitter.peak_temp = larger(self.emitter.peak_temp, held)
        self.record(Node("loss", name, (logits,), out, "elementwise", 5, extra_saved=probs), mark)
        return out
