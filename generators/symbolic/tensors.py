"""The values a trace is made of: symbolic tensors with a layout per parallel axis, and the recorded forward ops
(`Node`) over them that backward differentiates or recomputes, with eager autograd's way of forming each input's
gradient (`Partial`)."""

from dataclasses import dataclass
from typing import Literal

from dse.workload import Op
from generators.symbolic.dist import DUP, PARTIAL, Dist, PartialSum, Partition

Layout = tuple[tuple[str, Dist], ...]
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


def reduction_layout(source: STensor, kept: tuple[str, ...]) -> Layout:
    """Layout of a reduction of source onto the dims in kept: partial sums where a reduced dim was split."""
    out: dict[str, Dist] = {}
    for axis, d in source.layout:
        if isinstance(d, Partition):
            out[axis] = d if d.dim in kept else PARTIAL
        elif isinstance(d, PartialSum):
            out[axis] = d
    return make_layout(**out)
