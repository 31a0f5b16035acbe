"""The ops of one block as they are traced (`Emitter`): which op produced each tensor (the dependencies of the
ops that read it), the collectives already done, the block's peak temporary memory, and where ZeRO-3's weight
all-gathers and gradient reduce-scatters go with the copies FSDP runs around them."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from dse.workload import BLOCK_INPUT, Op, OpKind
from generators.symbolic.dist import Dist
from generators.symbolic.fsdp import FsdpCopies, chained
from generators.symbolic.tensors import STensor


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
    """Emit the ZeRO-3 parameter all-gathers into `gathers`, a block of their own that the schedule issues ahead of
    the module (FSDP's prefetch, `weight_gathers`), instead of into this block; the gathered weights are inputs of
    this block."""
    gathers: list[Op] = field(default_factory=list)
    fsdp: FsdpCopies | None = None
    """The copies FSDP runs around each weight all-gather (ZeRO-3), if any."""
    gather_copies: list[int] = field(default_factory=list)
    """The copies FSDP runs around ZeRO-3's weight all-gathers in this block, which a call that finds the weights
    still gathered does not run (`parallel.reshard_after_forward` false)."""
    grad_reduces: list[int] = field(default_factory=list)
    """The ops of ZeRO-3's gradient reduce-scatters with their copies, which a backward that accumulates its
    gradients unsharded leaves out (`parallel.grad_reduce` per_step)."""
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
        first = len(self.ops)
        self._emit_param_gather(op, outputs)
        self.gather_copies.extend(i for i in range(first, len(self.ops)) if self.ops[i].kind is OpKind.COMPUTE)

    def _emit_param_gather(self, op: Op, outputs: Sequence[STensor]) -> None:
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
        first = len(self.ops)
        index = self._emit_grad_reduce(op, outputs)
        self.grad_reduces.extend(range(first, len(self.ops)))
        return index

    def _emit_grad_reduce(self, op: Op, outputs: Sequence[STensor]) -> int:
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
