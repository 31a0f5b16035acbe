"""A layer at any micro-batch (and a decoding layer at any context) from its captures at two: reuse across points
that change only the micro-batch or the context.

Every figure of a lowered layer is affine in the micro-batch b: an op's FLOPs and a collective's bytes grow with the
tokens (b x s), the bytes an op moves are its activations' (linear in b) plus its weights' (constant), a GEMM's m is
b x s, the saved activations are linear in b, and attention's per-sequence shape does not change (its batch is b).
So the layers captured at micro-batches 2 and 3 give every larger one by the line through them, checked to be sound
first: both captures must have the same ops with the same dependencies (micro-batch 1 is captured by itself: the
compiler specialises size-1 dimensions). Only the block's peak temporary memory is a maximum over time of such
lines, which the line through two points can miss when the tensor that peaks changes with b; the tests pin it on the
test model against a capture at that micro-batch.

A decoding layer's figures are affine in its context t at a fixed batch too: its KV cache (the state it updates) and
its attention's FLOPs, bytes and keys grow with t, while its GEMMs, the cache append and its temporaries (the cache
is no temporary) do not. Its captures at two contexts (CONTEXTS) give every longer one, so a serving study, whose
decode steps span many contexts, captures a decoding layer at six shapes at most (three batches by two contexts).

A MoE layer's experts have ceil(tokens x top_k / experts) slots each (`generators.fx.models.moe`), which is affine in
b only at the batches where the division is exact: its layer is scaled from the two smallest such batches
(`capture_batches`), so that the line is the balanced share tokens x top_k / experts at every batch, as the
symbolic generator prices it. A decoding step's single token per sequence needs them most (tiny-moe: 4 and 8).
"""

import math
from dataclasses import replace

from dse.workload import AttentionShape, Block, Op
from generators.fx.pieces import LoweredGraph, LoweredLayer

LOW, HIGH = 2, 3
"""The micro-batches captured to scale from."""
CONTEXTS = (1, 2)
"""The contexts a decoding layer is captured at to scale from (its graph at context 1 is the same as at any other)."""


def capture_batches(tokens_per_sequence: int, experts: int = 1, top_k: int = 1) -> tuple[int, int]:
    """The micro-batches to scale a layer from: LOW and HIGH, or for a MoE layer (of `experts`, each token routed to
    `top_k`, `tokens_per_sequence` tokens of each sequence on the rank) the two smallest multiples of the batch at
    which its experts' capacity is exact (at least LOW)."""
    unit = experts // math.gcd(experts, tokens_per_sequence * top_k)
    if unit == 1:
        return LOW, HIGH
    low = unit * math.ceil(LOW / unit)
    return low, low + unit


def along(
    low: LoweredLayer, high: LoweredLayer, value: int, at: tuple[int, int] = (LOW, HIGH), grows: str = "batch"
) -> LoweredLayer | None:
    """The layer at `value` of a size (the micro-batch; a decoding layer's context) from its captures at the two
    values `at`; `grows`, the field of an attention shape that grows with it (its sequences `batch`, its `keys`).
    None when those captures differ in structure."""
    t = (value - at[0]) / (at[1] - at[0])
    forward = _graph(low.forward, high.forward, t, grows)
    if low.backward is None or high.backward is None:
        return None if forward is None or low.backward != high.backward else LoweredLayer(forward, None, low.captured)
    backward = _graph(low.backward, high.backward, t, grows)
    if forward is None or backward is None:
        return None
    return LoweredLayer(forward, backward, low.captured)


def _line(a: float, b: float, t: float) -> float:
    return a + (b - a) * t


def _graph(low: LoweredGraph, high: LoweredGraph, t: float, grows: str) -> LoweredGraph | None:
    block = _block(low.block, high.block, t, grows)
    if block is None:
        return None
    return LoweredGraph(block, _line(low.saved_bytes, high.saved_bytes, t), _line(low.state_bytes, high.state_bytes, t))


def _unchanging(op: Op, grows: str) -> AttentionShape | None:
    """An attention op's shape but its field that grows (its sequences or its keys)."""
    return None if op.attention is None else op.attention._replace(**{grows: 0.0})


def _block(low: Block, high: Block, t: float, grows: str) -> Block | None:
    if len(low.ops) != len(high.ops) or low.output != high.output:
        return None
    ops = []
    for a, b in zip(low.ops, high.ops, strict=True):
        alike = (a.name, a.kind, a.category, a.deps, a.axis, a.density, _unchanging(a, grows), a.gemm is None)
        if alike != (b.name, b.kind, b.category, b.deps, b.axis, b.density, _unchanging(b, grows), b.gemm is None):
            return None
        gemm = None
        if a.gemm is not None and b.gemm is not None:
            gemm = tuple(_line(x, y, t) for x, y in zip(a.gemm, b.gemm, strict=True))
        attention = a.attention
        if attention is not None and b.attention is not None:
            grown = _line(getattr(attention, grows), getattr(b.attention, grows), t)
            attention = attention._replace(**{grows: grown})
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
