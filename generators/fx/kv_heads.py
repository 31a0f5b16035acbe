"""Projections split over the tensor-parallel ranks by whole heads, key/value heads replicated when there are fewer
of them than ranks.

With tp > kv_heads, column parallelism cannot split the key and value projections by whole heads. Megatron-LM and
torchtitan (and the symbolic generator: its kv-head dimension is max(kv_heads, tp), split over tp) replicate each
key/value head on tp / kv_heads consecutive ranks instead, so that every rank holds one kv head beside its
heads / tp query heads: a rank's wk and wv are the d_head rows of its head, its key and value GEMMs h -> d_head.
`HeadParallel` builds that layout for a projection whose output rows are groups of heads: a query projection (one
group), a key or value projection (one group of kv heads), a fused QKV ([q heads; kv heads; kv heads], GPT-2's
c_attn, Phi-3's qkv_proj, Falcon's query_key_value): each group's heads are repeated tp / heads times when the
ranks outnumber them, and the rows laid out per rank as [q-shard; k-shard; v-shard] before the even column-wise
split, so rank r holds its heads / tp query heads and its max(kv_heads, tp) / tp key and value heads. The
replicas' weight gradients are each rank's own, as the symbolic generator has them. `ShardedCache` lays out a
decoding layer's KV cache alike: a rank's cache holds the heads its wk and wv make.
"""

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from dse.spec import ModelSpec

SIZE_WORDS = ("embed", "embd", "hidden", "split", "size", "dim")
"""Attribute names that may hold an attention's width (heads x head_dim), scaled to the rank's."""
NOT_ATTENTION_WORDS = ("intermediate", "position", "vocab", "ffn", "inner", "max")


def local_heads(heads: int, tp: int) -> int:
    """A rank's heads of a group of `heads`: heads / tp, or one replicated head when the ranks outnumber them."""
    return max(heads, tp) // tp


class HeadParallel(ColwiseParallel):
    """ColwiseParallel for a projection whose output rows are `groups` of whole heads in order (rows per head: the
    output size over all the heads): whole heads per rank, a group of fewer heads than ranks repeated. One group
    of as many heads as ranks or more is plain ColwiseParallel."""

    def __init__(self, groups: tuple[int, ...]) -> None:
        super().__init__()
        self.groups = groups

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if len(self.groups) > 1 or self.groups[0] < tp:
            for name, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(per_rank(param, self.groups, tp)))
        return super()._apply(module, device_mesh)


def per_rank(param: torch.Tensor, groups: tuple[int, ...], tp: int) -> torch.Tensor:
    """The rows (dim 0: the heads of `groups` one after another) with each group's heads repeated up to tp, laid
    out as tp equal chunks, chunk r holding rank r's heads of each group in turn."""
    rows = param.detach().reshape(sum(groups), -1, *param.shape[1:])
    chunks = []
    for group in rows.split(list(groups)):
        repeated = group.repeat_interleave(max(tp // group.shape[0], 1), dim=0)
        chunks.append(repeated.chunk(tp))
    laid = torch.cat([chunk for rank in zip(*chunks, strict=True) for chunk in rank])
    return laid.reshape(-1, *param.shape[1:]).requires_grad_(param.requires_grad)


class ShardedCache(ParallelStyle):
    """A KV cache module's buffers, [batch, seq, kv_heads, head_dim] each, cut to one rank's heads: kv_heads / tp, or
    the one head `HeadParallel` gives a rank when the ranks outnumber the heads (the symbolic generator's
    max(kv_heads, tp) heads split over tp). The cache is the rank's own tensor, as an inference engine holds it."""

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        heads = local_heads(self.kv_heads, device_mesh.size())
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.new_empty((*buffer.shape[:2], heads, *buffer.shape[3:])))
        return module


@dataclass(frozen=True)
class Heads:
    """The attention's head counts and head size, for splitting by heads."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, spec: ModelSpec) -> "Heads":
        return cls(spec.heads, spec.n_kv_heads, spec.d_head)

    def groups(self, rows: int) -> tuple[int, ...] | None:
        """The head groups a projection of `rows` output rows is made of: q, k or v alone, or a fused QKV."""
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        return {h * d: (h,), kv * d: (kv,), (h + 2 * kv) * d: (h, kv, kv)}.get(rows)


class LocalHeads(HeadParallel):
    """HeadParallel that also sets the attention module's (`owner`) head counts and widths to the rank's, once,
    so the model code's own slicing and views of the projected heads work on the local shard."""

    def __init__(self, groups: tuple[int, ...], owner: nn.Module, heads: Heads, widths: bool = True) -> None:
        """`widths`: whether the owner's attributes measuring heads x head_dim are localised too (`localise`)."""
        super().__init__(groups)
        self.owner, self.heads, self.widths = owner, heads, widths

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.localise_owner(device_mesh.size())
        return super()._apply(module, device_mesh)

    def localise_owner(self, tp: int) -> None:
        if not getattr(self.owner, "_dse_local_heads", False):
            localise(self.owner, self.heads, tp, self.widths)
            self.owner._dse_local_heads = True


def localise(owner: nn.Module, heads: Heads, tp: int, widths: bool = True) -> None:
    """The owner's integer attributes that count heads (named ...head..., not a size) or, with `widths`, measure
    heads x head_dim (named as a width) set to the rank's share; a `config` it holds replaced by a copy so changed.
    Without `widths` (a latent attention, whose per-head widths differ from head_dim and may equal a multiple of
    it by chance) the counts alone."""
    h, kv, d = heads.heads, heads.kv_heads, heads.head_dim
    lh, lkv = local_heads(h, tp), local_heads(kv, tp)
    counts = {h: lh, kv: lkv}
    sizes = {s: local for s, local in ((kv * d, lkv * d), (h * d, lh * d), ((h + 2 * kv) * d, (lh + 2 * lkv) * d))}
    sizes.pop(d, None)
    sizes = sizes if widths else {}

    def scaled(attributes: dict[str, Any]) -> dict[str, int]:
        out = {}
        for name, value in attributes.items():
            if type(value) is not int or any(w in name for w in NOT_ATTENTION_WORDS):
                continue
            width = any(w in name for w in SIZE_WORDS)
            if "head" in name and not width and value in counts:
                out[name] = counts[value]
            elif width and value in sizes:
                out[name] = sizes[value]
        return out

    for name, value in scaled(vars(owner)).items():
        setattr(owner, name, value)
    config = getattr(owner, "config", None)
    if config is not None and not isinstance(config, nn.Module):
        config = copy.copy(config)
        for name, value in scaled(vars(config)).items():
            setattr(config, name, value)
        owner.config = config
