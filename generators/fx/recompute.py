"""Activation recomputation of a captured block (`parallel.recompute`), as checkpoint policies over its ATen ops.

The block is captured under `torch.utils.checkpoint`; a selective policy tags each forward op, and torch.compile's
partitioner runs the ops tagged MUST_RECOMPUTE or PREFER_RECOMPUTE again in the backward graph where backward reads
their outputs (and only there: what nothing reads is not recomputed), keeps those tagged MUST_SAVE, and chooses for
those tagged PREFER_SAVE. The policies, as the symbolic generator prices them (`generators.symbolic.tracing`):

- none: only sequence parallelism's regathers (`REGATHERED`): backward gathers the sequence shards again, as
  Megatron's SP does, rather than keep their gathered copies (the partitioner keeps a collective's output rather
  than run it again, unless told);
- selective: Megatron's core-attention recompute: the fused attention and the re-layout of its output for the output
  projection are run again too (the context, which that projection's weight gradient reads, is not kept);
- selective_op: torchtitan's per-op policy (`_save_list` in torchtitan's activation checkpointing): the outputs of
  the matmuls, except every second one, of attention and of the tensor-parallel reduce-scatters are kept, every
  other op is recomputed from them;
- full: the whole block runs again (plain checkpointing).
"""

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from generators.fx.attention import ATTENTION_OP

aten = torch.ops.aten

REGATHERED = {
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
    aten.cat.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
}
"""What a sequence-parallel backward runs again instead of keeping: the all-gathers of the sequence shards (and
the reshuffle of their output), as Megatron's SP does; everything else is kept where the partitioner likes."""

PER_OP_SAVED = {aten.mm.default, ATTENTION_OP, torch.ops._c10d_functional.reduce_scatter_tensor.default}
"""torchtitan's `_save_list`, for the ops a captured block has (its flash and efficient SDPA kernels are our one
attention op)."""


def _regather(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE if op in REGATHERED else CheckpointPolicy.PREFER_SAVE


def _core_attention() -> tuple[Any, Any]:
    """Megatron's policy: the core attention, from the attention op to the output projection's matmul (the context
    laid out again for it, which would otherwise be kept as a copy of the attention output), run again in backward;
    the SP regathers too. Tracked per checkpointed call, the forward and its recomputation apart."""
    inside: dict[bool, bool] = {}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is ATTENTION_OP:
            inside[ctx.is_recompute] = True
        elif op is aten.mm.default:
            inside[ctx.is_recompute] = False
        recomputed = op in REGATHERED or inside.get(ctx.is_recompute, False)
        return CheckpointPolicy.MUST_RECOMPUTE if recomputed else CheckpointPolicy.PREFER_SAVE

    return create_selective_checkpoint_contexts(policy)


def _per_op() -> tuple[Any, Any]:
    """torchtitan's policy, its matmuls counted per checkpointed call (the forward and its recomputation apart)."""
    matmuls: Counter = Counter()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if op is aten.mm.default:
            matmuls[mode] += 1
        saved = op in PER_OP_SAVED and not (op is aten.mm.default and matmuls[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


CONTEXTS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "none": partial(create_selective_checkpoint_contexts, _regather),
    "selective": _core_attention,
    "selective_op": _per_op,
}


def needs_checkpoint(recompute: str, regather: bool) -> bool:
    """Whether a trained block is captured under checkpointing: it recomputes something, or regathers SP shards."""
    return recompute != "none" or regather


class Checkpointed(nn.Module):
    """A block under activation checkpointing with the policy of `recompute` (see the module doc)."""

    def __init__(self, block: nn.Module, recompute: str) -> None:
        super().__init__()
        self.block, self.recompute = block, recompute

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.recompute == "full":
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        context = CONTEXTS[self.recompute]
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=context, **kwargs)
