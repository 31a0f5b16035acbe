"""A mixture-of-experts decoder as users write it, in plain torch.nn, for the fx generator's tests: its experts an
nn.ModuleList of SwiGLU MLPs, its routing Mixtral's reference loop (softmax, top-k, renormalise, then for each
expert `torch.where` over the top-k indices, its tokens gathered and scattered back with index_add_), whose sizes
depend on the data. Module names are torchtitan's where the dense tensor-parallel plan looks for them (attention,
norms, embeddings, head); the MoE is found by its structure (`moe.gate`, `moe.experts[i].{up,gate,down}`)."""

import torch
import torch.nn.functional as F
from torch import nn

from dse.spec import ModelSpec, WorkloadSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Attention(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.head_dim = m.d_head
        self.wq = nn.Linear(m.hidden, m.heads * m.d_head, bias=False)
        self.wk = nn.Linear(m.hidden, m.n_kv_heads * m.d_head, bias=False)
        self.wv = nn.Linear(m.hidden, m.n_kv_heads * m.d_head, bias=False)
        self.wo = nn.Linear(m.heads * m.d_head, m.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Expert(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, width, bias=False)
        self.gate = nn.Linear(hidden, width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SparseMoE(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        assert m.moe is not None
        self.top_k = m.moe.top_k
        self.gate = nn.Linear(m.hidden, m.moe.experts, bias=False)
        self.experts = nn.ModuleList(Expert(m.hidden, m.moe.expert_ffn) for _ in range(m.moe.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        return self.combine(x, weights, chosen).view(shape)

    def combine(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each token's experts' outputs, weighted: the (token, slot) pairs of each expert found by `torch.where`."""
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class Block(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(m.hidden)
        self.attention = Attention(m)
        self.ffn_norm = nn.RMSNorm(m.hidden)
        self.moe = SparseMoE(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.ffn_norm(h))


class MoETransformer(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleList(Block(m) for _ in range(m.layers))
        self.norm = nn.RMSNorm(m.hidden)
        self.output = nn.Linear(m.hidden, m.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def factory(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    """The spec's MoE decoder, weights in its dtype."""
    return MoETransformer(model).to(DTYPES[model.dtype])
