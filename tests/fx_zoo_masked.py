"""The MoE of tests/fx_zoo_moe.py routed by boolean masks, as much MoE code routes: each expert's tokens are
`x[mask]` and its output is added back with `out[mask] += ...`, whose sizes depend on the data."""

import fx_zoo_moe
import torch
from torch import nn

from dse.spec import ModelSpec, WorkloadSpec


class MaskedMoE(fx_zoo_moe.SparseMoE):
    def combine(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = chosen == e  # [tokens, top_k]: each (token, k) pair routed to expert e
            rows = mask.any(dim=-1)
            out[rows] += expert(x[rows]) * (weights * mask).sum(dim=-1, keepdim=True)[rows]
        return out


def factory(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    built = fx_zoo_moe.factory(model, workload)
    for block in built.layers:
        block.moe = MaskedMoE(model).to(block.moe.gate.weight.dtype)
    return built
