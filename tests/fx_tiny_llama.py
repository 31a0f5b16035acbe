"""A minimal LLaMA block stack in plain PyTorch, for the fx generator's tests: the module names torchtitan's TP
plan targets (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3, attention_norm, ffn_norm), GQA, SwiGLU, RMSNorm, SDPA.
Blocks take a per-position table besides their input, as RoPE models pass theirs. `branching` is a model whose
block takes a data-dependent branch, which capture cannot follow; `softcapped` one whose head soft-caps its
logits."""

import torch
import torch.nn.functional as F
from torch import nn

from dse.spec import ModelSpec, WorkloadSpec


class Attention(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.head_dim = m.d_head
        self.wq = nn.Linear(m.hidden, m.heads * m.d_head, bias=False)
        self.wk = nn.Linear(m.hidden, m.n_kv_heads * m.d_head, bias=False)
        self.wv = nn.Linear(m.hidden, m.n_kv_heads * m.d_head, bias=False)
        self.wo = nn.Linear(m.heads * m.d_head, m.hidden, bias=False)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = (t * rotation[:s].to(t.dtype) for t in (q, k))  # a stand-in for RoPE: a per-position table
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.w1 = nn.Linear(m.hidden, m.ffn, bias=False)
        self.w2 = nn.Linear(m.ffn, m.hidden, bias=False)
        self.w3 = nn.Linear(m.hidden, m.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.attention = Attention(m)
        self.feed_forward = FeedForward(m)
        self.attention_norm = nn.RMSNorm(m.hidden)
        self.ffn_norm = nn.RMSNorm(m.hidden)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotation)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, m: ModelSpec, w: WorkloadSpec, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.register_buffer("rotation", torch.ones(w.seq_len, m.d_head), persistent=False)
        self.tok_embeddings = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleList(block(m) for _ in range(m.layers))
        self.norm = nn.RMSNorm(m.hidden)
        self.output = nn.Linear(m.hidden, m.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rotation)
        return self.output(self.norm(x))


class BranchingFeedForward(FeedForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return self.w2(self.w1(x))
        return super().forward(x)


class BranchingBlock(Block):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__(m)
        self.feed_forward = BranchingFeedForward(m)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def llama(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    """Weights in the spec's dtype: a factory's to choose (a model may keep some buffers in another)."""
    return Transformer(model, workload).to(DTYPES[model.dtype])


def branching(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return Transformer(model, workload, BranchingBlock).to(DTYPES[model.dtype])


class SoftCapped(Transformer):
    """A head the symbolic generator does not have: logits soft-capped (Gemma 2's 30 tanh(logits / 30))."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        return 30.0 * torch.tanh(logits / 30.0)


def softcapped(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return SoftCapped(model, workload).to(DTYPES[model.dtype])
