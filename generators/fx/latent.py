"""Tensor parallelism of a latent attention (DeepSeek's MLA), as Megatron-LM's `MLASelfAttention` splits it.

The attention's queries, keys and values come from low-rank latents: down projections from the hidden state (q_a:
h -> q_lora_rank; kv_a: h -> kv_lora_rank + qk_rope_head_dim, the latent and one RoPE key shared by every head),
then per-head up projections from the latents (q_b; kv_b: each head's no-RoPE key and value). Megatron keeps the
down projections whole on every rank (`parallel_mode="duplicated"`), running them on the rank's sequence shard
under sp and all-gathering their outputs, and splits the up projections by heads, column-parallel; the output
projection is row-parallel. The symbolic generator prices it so (`generators.symbolic.dense.latent_attention`):

- forward: each latent all-gathered over the sequence under sp (nothing without sp);
- backward: each latent's gradient, a partial sum over the ranks' heads, reduce-scattered under sp (all-reduced
  without sp) once, the shared RoPE key's (read by every rank's heads in the attention itself, past any Linear)
  with the kv latent's; under sp the normalised latents gathered again for the up projections' weight gradients.

Here (`plans._latent_plan` picks): the kv latent is gathered whole, RoPE key included, at its down projection
(`LatentDown`), since Hugging Face's code splits the key off only after it; its up projection is the rank's rows
(`LocalRows`), which send its input gradient back unreduced for the latent's one reduction. So under sp the kv
latent is gathered before its norm rather than after, and kept gathered rather than gathered again in backward:
kv_lora_rank elements a token fewer all-gathered in backward, and kept, than the symbolic generator counts. The
query latent under sp is Megatron's sequence-parallel pair as it is (replicated down projection and norm on the
shard, a column-parallel up projection gathering its input).

The attention reads its input as a DTensor of the sequence's layout (`latent_input`), so that model code taking
its sizes from it (`hidden_states.shape[:-1]`) sees the whole sequence, as the latents it views are.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

from generators.fx.kv_heads import LocalHeads, per_rank


class LatentDown(ParallelStyle):
    """A down projection: its weights replicated, run on its input as it comes (the rank's sequence shard under
    sp), its output gathered whole and handed on as the rank's local tensor whose gradient is a partial sum,
    reduced (scattered back to the shard under sp) in backward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)

        def gathered(mod: nn.Module, given: tuple, out: DTensor) -> torch.Tensor:
            return out.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))

        module.register_forward_hook(gathered)
        return module


class LocalRows(LocalHeads):
    """An up projection split by heads as a plain Linear of the rank's rows (its heads), not a DTensor one: its
    input, a latent `LatentDown` gathered, is the rank's own tensor, and its input gradient is left the rank's
    partial sum for the latent's one reduction (ColwiseParallel would all-reduce it here too)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        self.localise_owner(tp)
        for name, param in list(module.named_parameters(recurse=False)):
            rows = per_rank(param, self.groups, tp).chunk(tp)[0]
            module.register_parameter(name, nn.Parameter(rows.detach(), requires_grad=param.requires_grad))
        if isinstance(module, nn.Linear):
            module.out_features = module.weight.shape[0]
        return module


def latent_input(style: PrepareModuleInput, layout: Placement) -> PrepareModuleInput:
    """A branch-input style (one making the branch's hidden-state input a replicated DTensor) made to keep the
    input's own layout instead: a DTensor of the whole sequence, sharded as it comes, gathered only as latents."""
    style.desired_input_layouts = (layout,)
    style.desired_input_kwarg_layouts = dict.fromkeys(style.desired_input_kwarg_layouts, layout)
    return style
