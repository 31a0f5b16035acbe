"""Attention as Tracer ops: fused (flash) or unfused kernels over the keys and values a query split needs, and
ring attention passing key/value chunks around the context-parallel ring beside the compute. The backward of a
fused step is one kernel (`autodiff`); an unfused step's is its own kernels (`unfused_attention_backward`)."""

from collections.abc import Sequence

from dse.workload import AttentionShape
from generators.symbolic.dist import Dist, Partition
from generators.symbolic.graph import Tracer
from generators.symbolic.tape import larger
from generators.symbolic.tensors import Node, STensor

SOFTMAX_FLOPS = 5.0
"""Per score, Megatron's fused scale-mask-softmax: the scaling, the mask, the row maximum, the exponential and the
normalisation (few beside the kernel's HBM traffic, which bounds it)."""
SOFTMAX_BACKWARD_FLOPS = 3.0
"""Per score, softmax's backward y * (dy - sum(y * dy)): a product, the row sum, a difference and a product."""
MERGE_FLOPS = 3.0
"""Per output element, folding one ring step's partial attention into the running output: two rescalings by the
softmax statistics (whose exponentials are per row) and a sum."""


def attend(
    tr: Tracer,
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
    ring = ring if ring in tr.degrees and q.dist(ring) == Partition(q.dims[1]) else None
    kv_target: dict[str, Dist] = {}
    for axis in tr.degrees:
        d = q.dist(axis)
        if isinstance(d, Partition) and d.dim == q.dims[2]:
            kv_target[axis] = Partition(k.dims[2])
        elif isinstance(d, Partition) and d.dim != q.dims[1]:
            kv_target[axis] = d
        elif axis == ring:
            kv_target[axis] = Partition(k.dims[1])
    k2 = tr.redistribute(k, kv_target)
    v2 = tr.redistribute(v, kv_target)
    if ring is not None:
        return _ring_attention(tr, name, q, k2, v2, ring, causal, fused, dropout)
    out, _ = _attention_step(tr, name, q, k2, v2, causal, fused, dropout, value_dim)
    return out


def _ring_attention(
    tr: Tracer, name: str, q: STensor, k: STensor, v: STensor, axis: str, causal: bool, fused: bool, dropout: bool
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
    for j in range(tr.degrees[axis]):
        received = (tr.shift(k, axis, 1), tr.shift(v, axis, 1)) if j + 1 < tr.degrees[axis] else None
        partial, node = _attention_step(tr, f"{name}.step{j}", q, k, v, causal, fused, dropout, off_diagonal=j > 0)
        steps.append(node)
        out = partial if out is None else tr.pointwise(f"{name}.merge{j}", (out, partial), MERGE_FLOPS, linear=True)
        if received is not None:
            k, v = received
    assert out is not None
    for node in steps:
        node.final = out
    return out


def _attention_step(
    tr: Tracer,
    name: str,
    q: STensor,
    k: STensor,
    v: STensor,
    causal: bool,
    fused: bool,
    dropout: bool,
    value_dim: str | None = None,
    off_diagonal: bool = False,
) -> tuple[STensor, Node]:
    """One attention kernel of q over the keys and values as laid out here. off_diagonal: a causal zigzag ring step
    with another rank's chunks, which runs its half of the query x key block as an unmasked kernel (both query
    chunks against one key chunk, or one query chunk against both; the shape says the first)."""
    out_dims = (*q.dims[:3], value_dim or v.dims[3])
    out = STensor(name, out_dims, q.layout, q.itemsize)
    b, sq, n, dq = (tr.local_size(q, dim) for dim in q.dims)
    skv, g, dv = tr.local_size(k, k.dims[1]), tr.local_size(k, k.dims[2]), tr.local_size(out, out_dims[3])
    reads = (q, k) if value_dim else (q, k, v)
    mark = tr.mark
    if fused:
        masked = causal and sq > 1
        density = 0.5 if masked else 1.0
        width = (dq + dv) / 2
        if masked and off_diagonal:
            shape = AttentionShape(sq, skv / 2, width, False, False, b, n, g)
        else:
            shape = AttentionShape(sq, skv, width, masked, False, b, n, g)
        flops = 2 * b * sq * skv * n * (dq + dv)
        tr.compute(name, "attention", flops, reads, (out,), density=density, attention=shape)
        node = Node("attention", name, (q, k, v), out, "attention", density)
    else:
        probs = b * sq * skv * n
        _unfused_attention(tr, name, q, k, v, out, probs, dq, dv, dropout)
        extra = probs * (q.itemsize + (1 + q.itemsize if dropout else 0))
        node = Node("attention", name, (q, k, v), out, "attention", extra_saved=extra, dropout=dropout)
    tr.record(node, mark)
    return out, node


def _unfused_attention(
    tr: Tracer,
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
    last = _matrix_matmul(tr, f"{name}.scores", 2 * probs * dq, matrix, (q, k), (), tr.emitter.deps((q, k)))
    last = tr.kernel(f"{name}.softmax", "elementwise", SOFTMAX_FLOPS * probs, 2 * matrix, matrix, (last,))
    if dropout:
        last = tr.kernel(f"{name}.dropout", "elementwise", 2 * probs, 2 * matrix + probs, matrix + probs, (last,))
    deps = tuple(sorted({last, *tr.emitter.deps((v,))}))
    _matrix_matmul(tr, name, 2 * probs * dv, matrix, (v,), (out,), deps)
    tr.emitter.peak_temp = larger(tr.emitter.peak_temp, 2 * matrix)  # scores and probabilities at once


def _matrix_matmul(
    tr: Tracer,
    name: str,
    flops: float,
    matrix: float,
    reads: Sequence[STensor],
    writes: Sequence[STensor],
    deps: tuple[int, ...],
) -> int:
    """A matmul of unfused attention: it reads `reads` and writes `writes` (tensors of the tape), and writes
    the s x t matrix (`matrix` bytes) when `writes` is empty, else reads it."""
    written = sum(tr.nbytes(t) for t in writes) if writes else matrix
    moved = matrix + sum(tr.nbytes(t) for t in (*reads, *writes))
    return tr.kernel(name, "gemm", flops, moved, written, deps, writes)


def unfused_attention_backward(
    tr: Tracer,
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
    b, sq, n, d_q = (tr.local_size(q, dim) for dim in q.dims)
    probs = b * sq * tr.local_size(k, k.dims[1]) * n
    matrix = probs * q.itemsize
    d_v = tr.local_size(out, out.dims[3])
    deps = tr.emitter.deps
    last = _matrix_matmul(tr, f"{name}.backward.probs", 2 * probs * d_v, matrix, (g, v), (), deps((g, v)))
    _matrix_matmul(tr, f"{name}.backward.values", 2 * probs * d_v, matrix, (g,), (dv,), deps((g, out)))
    if dropout:
        last = tr.kernel(f"{name}.backward.dropout", "elementwise", probs, 2 * matrix + probs, matrix, (last,))
    last = tr.kernel(
        f"{name}.backward.softmax", "elementwise", SOFTMAX_BACKWARD_FLOPS * probs, 3 * matrix, matrix, (last,)
    )
    for part, grad, other in (("queries", dq, k), ("keys", dk, q)):
        deps_after = tuple(sorted({last, *deps((other,))}))
        _matrix_matmul(tr, f"{name}.backward.{part}", 2 * probs * d_q, matrix, (other,), (grad,), deps_after)
    tr.emitter.peak_temp = larger(tr.emitter.peak_temp, 2 * matrix)  # dP and dS at once
