"""TransformerEngine's tensor-parallel communication overlap (userbuffers; Megatron's --tp-comm-overlap, which needs
sequence parallelism) as a rewrite of a traced layer block's ops.

Under SP, each TP all-gather feeds GEMMs (QKV and FC1 in forward, the output projections' dgrad and wgrad in
backward) and each TP reduce-scatter follows a GEMM (the output projections in forward) or the sum of the dgrads
(backward). TE's default methods (transformer_engine/pytorch/module/base.py `initialize_ub`):
- ring exchange for the all-gathers (qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad): tp - 1 steps, each passing
  one rank's chunk to the next rank while the GEMM runs on the chunk already at hand, so the GEMM is split into
  tp chunks, chunk k reading what step k brought (chunk 0 is the rank's own);
- pipeline for a reduce-scatter after a GEMM (proj_fprop, fc2_fprop): the GEMM in tp chunks, each chunk's
  reduce-scatter issued when that chunk is done, the last one exposed;
- bulk for the backward's all-gather of the saved input (qkv_dgrad, fc1_dgrad), beside the dgrad GEMMs, and its
  reduce-scatter of the summed dgrads (qkv_wgrad, fc1_wgrad), beside the wgrad GEMMs, which need not wait for it.
The rewrite states only the chunks and their dependencies; the cost model's list scheduler overlaps them, and
slows the GEMMs that run beside communication by the accelerator's `overlap_slowdown` (the SMs userbuffers
take), as it does for every overlapped collective.
"""

from dataclasses import replace

from dse.workload import BLOCK_INPUT, Block, Collective, Op, OpKind

TP = "tp"
REGATHER = ".regather"
"""The suffix of backward's all-gather of a saved input again (`autodiff.Differentiator.value`)."""


def overlap_tp_comm(block: Block, chunks: int) -> Block:
    """The block with its TP all-gathers and reduce-scatters overlapped as TE runs them, over `chunks` = tp."""
    if chunks < 2:
        return block
    rewrite = _Rewrite(_bulk_reduce_scatters(list(block.ops)), chunks)
    return replace(block, ops=tuple(rewrite.new_ops), output=rewrite.new_index[block.output_index])


def _is_tp(op: Op, collective: Collective) -> bool:
    return op.kind is OpKind.COLLECTIVE and op.axis == TP and op.category == collective.value


def _is_gemm(op: Op) -> bool:
    return op.kind is OpKind.COMPUTE and op.category == "gemm"


def _bulk_reduce_scatters(ops: list[Op]) -> list[Op]:
    """Each TP reduce-scatter that no GEMM produces (backward: the sum of the dgrads) moved ahead of the kernels it
    does not wait for: TE's bulk overlap runs it beside the wgrad GEMMs."""
    for index in range(len(ops)):
        op = ops[index]
        if not _is_tp(op, Collective.REDUCE_SCATTER) or _pipelined(ops, index):
            continue
        ancestors = _ancestors(ops, index)
        # the kernels since the last communication (whose order on its streams, and a p2p's pairing, stays) that it
        # does not wait for: a kernel reading one of those does not either, so the order stays causal
        start = max((i for i in range(index) if ops[i].is_comm), default=-1) + 1
        movable = [i for i in range(start, index) if i not in ancestors]
        if movable:
            ops = _move_after(ops, movable, index)
    return ops


def _pipelined(ops: list[Op], index: int) -> bool:
    """Whether a reduce-scatter reads only the GEMM just before it, which nothing else reads (TE's pipeline
    method)."""
    gemm = index - 1
    if ops[index].deps != (gemm,) or not _is_gemm(ops[gemm]):
        return False
    return all(gemm not in other.deps for i, other in enumerate(ops) if i != index)


def _ancestors(ops: list[Op], index: int) -> set[int]:
    found: set[int] = set()
    stack = [d for d in ops[index].deps if d != BLOCK_INPUT]
    while stack:
        d = stack.pop()
        if d not in found:
            found.add(d)
            stack += [e for e in ops[d].deps if e != BLOCK_INPUT]
    return found


def _move_after(ops: list[Op], movable: list[int], target: int) -> list[Op]:
    """The ops with `movable` (indices before `target`, none an ancestor of it) right after it, deps renumbered."""
    moved = set(movable)
    order = [i for i in range(target + 1) if i not in moved] + movable + list(range(target + 1, len(ops)))
    place = {old: new for new, old in enumerate(order)}
    return [replace(ops[old], deps=tuple(d if d == BLOCK_INPUT else place[d] for d in ops[old].deps)) for old in order]


class _Rewrite:
    """The ops with every TP all-gather feeding GEMMs as a ring exchange and every TP reduce-scatter after a GEMM
    pipelined: `new_ops`, and `new_index` the op standing for each old one (the last of its chunks)."""

    def __init__(self, ops: list[Op], chunks: int) -> None:
        self.ops, self.chunks = ops, chunks
        self.new_ops: list[Op] = []
        self.new_index: dict[int, int] = {}
        consumers: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            for d in op.deps:
                consumers.setdefault(d, []).append(i)
        self.ring = {
            i
            for i, op in enumerate(ops)
            if _is_tp(op, Collective.ALL_GATHER)
            and not op.name.endswith(REGATHER)
            and any(_is_gemm(ops[c]) for c in consumers.get(i, []))
        }
        """All-gathers run as a ring exchange: those feeding GEMMs, but backward's regather of a saved input, which
        TE bulk-overlaps with the dgrad GEMMs (it waits on nothing in the block, so it runs beside them as it is)."""
        self.pipelined = {
            i - 1 for i, op in enumerate(ops) if _is_tp(op, Collective.REDUCE_SCATTER) and _pipelined(ops, i)
        }
        """GEMMs whose output the next op reduce-scatters, and nothing else reads."""
        self.ring_steps: dict[int, list[int]] = {}
        i = 0
        while i < len(ops):
            i = self._emit(i)

    def _deps(self, op: Op) -> tuple[int, ...]:
        return tuple(d if d == BLOCK_INPUT else self.new_index[d] for d in op.deps)

    def _add(self, op: Op) -> int:
        self.new_ops.append(op)
        return len(self.new_ops) - 1

    def _emit(self, i: int) -> int:
        """Emit old op i (and a run of GEMMs after it that read the same ring); the next old op to emit."""
        op, n = self.ops[i], self.chunks
        if i in self.ring:
            # tp - 1 steps of one chunk each: an all-gather of S / (tp - 1) is priced as one chunk S / tp moved
            step = replace(op, name=f"{op.name}.ring", comm_bytes=op.comm_bytes / (n - 1))
            steps = [self._add(replace(step, deps=self._deps(op)))]
            for _ in range(n - 2):
                steps.append(self._add(replace(step, deps=(steps[-1],))))
            self.ring_steps[i] = steps
            self.new_index[i] = steps[-1]
            return i + 1
        rings = [d for d in op.deps if d in self.ring] if _is_gemm(op) else []
        if rings:
            run = [i]
            while run[-1] + 1 < len(self.ops) and self._reads_ring(run[-1] + 1, rings[0]):
                run.append(run[-1] + 1)
            self._ring_gemms(run, rings[0])
            return run[-1] + 1
        if i in self.pipelined:
            self._pipeline(i)
            return i + 2
        self.new_index[i] = self._add(replace(op, deps=self._deps(op)))
        return i + 1

    def _reads_ring(self, j: int, ring: int) -> bool:
        op = self.ops[j]
        return _is_gemm(op) and ring in op.deps and j not in self.pipelined

    def _ring_gemms(self, run: list[int], ring: int) -> None:
        """GEMMs reading a ring-exchanged all-gather, chunk k of each after step k (chunk 0 the rank's own), the
        chunks of consecutive GEMMs interleaved as one GEMM's (TE's fused QKV, FC1)."""
        gather, steps, n = self.ops[ring], self.ring_steps[ring], self.chunks
        for k in range(n):
            for j in run:
                op = self.ops[j]
                others = tuple(d if d == BLOCK_INPUT else self.new_index[d] for d in op.deps if d != ring)
                after = self._deps(gather) if k == 0 else (steps[k - 1],)
                chunk = _chunk(op, n, k, tuple(sorted(set(others + after))))
                self.new_index[j] = self._add(chunk)

    def _pipeline(self, i: int) -> None:
        """A GEMM whose output the next op reduce-scatters: in tp chunks, each chunk's reduce-scatter after it."""
        op, scatter, n = self.ops[i], self.ops[i + 1], self.chunks
        deps = self._deps(op)
        for k in range(n):
            gemm = self._add(_chunk(op, n, k, deps))
            part = replace(scatter, name=f"{scatter.name}.chunk{k}", comm_bytes=scatter.comm_bytes / n)
            self.new_index[i], self.new_index[i + 1] = gemm, self._add(replace(part, deps=(gemm,)))


def _chunk(op: Op, n: int, k: int, deps: tuple[int, ...]) -> Op:
    """Chunk k of n of a GEMM split along its tokens, its rows m in every GEMM TE chunks (each chunk reads the whole
    weight; priced at 1/n of the bytes, which a compute-bound GEMM does not notice): a GEMM of m/n rows, which is
    what measured kernel tables and the tile model read."""
    shape = None if op.gemm is None else (op.gemm[0], op.gemm[1] / n, op.gemm[2], op.gemm[3])
    return replace(
        op,
        name=f"{op.name}.chunk{k}",
        flops=op.flops / n,
        bytes=op.bytes / n,
        out_bytes=op.out_bytes / n,
        gemm=shape,
        deps=deps,
    )
