"""Key/value heads replicated over the tensor-parallel ranks when there are fewer of them than ranks.

With tp > kv_heads, column parallelism cannot split the key and value projections by whole heads. Megatron-LM and
torchtitan (and the symbolic generator: its kv-head dimension is max(kv_heads, tp), split over tp) replicate each
key/value head on tp / kv_heads consecutive ranks instead, so that every rank holds one kv head beside its
heads / tp query heads: a rank's wk and wv are the d_head rows of its head, its key and value GEMMs h -> d_head.
`ReplicatedKeyValue` builds that layout: it repeats each head's rows of the weight (and bias) tp / kv_heads times
before sharding them column-wise, so rank r holds head r // (tp / kv_heads). The replicas' weight gradients are
each rank's own, as the symbolic generator has them. `ShardedCache` lays out a decoding layer's KV cache alike:
a rank's cache holds the heads its wk and wv make.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle


class ReplicatedKeyValue(ColwiseParallel):
    """ColwiseParallel for a key or value projection of `kv_heads` heads: whole heads per rank, each head repeated
    on tp / kv_heads ranks when there are more ranks than heads (plain ColwiseParallel otherwise)."""

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        copies = device_mesh.size() // self.kv_heads
        if copies > 1:
            for name, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(_repeated(param, self.kv_heads, copies)))
        return super()._apply(module, device_mesh)


def _repeated(param: torch.Tensor, heads: int, copies: int) -> torch.Tensor:
    """Each head's rows (dim 0 is heads x head_dim) `copies` times in a row."""
    rows = param.detach().reshape(heads, -1, *param.shape[1:])
    return rows.repeat_interleave(copies, dim=0).reshape(-1, *param.shape[1:]).requires_grad_(param.requires_grad)


class ShardedCache(ParallelStyle):
    """A KV cache module's buffers, [batch, seq, kv_heads, head_dim] each, cut to one rank's heads: kv_heads / tp, or
    the one head `ReplicatedKeyValue` gives a rank when the ranks outnumber the heads (the symbolic generator's
    max(kv_heads, tp) heads split over tp). The cache is the rank's own tensor, as an inference engine holds it."""

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        heads = max(self.kv_heads, device_mesh.size()) // device_mesh.size()
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.new_empty((*buffer.shape[:2], heads, *buffer.shape[3:])))
        return module
