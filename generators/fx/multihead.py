"""torch's nn.MultiheadAttention (nn.TransformerEncoderLayer's and nn.TransformerDecoderLayer's self-attention too)
split over the tensor-parallel ranks by whole heads, as Megatron splits an attention.

The module holds its query, key and value projections as one Parameter, `in_proj_weight` [3 e, e], and calls
`F.multi_head_attention_forward` with it and `out_proj.weight`: no nn.Linear runs, so the plan's dataflow between
Linears (`generators.fx.plans`) does not see it, and that function derives the head size from the query's width,
which a rank's share of the projection cannot change. `MultiheadParallel` gives the module a forward of its own,
the same computation on the rank's heads: the input made a replicated DTensor (all-gathered from its sequence
shard under sp), the rows of its heads' queries, keys and values column-parallel (an even split of the rows,
read as the rank's [q; k; v]: on meta, which holds no values, a relabelling of the rows), the fused
attention (`generators.fx.attention`, the mask an input) on them, the output projection row-parallel with its
partial sums reduced (reduce-scattered over the sequence under sp). Self-attention only (query, key and value the
same tensor, no key_padding_mask), as a decoder's is; other calls are refused in one line.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from dse.errors import SpecError


class MultiheadParallel(ParallelStyle):
    """nn.MultiheadAttention on the rank's heads (the module docstring); `layout` is the hidden state's between
    branches: Shard(1) (the sequence) under sp, else Replicate."""

    def __init__(self, layout: Placement, name: str) -> None:
        super().__init__()
        self.layout, self.name = layout, name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.MultiheadAttention)
        tp = device_mesh.size()
        if module.num_heads % tp or not module._qkv_same_embed_dim:
            raise SpecError(
                f"model.fx_plan: nn.MultiheadAttention '{self.name}' has {module.num_heads} heads (or key and value "
                f"widths of their own), which {tp} tensor-parallel ranks cannot split by whole heads; use a tp that "
                "divides them, or parallel.tp 1"
            )
        rows = [Shard(0)]
        module.in_proj_weight = nn.Parameter(distribute_tensor(module.in_proj_weight.data, device_mesh, rows))
        if module.in_proj_bias is not None:
            module.in_proj_bias = nn.Parameter(distribute_tensor(module.in_proj_bias.data, device_mesh, rows))
        out = module.out_proj
        out.weight = nn.Parameter(distribute_tensor(out.weight.data, device_mesh, [Shard(1)]))
        if out.bias is not None:
            out.bias = nn.Parameter(distribute_tensor(out.bias.data, device_mesh, [Replicate()]))
        layout, name = self.layout, self.name

        def forward(
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            key_padding_mask: torch.Tensor | None = None,
            need_weights: bool = True,
            attn_mask: torch.Tensor | None = None,
            average_attn_weights: bool = True,
            is_causal: bool = False,
        ) -> tuple[torch.Tensor, Any]:
            if not (query is key is value) or key_padding_mask is not None:
                raise SpecError(
                    f"model.fx_plan: nn.MultiheadAttention '{name}' is called as cross-attention or with a "
                    "key_padding_mask, which the fx generator splits over tensor-parallel ranks only as "
                    "self-attention; use parallel.tp 1"
                )
            x = query if module.batch_first else query.transpose(0, 1)  # [batch, seq, e]
            whole = _replicated(x, device_mesh, layout)
            qkv = F.linear(whole, module.in_proj_weight, module.in_proj_bias).to_local()
            b, s = qkv.shape[:2]
            q, k, v = qkv.view(b, s, 3, -1, module.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            mask = attn_mask
            if mask is not None and mask.dim() == 3:  # [batch x heads, s, s]: the rank's heads'
                mask = mask.view(b, -1, s, s).narrow(1, 0, q.shape[1])
            if mask is not None:  # True masks a position out here, SDPA's True keeps it
                mask = ~mask if mask.dtype is torch.bool else mask.to(q.dtype)
            causal = is_causal and mask is None
            y = F.scaled_dot_product_attention(q, k, v, mask, module.dropout if module.training else 0.0, causal)
            y = DTensor.from_local(y.transpose(1, 2).reshape(b, s, -1), device_mesh, [Shard(-1)], run_check=False)
            out_ = F.linear(y, out.weight, out.bias).redistribute(device_mesh, [layout]).to_local()
            return (out_ if module.batch_first else out_.transpose(0, 1)), None

        module.forward = forward
        return module


def _replicated(x: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> DTensor:
    """The hidden state whole on every rank: a DTensor redistributed (all-gathered from its sequence shard)."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()])
    return DTensor.from_local(x, mesh, [layout], run_check=False).redistribute(mesh, [Replicate()])


def multihead_plan(block: nn.Module, layout: Placement) -> dict[str, ParallelStyle]:
    """The block's nn.MultiheadAttention modules, each split by its heads."""
    return {n: MultiheadParallel(layout, n) for n, m in block.named_modules() if isinstance(m, nn.MultiheadAttention)}
