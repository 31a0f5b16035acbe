"""Lowering a captured ATen graph to a block of our IR.

Each node is one of:
- free: views, reshapes, transposes, splits, `getitem`, `detach` and `wait_tensor` launch no kernel; their output is
  ready when what they read is (a `wait_tensor` is where the collective it waits for must have ended, so what reads
  it depends on that collective: the overlap the graph allows is what the dependencies leave);
- a functional collective (`_c10d_functional.*`): a COLLECTIVE op on the axis its process group is of, its size in
  the nccl-tests convention (all-reduce the buffer, all-gather the output, reduce-scatter the input, all-to-all the
  send buffer);
- a compute op: FLOPs from torch.utils.flop_counter's registry where it has a formula (matmuls), our own for
  fused attention (symbolic's convention, with its AttentionShape), norms, softmax and elementwise ops; HBM bytes
  the tensors it reads and writes (of a gather's source, the elements it picks); a GEMM's (batch, m, n, k).
- an in-place update of an input: an inference graph keeps its mutations of its inputs (a decoding layer's append
  to its KV cache) as the functional op (`index_copy`, `index_put`, ...) that makes the updated tensor and a `copy_`
  back into the input, which inductor turns into the in-place op again: one kernel that reads and writes the values
  it writes (category 'other', as the symbolic generator's cache write), not the whole input; the copy is free.
Placeholders are the call's inputs (BLOCK_INPUT): the layer input and the weights in forward, the output gradient
and the saved activations in backward; those a graph updates in place are state it holds (`state_bytes`).
Intermediate tensors live from their op to their last reader; the peak of those alive at once is the block's
temporary memory, and what the forward hands to backward (its outputs after the first, weights aside) is the
layer's saved activations.
"""

import operator
from collections.abc import Iterable
from dataclasses import replace
from math import prod
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

import generators.fx.attention  # noqa: F401  (defines torch.ops.dse_fx, whose ops `compute` looks for)
from dse.workload import BLOCK_INPUT, AttentionShape, Block, Collective, Op, OpKind
from generators.fx.pieces import CaptureError, LoweredGraph
from generators.symbolic.attention import SOFTMAX_BACKWARD_FLOPS, SOFTMAX_FLOPS
from generators.symbolic.autodiff import FUSED_ATTENTION_BACKWARD
from generators.symbolic.dense import NORM_FLOPS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
dse_fx = torch.ops.dse_fx

FREE = {
    aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.t, aten.transpose, aten.permute,
    aten.expand, aten.squeeze, aten.unsqueeze, aten.split, aten.split_with_sizes, aten.unbind, aten.detach,
    aten.alias, aten.slice, aten.select, aten.as_strided, aten.view_as_real, aten.view_as_complex,
    aten.lift_fresh_copy, c10d.wait_tensor,
}  # fmt: skip
COLLECTIVES = {
    c10d.all_reduce: Collective.ALL_REDUCE,
    c10d.all_gather_into_tensor: Collective.ALL_GATHER,
    c10d.reduce_scatter_tensor: Collective.REDUCE_SCATTER,
    c10d.all_to_all_single: Collective.ALL_TO_ALL,
}
GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
NORMS = {  # FLOPs per element of the normalised tensor (symbolic's NORM_FLOPS; a backward twice its forward)
    aten._fused_rms_norm: NORM_FLOPS["rmsnorm"], aten._fused_rms_norm_backward: 2 * NORM_FLOPS["rmsnorm"],
    aten.rms_norm: NORM_FLOPS["rmsnorm"],
    aten.native_layer_norm: NORM_FLOPS["layernorm"], aten.native_layer_norm_backward: 2 * NORM_FLOPS["layernorm"],
}  # fmt: skip
PER_ELEMENT = {  # a log-softmax (the loss's) costs what a softmax does
    aten._softmax: SOFTMAX_FLOPS, aten._softmax_backward_data: SOFTMAX_BACKWARD_FLOPS,
    aten._log_softmax: SOFTMAX_FLOPS, aten._log_softmax_backward_data: SOFTMAX_BACKWARD_FLOPS,
}  # fmt: skip
COPIES = {aten.clone, aten._to_copy, aten.cat, aten.copy, aten.copy_, aten.empty, aten.zeros, aten.full, aten.fill}
EMBEDDINGS = {aten.embedding, aten.embedding_dense_backward}
FUSIBLE = ("elementwise", "norm")


def _packet(node: fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", node.target)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in _tensors(value)))


def _inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes]


def _val(arg: Any) -> Any:
    return fx.node.map_arg(arg, lambda n: n.meta.get("val"))


class _Lowering:
    def __init__(self, gm: fx.GraphModule, name: str, axes: dict[str, str], fuse: bool) -> None:
        self.gm, self.name, self.axes, self.fuse = gm, name, axes, fuse
        self.ops: list[Op] = []
        self.fused: list[tuple[fx.Node, Op]] = []
        """The nodes (and their own ops) of the fused kernel that is the last op, while it may take more."""
        self.ready: dict[fx.Node, frozenset[int]] = {}
        self.root: dict[fx.Node, fx.Node] = {}
        self.updates = _updates(gm)

    def deps(self, nodes: Iterable[fx.Node]) -> tuple[int, ...]:
        return tuple(sorted(set().union(*(self.ready.get(n, frozenset()) for n in nodes))))

    def run(self, output_index: int) -> tuple[Block, list[Any]]:
        outputs: list[Any] = []
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.ready[node], self.root[node] = frozenset((BLOCK_INPUT,)), node
            elif node.op == "output":
                outputs = list(node.args[0])
            elif node.op == "call_function":
                self.lower(node)
        produced = outputs[output_index]
        last = max(self.ready.get(produced, frozenset((-1,)))) if isinstance(produced, fx.Node) else -1
        block = Block(self.name, tuple(self.ops), last if last >= 0 else -1, self.peak_temp(outputs))
        return block, outputs

    def lower(self, node: fx.Node) -> None:
        packet, inputs = _packet(node), _inputs(node)
        free = packet in FREE or node.target is operator.getitem or _regrouped(node)
        if free or _copied_back(node, self.updates):
            self.ready[node] = frozenset(self.deps(inputs))
            self.root[node] = self.root.get(inputs[0], node) if inputs else node
            return
        deps, out = self.deps(inputs), node.meta.get("val")
        reads = sum(_read(node, n) for n in dict.fromkeys(inputs))
        target = self.updates.get(node)
        if target is not None:  # in place: what it reads besides its target, and its values written
            others = [n.meta.get("val") for n in dict.fromkeys(inputs) if self.root.get(n, n) is not target]
            written = _nbytes([t for t in _tensors(others) if t.is_floating_point()])
            op = Op(f"{self.name}.{node.name}", OpKind.COMPUTE, "other", bytes=_nbytes(others) + written,
                    out_bytes=written, deps=deps)  # fmt: skip
            self.ops.append(op)
            self.fused = []
            self.ready[node], self.root[node] = frozenset((len(self.ops) - 1,)), target
            return
        if packet in COLLECTIVES:
            kind = COLLECTIVES[packet]
            group = node.args[-1]
            if group not in self.axes:
                raise CaptureError(f"{node.target} on a process group ({group}) outside the (dp, ep, tp) mesh")
            size = _nbytes(out) if kind is Collective.ALL_GATHER else _nbytes(node.args[0].meta.get("val"))
            op = Op(f"{self.name}.{node.name}", OpKind.COLLECTIVE, kind.value, comm_bytes=size,
                    axis=self.axes[group], deps=deps)  # fmt: skip
        else:
            op = self.compute(node, packet, deps, reads, _nbytes(out))
        fusible = self.fuse and op.kind is OpKind.COMPUTE and op.category in FUSIBLE
        if fusible and self.fused:
            self.fused.append((node, op))
            self.ops[-1] = self.fused_op()
        else:
            self.ops.append(op)
            self.fused = [(node, op)] if fusible else []
        self.ready[node], self.root[node] = frozenset((len(self.ops) - 1,)), node

    def fused_op(self) -> Op:
        """The elementwise and norm ops issued one after another as one kernel, as inductor fuses them: it reads
        what its ops read from outside it and writes what is read after it, once each."""
        index, inside = len(self.ops) - 1, {node for node, _ in self.fused}
        outside: dict[fx.Node, float] = {}
        for node in inside:
            for n in _inputs(node):
                if self.root.get(n, n) not in inside:
                    outside[n] = max(outside.get(n, 0.0), _read(node, n))
        reads = sum(outside.values())
        written = sum(_nbytes(node.meta.get("val")) for node in inside if _escapes(node, inside))
        first = self.fused[0][1]
        return replace(
            first,
            category="norm" if any(op.category == "norm" for _, op in self.fused) else "elementwise",
            flops=sum(op.flops for _, op in self.fused),
            bytes=reads + written,
            out_bytes=written,
            deps=tuple(sorted(set(self.deps(outside)) - {index})),
        )

    def compute(self, node: fx.Node, packet: Any, deps: tuple[int, ...], reads: float, written: float) -> Op:
        name, out = f"{self.name}.{node.name}", node.meta.get("val")
        elements = float(sum(t.numel() for t in _tensors(out)))
        common = {"bytes": reads + written, "out_bytes": written, "deps": deps}
        if packet in (dse_fx.attention, dse_fx.attention_backward):
            return self.attention(node, name, common)
        if packet in GEMMS:
            flops = flop_registry[packet](*_val(node.args), **_val(node.kwargs), out_val=out)
            return Op(name, OpKind.COMPUTE, "gemm", flops=float(flops), gemm=_gemm_shape(packet, node), **common)
        if packet is aten._grouped_mm:
            flops, shape = _grouped_gemm(node)
            return Op(name, OpKind.COMPUTE, "gemm", flops=flops, gemm=shape, **common)
        if packet in flop_registry:
            flops = flop_registry[packet](*_val(node.args), **_val(node.kwargs), out_val=out)
            return Op(name, OpKind.COMPUTE, "other", flops=float(flops), **common)
        if packet in NORMS:
            normed = float(node.args[0].meta["val"].numel())
            return Op(name, OpKind.COMPUTE, "norm", flops=NORMS[packet] * normed, **common)
        if packet is aten.embedding:  # a lookup reads the rows it gathers (and their indices), not the whole table
            looked_up = _nbytes(node.args[1].meta.get("val")) + written
            return Op(name, OpKind.COMPUTE, "embedding", **(common | {"bytes": looked_up + written}))
        if packet in EMBEDDINGS:
            return Op(name, OpKind.COMPUTE, "embedding", **common)
        flops = 0.0 if packet in COPIES else PER_ELEMENT.get(packet, 1.0) * elements
        return Op(name, OpKind.COMPUTE, "norm" if _in_norm(node) else "elementwise", flops=flops, **common)

    def attention(self, node: fx.Node, name: str, common: dict) -> Op:
        backward = _packet(node) is dse_fx.attention_backward
        first = 1 if backward else 0  # the backward's first argument is the output gradient
        q, k, v = (a.meta["val"] for a in node.args[first : first + 3])
        causal = bool(node.args[5] if backward else node.args[3])
        b, heads, sq, dq = q.shape
        skv, dv = k.shape[-2], v.shape[-1]
        flops = 2.0 * b * heads * sq * skv * (dq + dv)
        masked = causal and sq > 1
        density = 0.5 if masked else 1.0
        if backward:
            flops, density = 2 * flops, density * FUSED_ATTENTION_BACKWARD / 2
        shape = AttentionShape(sq, skv, (dq + dv) / 2, masked, backward, b, heads, k.shape[-3])
        return Op(name, OpKind.COMPUTE, "attention", flops=flops, density=density, attention=shape, **common)

    def peak_temp(self, outputs: list[Any]) -> float:
        """The most bytes of intermediate tensors (neither the call's inputs nor its outputs) alive at once."""
        kept = {self.root.get(n, n) for n in outputs if isinstance(n, fx.Node)}
        last_use: dict[fx.Node, int] = {}
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        for node in self.gm.graph.nodes:
            for n in _inputs(node):
                root = self.root.get(n, n)
                last_use[root] = max(last_use.get(root, 0), order[node])
        live, peak, frees = 0.0, 0.0, {}
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and self.root.get(node) is node and node not in kept:
                size = _nbytes(node.meta.get("val"))
                live += size
                frees.setdefault(last_use.get(node, order[node]), []).append(size)
            peak = max(peak, live)
            live -= sum(frees.pop(order[node], []))
        return peak


def _read(node: fx.Node, source: fx.Node) -> float:
    """The bytes `node` reads of its input `source`: the whole tensor, but for a gather's source only the elements
    it picks (one per index: the loss's target logit of each token, not the vocabulary's row)."""
    val = source.meta.get("val")
    if _packet(node) is aten.gather and node.args[0] is source and isinstance(val, torch.Tensor):
        return float(node.meta["val"].numel() * val.element_size())
    return _nbytes(val)


def _updates(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """The in-place updates of the graph's inputs: the node making the updated tensor -> the input it updates (a
    `copy_` of that node into a placeholder)."""
    copies = (n for n in gm.graph.nodes if n.op == "call_function" and _packet(n) is aten.copy_)
    return {n.args[1]: n.args[0] for n in copies if n.args[0].op == "placeholder" and isinstance(n.args[1], fx.Node)}


def _copied_back(node: fx.Node, updates: dict[fx.Node, fx.Node]) -> bool:
    """Whether a node is the copy of an in-place update into its input (free: the update wrote it there)."""
    return _packet(node) is aten.copy_ and updates.get(node.args[1]) is node.args[0]


def _in_norm(node: fx.Node) -> bool:
    """Whether an op is part of a norm module's forward (RMSNorm, LayerNorm, a model's own ...Norm class): a norm
    decomposed into its elementwise steps is still a norm kernel."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return False
    _, module = list(stack.values())[-1]
    name = module if isinstance(module, str) else getattr(module, "__name__", "")
    return name.rsplit(".", 1)[-1].endswith("Norm")


def _escapes(node: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether a node's output (or a view of it) is read by a node outside `inside` or leaves the graph."""
    for user in node.users:
        if user.op == "output":
            return True
        if _packet(user) in FREE or user.target is operator.getitem:
            if _escapes(user, inside):
                return True
        elif user not in inside:
            return True
    return False


def _gemm_shape(packet: Any, node: fx.Node) -> tuple[float, float, float, float]:
    """(batch, m, n, k) of a matrix product on one rank."""
    a, b = (node.args[i].meta["val"] for i in ((1, 2) if packet in (aten.addmm, aten.baddbmm) else (0, 1)))
    batch = float(prod(a.shape[:-2])) if a.dim() > 2 else 1.0
    return batch, float(a.shape[-2]), float(b.shape[-1]), float(a.shape[-1])


def _grouped_gemm(node: fx.Node) -> tuple[float, tuple[float, float, float, float]]:
    """FLOPs and (groups, m, n, k) of a grouped matrix product (`torch._grouped_mm`: Hugging Face's stacked experts),
    which torch's flop counter does not count: 2 m n k summed over the groups. Its three layouts: rows [t, k] by
    stacked weights [g, k, n] (each group's rows by its expert), a batch [g, m, k] by [g, k, n], and the weight
    gradient [m, t] by [t, n] summed per group into [g, m, n]; `m` of the first is the rows per group."""
    a, b, out = node.args[0].meta["val"], node.args[1].meta["val"], node.meta["val"]
    if a.dim() == 2 and b.dim() == 2:  # groups cut the contracted dim: the groups' k sum to t
        groups, m, n, k = out.shape[0], a.shape[0], b.shape[1], a.shape[1]
        return 2.0 * m * n * k, (float(groups), float(m), float(n), float(k) / groups)
    groups = b.shape[0] if b.dim() == 3 else a.shape[0]
    k, n = a.shape[-1], out.shape[-1]
    rows = float(prod(out.shape[:-1]))
    return 2.0 * rows * n * k, (float(groups), rows / groups, float(n), float(k))


def lower_forward(
    gm: fx.GraphModule, name: str, axes: dict[str, str], input_shape: tuple[int, ...], fuse: bool
) -> LoweredGraph:
    lowering = _Lowering(gm, name, axes, fuse)
    block, outputs = lowering.run(0)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weights = {n for n in placeholders if n is not _input_placeholder(placeholders, input_shape)}
    saved = {lowering.root.get(n, n) for n in outputs[1:] if isinstance(n, fx.Node)}
    saved_bytes = sum(_nbytes(n.meta.get("val")) for n in saved if n not in weights)
    state = [n.meta.get("val") for n in set(lowering.updates.values())]
    state_bytes = _nbytes([t for t in _tensors(state) if t.is_floating_point()])  # a cache's position counter aside
    return LoweredGraph(block, saved_bytes, state_bytes)


def lower_backward(
    gm: fx.GraphModule,
    forward: fx.GraphModule,
    name: str,
    axes: dict[str, str],
    input_shape: tuple[int, ...],
    fuse: bool,
) -> LoweredGraph:
    """The backward's output op is the one that makes the block input's gradient (its output at the index of that
    input among the forward's placeholders)."""
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    index = placeholders.index(_input_placeholder(placeholders, input_shape))
    block, _ = _Lowering(gm, name, axes, fuse).run(index)
    return LoweredGraph(block, 0.0)


def _input_placeholder(placeholders: list[fx.Node], shape: tuple[int, ...]) -> fx.Node:
    """The forward placeholder that is the block's input: the first of its shape (weights are 1-D or 2-D)."""
    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and tuple(val.shape) == tuple(shape):
            return node
    raise CaptureError(f"the captured forward has no input of the block input's shape {tuple(shape)}")


def _regrouped(node: fx.Node) -> bool:
    """A cat along dim 0 of every piece, in order, of one split along a dim d with only 1s before it: DTensor moves
    a [1, s, h] activation's sequence dim first this way before reduce-scattering it over the sequence (SP), and the
    pieces already lie in memory as the cat lays them out, so it is a view (inductor writes none); with a batch of 2
    or more it is a real copy."""
    if _packet(node) is not aten.cat or (node.args[1] if len(node.args) > 1 else 0) != 0:
        return False
    pieces = node.args[0]
    splits = {p.args[0] for p in pieces if isinstance(p, fx.Node) and p.target is operator.getitem}
    if len(splits) != 1:
        return False
    (split,) = splits
    if _packet(split) not in (aten.split, aten.split_with_sizes) or set(split.users) != set(pieces):
        return False
    shape = split.args[0].meta["val"].shape
    dim = (split.args[2] if len(split.args) > 2 else 0) % len(shape)
    in_order = [p.args[1] for p in pieces] == list(range(len(split.meta["val"])))
    return in_order and all(size == 1 for size in shape[:dim])
