"""A layer at any micro-batch from its captures at two: reuse across points that change only the micro-batch.

Every figure of a lowered layer is affine in the micro-batch b: an op's FLOPs and a collective's bytes grow with the
tokens (b x s), the bytes an op moves are its activations' (linear in b) plus its weights' (constant), a GEMM's m is
b x s, the saved activations are linear in b, and attention's per-sequence shape does not change (its batch is b).
So the layers captured at micro-batches 2 and 3 give every larger one by the line through them, checked to be sound
first: both captures must have the same ops with the same dependencies (micro-batch 1 is captured by itself: the
compiler specialises size-1 dimensions). Only the block's peak temporary memory is a maximum over time of such
lines, which the line through two points can miss when the tensor that peaks changes with b; the tests pin it on the
test model against a capture at that micro-batch.
"""

from dataclasses import replace

from dse.workload import AttentionShape, Block, Op
from generators.fx.lower import LoweredGraph, LoweredLayer

LOW, HIGH = 2, 3
"""The micro-batches captured to scale from."""


def along_batch(low: LoweredLayer, high: LoweredLayer, batch: int) -> LoweredLayer | None:
    """The layer at micro-batch `batch` from its captures at LOW and HIGH; None when those differ in structure."""
    t = (batch - LOW) / (HIGH - LOW)
    forward = _graph(low.forward, high.forward, t)
    if low.backward is None or high.backward is None:
        return None if forward is None or low.backward != high.backward else LoweredLayer(forward, None, low.captured)
    backward = _graph(low.backward, high.backward, t)
    if forward is None or backward is None:
        return None
    return LoweredLayer(forward, backward, low.captured)


def _line(a: float, b: float, t: float) -> float:
    return a + (b - a) * t


def _graph(low: LoweredGraph, high: LoweredGraph, t: float) -> LoweredGraph | None:
    block = _block(low.block, high.block, t)
    return None if block is None else LoweredGraph(block, _line(low.saved_bytes, high.saved_bytes, t))


def _per_sequence(op: Op) -> AttentionShape | None:
    """An attention op's shape but its batch (the sequences of the call, which grow with the micro-batch)."""
    return None if op.attention is None else op.attention._replace(batch=0.0)


def _block(low: Block, high: Block, t: float) -> Block | None:
    if len(low.ops) != len(high.ops) or low.output != high.output:
        return None
    ops = []
    for a, b in zip(low.ops, high.ops, strict=True):
        alike = (a.name, a.kind, a.category, a.deps, a.axis, a.density, _per_sequence(a), a.gemm is None)
        if alike != (b.name, b.kind, b.category, b.deps, b.axis, b.density, _per_sequence(b), b.gemm is None):
            return None
        gemm = None
        if a.gemm is not None and b.gemm is not None:
            gemm = tuple(_line(x, y, t) for x, y in zip(a.gemm, b.gemm, strict=True))
        attention = a.attention
        if attention is not None and b.attention is not None:
            attention = attention._replace(batch=_line(attention.batch, b.attention.batch, t))
        ops.append(
            replace(
                a,
                flops=_line(a.flops, b.flops, t),
                bytes=_line(a.bytes, b.bytes, t),
                comm_bytes=_line(a.comm_bytes, b.comm_bytes, t),
                out_bytes=_line(a.out_bytes, b.out_bytes, t),
                gemm=gemm,  # type: ignore[arg-type]
                attention=attention,
            )
        )
    return Block(low.name, tuple(ops), low.output, _line(low.temp_bytes, high.temp_bytes, t))
