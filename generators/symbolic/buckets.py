"""Data-parallel gradient buckets (`parallel.grad_bucket_mb`): which collectives reduce a pipeline stage's
gradients, and after which modules' backwards each may start.

Without a bucket size each module reduces its own gradients in one collective per kind and group, issued after its
backward (the module's `Traced.sync` block). With one, the gradients are packed as Megatron-LM's DDP packs its
gradient buffer (megatron/core/distributed/param_and_grad_buffer.py): parameters in the order backward makes their
gradients, each appended whole to the open bucket of its collective and group, and a bucket closed once it holds
at least the bucket size; the last, partly filled ones are flushed after the chunk's last backward. A bucket's
collective starts once every module with a gradient in it has finished its backward (Megatron launches a bucket's
reduction when its last parameter's gradient is ready).

Buckets break at parameter boundaries, never inside a parameter, so a module larger than a bucket fills several,
each closed at one of its parameters and all started as the module's backward ends; PyTorch DDP
(`_compute_bucket_assignment_by_size`) closes its buckets the same way. Splitting a module into equal pieces of
the bucket size instead would price collectives neither framework runs. PyTorch DDP's smaller first bucket (1 MiB)
is left out: Megatron, whose gradient reduction this models, has none. Each model chunk of an interleaved or V
schedule has buckets of its own (Megatron wraps each chunk in its own DDP).
"""

from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from dse.workload import BLOCK_INPUT, Block, Call, Op, OpKind, Program
from generators.symbolic.blocks import Traced

MIB = 1024**2
"""A MiB: bucket sizes count as PyTorch DDP's bucket_cap_mb does."""


class Bucket(NamedTuple):
    """One gradient collective of a stage's step and the modules whose backwards it waits for."""

    block: int
    modules: tuple[int, ...]
    """Layer indices (-1 the embedding, -2 the head) of the modules with gradients in the bucket."""


def gradient_buckets(
    chunk: Sequence[tuple[int, Traced]], bucket_mb: float | None, blocks: list[Block], shared: dict[Block, int]
) -> list[Bucket]:
    """The buckets of one model chunk, whose modules come in backward order with their layer indices, in the
    order their collectives are issued when several become ready at once. New bucket blocks are added to
    `blocks`; one equal to a block in `shared` (by content: the layers of a stage fill alike buckets) is reused,
    so that cost models price it once."""
    if bucket_mb is None:
        return [Bucket(traced.sync, (index,)) for index, traced in chunk if traced.sync is not None]
    limit = bucket_mb * MIB
    filling: dict[tuple[str, str], tuple[float, list[int]]] = {}
    """Per collective and group, the open bucket: its bytes and its modules."""
    closed: list[Bucket] = []

    def close(key: tuple[str, str]) -> None:
        size, modules = filling.pop(key)
        category, axis = key
        op = Op(
            f"grad_sync.bucket.{category}", OpKind.COLLECTIVE, category, comm_bytes=size, axis=axis, deps=(BLOCK_INPUT,)
        )
        block = Block("grad_sync.bucket", (op,))
        index = shared.get(block)
        if index is None:
            blocks.append(block)
            index = shared[block] = len(blocks) - 1
        closed.append(Bucket(index, tuple(modules)))

    for index, traced in chunk:
        if traced.sync is None:
            continue
        for piece in traced.grad_pieces:
            key = (piece.category, piece.axis)
            size, modules = filling.get(key, (0.0, []))
            if not modules or modules[-1] != index:
                modules.append(index)
            filling[key] = (size + piece.nbytes, modules)
            if size + piece.nbytes >= limit:
                close(key)
    for key in sorted(filling):
        close(key)
    return closed


class GradientSyncs:
    """When a stage's gradient collectives start, in one walk of its schedule (`walk.walk`): each bucket as
    the backward of the last of its modules ends, for every micro-batch whose backward syncs, or without
    `overlap_grad_reduce` all of them once the stage's whole backward has ended (`issue_deferred`)."""

    def __init__(self, program: Program, buckets: list[Bucket], overlap: bool) -> None:
        self.program = program
        self.buckets = buckets
        self.overlap = overlap
        self.calls: list[int] = []
        """The gradient collectives' calls, which the optimizer step waits for."""
        self.of_module: dict[int, list[int]] = defaultdict(list)
        """Per module, the buckets (places in `buckets`) its gradients are in."""
        for place, bucket in enumerate(buckets):
            for index in bucket.modules:
                self.of_module[index].append(place)
        self.waiting: dict[tuple[int, int], int] = {}
        """Per (bucket, micro-batch) begun, how many of its modules' backwards it still waits for."""
        self.synced: set[tuple[int, int]] = set()
        self.deferred: list[tuple[int, int, int]] = []
        """Without `overlap_grad_reduce`: (bucket block, micro-batch, module) of the collectives issued after the
        backward."""

    def backward_ended(self, after: int, mb: int, index: int) -> None:
        """Module `index`'s backward of micro-batch mb, which syncs, has ended with the call `after` (once per
        module and micro-batch, whichever of its calls reports it): the buckets it completes start."""
        if (index, mb) in self.synced:
            return
        self.synced.add((index, mb))
        for place in self.of_module[index]:
            left = self.waiting.pop((place, mb), len(self.buckets[place].modules)) - 1
            if left:
                self.waiting[(place, mb)] = left
            elif self.overlap:
                self.calls.append(self.program.add(Call(self.buckets[place].block, (after,), index, mb)))
            else:
                self.deferred.append((self.buckets[place].block, mb, index))

    def issue_deferred(self, after: tuple[int, ...]) -> None:
        """Without `overlap_grad_reduce`: every collective, each waiting for `after` (the end of the backward)."""
        self.calls += [self.program.add(Call(block, after, index, mb)) for block, mb, index in self.deferred]
