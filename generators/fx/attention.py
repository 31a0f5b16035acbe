"""Scaled-dot-product attention as one opaque op through capture, as it runs on a GPU.

On the CPU and meta devices PyTorch lowers `F.scaled_dot_product_attention` to its math form (two batched
matmuls and a softmax, the probabilities kept for backward), which is not what a GPU runs: there the flash or
memory-efficient kernel is one kernel forward and one backward, and keeps no s x s matrix. During capture the
function is routed to `dse_fx::attention`, a custom op with its own backward op, so that the graphs hold one fused
attention op each way with its q, k, v shapes. An explicit mask (nn.MultiheadAttention's and nn.Transformer's
`attn_mask`, a causal one built by `generate_square_subsequent_mask` included) is an input of the fused op, not
causal: on a GPU, SDPA runs a masked call as the memory-efficient (or cuDNN) kernel, one fused kernel that reads
the mask and computes every score, whatever the mask's values (which meta does not have). Attention dropout
(Hugging Face GPT-2's default 0.1) is applied inside those kernels, at no pass of its own: the fused op too.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import fake_tensor_tls

_SDPA = F.scaled_dot_product_attention
_DROPOUT = F.dropout


def _expanded(q: Tensor, kv: Tensor) -> Tensor:
    """Grouped-query keys or values repeated to the query heads (the reference computation's GQA)."""
    return kv.repeat_interleave(q.shape[-3] // kv.shape[-3], dim=-3) if kv.shape[-3] != q.shape[-3] else kv


@torch.library.custom_op("dse_fx::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None) -> Tensor:
    return _SDPA(q, _expanded(q, k), _expanded(q, v), mask, is_causal=causal, scale=scale)


@attention.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("dse_fx::attention_backward", mutates_args=())
def attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        keys, values = _expanded(q, leaves[1]), _expanded(q, leaves[2])
        result = _SDPA(leaves[0], keys, values, mask, is_causal=causal, scale=scale)
        dq, dk, dv = torch.autograd.grad(result, leaves, grad)
    return dq, dk, dv


@attention_backward.register_fake
def _attention_backward_fake(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale, mask = inputs
    ctx.save_for_backward(q, k, v, output, mask)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad: Tensor) -> tuple:
    q, k, v, out, mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad, q, k, v, out, ctx.causal, ctx.scale, mask)
    return dq, dk, dv, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)

ATTENTION_OP = torch.ops.dse_fx.attention.default
"""The forward op as checkpoint policies see it (`generators.fx.recompute`)."""


def _fused_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    return attention(query, key, value, is_causal and attn_mask is None, scale, attn_mask)


def _dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    return input if p == 0 or not training else _DROPOUT(input, p, training, inplace)


@contextmanager
def fused_attention() -> Iterator[None]:
    """Route `F.scaled_dot_product_attention` (as model code calls it) to the fused op while capturing.

    A dropout of p 0 (or not training) returns its input, as ATen's does on a GPU (`_dropout_impl`): on meta it
    would run a masking op, which DTensor refuses to take a partial sum through, so a parallel block's branches'
    sum would be reduced before the residual add rather than at it (GPT-NeoX's nn.Dropout, Falcon's
    `dropout_add`).

    And let the fake tensor mode of the compile take the meta tensors that torch makes outside it: indexing a meta
    tensor by a Python list (Falcon's `qkv[:, :, :, [-2]]`) turns the list into an index tensor on the meta device,
    not a fake one, which the mode otherwise refuses ("Please convert all Tensors to FakeTensors first"). Only its
    shape is read, as of every tensor here."""
    F.scaled_dot_product_attention, F.dropout = _fused_sdpa, _dropout
    before, fake_tensor_tls.allow_non_fake_inputs_override = fake_tensor_tls.allow_non_fake_inputs_override, True
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = _SDPA, _DROPOUT
        fake_tensor_tls.allow_non_fake_inputs_override = before
