"""A mixture-of-experts MLP whose routing captures as one static graph: token-choice top-k routing with a fixed
capacity per expert, dispatch and combine by index (gather / scatter), the experts as batched GEMMs.

Why not the usual eager code: Mixtral's reference loops over experts and indexes the tokens each one got
(`torch.where(mask)`), whose sizes depend on the data, which a graph captured on fake tensors cannot hold. Here
every expert has `capacity` token slots, so every shape follows from batch x sequence alone:

- slots: `capacity = ceil(capacity_factor * tokens * top_k / experts)`; tokens take them first choice first
  (Switch Transformer's priority), and a copy beyond its expert's capacity is dropped (it contributes zero and
  its token keeps the residual), as in GShard/Switch.
- dispatch gathers each slot's token (an index op, no FLOPs); combine gathers each token's k expert outputs back
  and sums them weighted by the renormalised top-k gates (Mixtral's softmax over the top-k logits).

With capacity_factor 1 and tokens x top_k a multiple of the experts, the experts' GEMMs are exactly those of the
symbolic generator's MoE (c = b s top_k / e slots per expert: perfectly balanced routing), and the router is the
same h x e GEMM; no one-hot GEMM is used for dispatch, so no FLOPs appear that a GPU MoE does not run. The fx
generator multiplies the capacity factor by workload.routing.imbalance (`generators.fx.experts`), the symbolic one's
padding of the busiest expert's slots. `dispatched` is also what `generators.fx.experts` lays a user's MoE out with.

Module names are torchtitan's (`router.gate`, `experts.w1/w2/w3`, `shared_experts`) and the expert weights keep
nn.Linear's (out, in) layout per expert, so expert- and tensor-parallel plans shard w1/w3 on dim 1 and w2 on dim 2.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dse.spec import ModelSpec
from generators.fx.models.layers import FeedForward, dtype_of, linear
from generators.fx.routing import capacity


class TopKRouter(nn.Module):
    """Scores each token against every expert (one h x e GEMM, `gate`) and keeps its top_k, gates renormalised."""

    def __init__(self, gate: nn.Linear, top_k: int) -> None:
        super().__init__()
        self.top_k, self.gate = top_k, gate

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (gates [tokens, top_k] in x's dtype, expert ids [tokens, top_k])."""
        logits, experts = self.gate(x).topk(self.top_k, dim=-1)
        return F.softmax(logits.float(), dim=-1).type_as(x), experts


class GroupedExperts(nn.Module):
    """`experts` MLPs of width `width`, as stacked weights run by batched GEMMs over [experts, slots, hidden]: SwiGLU
    when `gated` (w1, w3 and w2), else GeLU (w1 and w2)."""

    def __init__(self, experts: int, hidden: int, width: int, gated: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, width, hidden, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, width, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(experts, width, hidden, dtype=dtype)) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.bmm(x, self.w1.transpose(1, 2))
        act = F.gelu(up) if self.w3 is None else F.silu(up) * torch.bmm(x, self.w3.transpose(1, 2))
        return torch.bmm(act, self.w2.transpose(1, 2))


def dispatched(
    experts: nn.Module, count: int, flat: torch.Tensor, gates: torch.Tensor, chosen: torch.Tensor, slots: int
) -> torch.Tensor:
    """The routed tokens through `experts` (slots [count, slots, hidden] -> the same) and combined: flat [tokens,
    hidden], each token's `chosen` experts [tokens, top_k] of `count` weighted by its `gates`, every expert given
    `slots` slots (see the module docstring)."""
    tokens, top_k = chosen.shape
    # choice-major order (every token's first choice, then every second choice) gives first choices priority
    expert_of = chosen.t().reshape(-1)
    token_of = torch.arange(tokens, device=flat.device).repeat(top_k)
    one_hot = (expert_of.unsqueeze(1) == torch.arange(count, device=flat.device)).long()
    position = (one_hot.cumsum(0) * one_hot).sum(1) - 1
    # a copy past its expert's capacity goes to the spare slot count * slots, which nothing reads
    kept = position < slots
    slot = torch.where(kept, expert_of * slots + position, count * slots)
    # An empty slot reads token 0 and a dropped copy slot 0, weighted 0: no output and no gradient sees either,
    # and no padded copy of the tokens or of the experts' output is made (a GPU MoE makes none).
    source = torch.zeros(count * slots + 1, dtype=torch.long, device=flat.device).scatter(0, slot, token_of)
    out = experts(flat[source[:-1]].view(count, slots, -1))
    weights = gates.t().reshape(-1, 1) * kept.unsqueeze(1)
    weighted = out.reshape(count * slots, -1)[torch.where(kept, slot, 0)] * weights.to(out.dtype)
    return weighted.view(top_k, tokens, -1).sum(0)


class MoE(nn.Module):
    """Router, capacity-bounded dispatch, grouped experts, weighted combine; shared experts densely beside them."""

    def __init__(self, m: ModelSpec, capacity_factor: float = 1.0) -> None:
        super().__init__()
        assert m.moe is not None
        e, h, r = m.moe.experts, m.hidden, m.moe.expert_ffn
        router = TopKRouter(linear(m, h, e, bias=False), m.moe.top_k)
        experts = GroupedExperts(e, h, r, m.activation == "swiglu", dtype_of(m))
        shared = m.moe.shared_experts * r
        self._hold(router, experts, FeedForward(m, shared) if shared else None, capacity_factor)

    @classmethod
    def of(cls, router: TopKRouter, experts: GroupedExperts, capacity_factor: float = 1.0) -> "MoE":
        """The MoE of given parts, without shared experts (`generators.fx.experts` builds a user's MoE's layout)."""
        moe = cls.__new__(cls)
        nn.Module.__init__(moe)
        moe._hold(router, experts, None, capacity_factor)
        return moe

    def _hold(
        self, router: TopKRouter, experts: GroupedExperts, shared: nn.Module | None, capacity_factor: float
    ) -> None:
        self.experts_count, self.capacity_factor = experts.w1.shape[0], capacity_factor
        self.router, self.experts, self.shared_experts = router, experts, shared

    def capacity(self, tokens: int) -> int:
        """Token slots per expert for `tokens` tokens."""
        return capacity(tokens, self.router.top_k, self.experts_count, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        gates, chosen = self.router(flat)
        y = dispatched(self.experts, self.experts_count, flat, gates, chosen, self.capacity(flat.shape[0]))
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(shape)


def active_parameter_count(model: nn.Module) -> int:
    """Parameters one token uses: all but the routed experts', of which top_k of `experts` count (modelstats'
    `active_param_count` convention: embedding tables included, a tied table once)."""
    share = {id(moe.experts): moe.router.top_k / moe.experts_count for moe in model.modules() if isinstance(moe, MoE)}
    seen: set[int] = set()
    total = 0.0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * share.get(id(module), 1.0)
    return round(total)
