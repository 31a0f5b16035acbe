"""Activation recomputation of a captured block (`parallel.recompute`), as checkpoint policies over its ATen ops.

The block is captured under `torch.utils.checkpoint`; a selective policy tags each forward op, and torch.compile's
partitioner runs the ops tagged MUST_RECOMPUTE or PREFER_RECOMPUTE again in the backward graph where backward reads
their outputs (and only there: what nothing reads is not recomputed), keeps those tagged MUST_SAVE, and chooses for
those tagged PREFER_SAVE. The policies, as the symbolic generator prices them (`generators.symbolic.tracing`):

- none: what Megatron's layers keep (`_kept`), every trained block being captured under a policy so that the
  partitioner's own choices do not decide it: backward gathers the sequence shards again, as Megatron's SP does,
  rather than keep their gathered copies (`REGATHERED`), forms a gated MLP's silu and the attention output's copy
  for the output projection again (`REFORMED`), and keeps everything else it reads;
- selective: Megatron's core-attention recompute: the fused attention and the re-layout of its output for the output
  projection are run again too (the context, which that projection's weight gradient reads, is not kept);
- selective_op: torchtitan's per-op policy (`_save_list` in torchtitan's activation checkpointing): the outputs of
  the matmuls, except every second one, of attention and of the tensor-parallel reduce-scatters are kept, every
  other op is recomputed from them;
- full: the whole block runs again (plain checkpointing), its last GEMM included (`rerun_whole_forward`).
"""

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import fx, nn
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
the reshuffle of their output), as Megatron's SP does."""

REFORMED = {aten.silu.default, aten.clone.default, aten._unsafe_view.default}
"""What backward forms again rather than keep, besides views (free), as Megatron's kernels do: a gated MLP's silu
(Megatron's fused bias-SwiGLU keeps its input alone) and the attention output's contiguous copy for the output
projection (a flash kernel writes its output in the [batch, seq, heads, dim] layout that projection reads, so
there is one tensor to keep, not two)."""
PER_OP_SAVED = {aten.mm.default, ATTENTION_OP, torch.ops._c10d_functional.reduce_scatter_tensor.default}
"""torchtitan's `_save_list`, for the ops a captured block has (its flash and efficient SDPA kernels are our one
attention op)."""


def _kept(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """What a block keeps without recompute, as Megatron's layers keep it: what backward reads (the norms' outputs,
    the sequence shards SP gathers again, included: left to its own choice the partitioner would recompute those
    norms in backward, ahead of their regathers, which could then no longer start with the backward), except
    `REGATHERED` and `REFORMED`."""
    if op in REGATHERED:
        return CheckpointPolicy.MUST_RECOMPUTE
    reformed = op in REFORMED or getattr(op, "is_view", False)
    return CheckpointPolicy.PREFER_RECOMPUTE if reformed else CheckpointPolicy.MUST_SAVE


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
        if inside.get(ctx.is_recompute, False):
            return CheckpointPolicy.MUST_RECOMPUTE
        return _kept(ctx, op, *args, **kwargs)

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
    "none": partial(create_selective_checkpoint_contexts, _kept),
    "selective": _core_attention,
    "selective_op": _per_op,
}


class Checkpointed(nn.Module):
    """A block under activation checkpointing with the policy of `recompute` (see the module doc)."""

    def __init__(self, block: nn.Module, recompute: str) -> None:
        super().__init__()
        self.block, self.recompute = block, recompute

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The block's output, or its first when it returns a tuple (Falcon's and older Hugging Face blocks'
        `(hidden_states, attention_weights)`): what the next block reads, from which backward starts."""
        if self.recompute == "full":
            out = checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        else:
            context = CONTEXTS[self.recompute]
            out = checkpoint(self.block, *args, use_reentrant=False, context_fn=context, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def rerun_whole_forward(forward: fx.GraphModule, backward: fx.GraphModule) -> None:
    """Full recompute as Megatron runs it (`tensor_parallel.checkpoint`: the layer's forward again from its input,
    then autograd through it) and torchtitan's checkpoint_wrapper eagerly: the block's last GEMM, and under SP the
    reduce-scatter after it and the residual add, run again too, though backward reads none of their outputs. The
    partitioner puts in the backward graph only the forward ops whose outputs backward reads; the others are copied
    into it here, in forward order, after the last op it recomputed. The backward graph's copies of forward nodes
    keep their names (both graphs come from one joint graph), which is how the missing ones are found."""
    graph = backward.graph
    present = {node.name: node for node in graph.nodes}
    ops = [node for node in forward.graph.nodes if node.op == "call_function"]
    missing = [node for node in ops if node.name not in present]
    names = {node.name for node in ops}
    cursor = [node for node in graph.nodes if node.name in names or node.op == "placeholder"][-1]
    for node in missing:  # what they read is recomputed, or a weight or the block input backward has anyway
        with graph.inserting_after(cursor):
            cursor = present[node.name] = graph.node_copy(node, lambda n: present[n.name])
    backward.recompile()
