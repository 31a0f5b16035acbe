"""The MoE of tests/fx_zoo_moe.py routed by boolean masks, as much MoE code routes: each expert's tokens are
`x[mask]` and its output is added back with `out[mask] += ...`, whose sizes depend on the data."""

import fx_zoo_moe
import torch
import torch.nn.functional as F
from torch import nn

from dse.spec import ModelSpec, WorkloadSpec


class MaskedMoE(fx_zoo_moe.SparseMoE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = chosen == e  # [tokens, top_k]: each (token, k) pair routed to expert e
            rows = mask.any(dim=-1)
            out[rows] += expert(x[rows]) * (weights * mask).sum(dim=-1, keepdim=True)[rows]
        return out.view(shape)


def factory(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    built = fx_zoo_moe.factory(model, workload)
    for block in built.layers:
        block.moe = MaskedMoE(model).to(block.moe.gate.weight.dtype)
    return built
