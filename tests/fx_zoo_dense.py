"""Dense models in plain torch.nn that are not LLaMA-shaped, for the fx generator's tests (factories
`fx_zoo_dense:gpt2` and `fx_zoo_dense:parallel_mqa`, called as factory(model, workload) -> nn.Module with its blocks
at `.layers` and forward(tokens) -> logits). Their module names are their own, which no plan is keyed by:

- `gpt2`: GPT-2 (learned positions, LayerNorm with bias, a fused QKV `attn.c_attn` with bias that the attention
  splits by `self.split_size` and views by `self.n_head`, a GeLU MLP `mlp.c_fc`/`mlp.c_proj` with bias, the output
  head tied to the token embedding);
- `parallel_mqa`: a parallel block (Falcon, PaLM, GPT-J) with multi-query attention: one norm feeding both the
  attention (a fused `query_key_value` of heads + 2 kv heads, split by sizes from its head counts) and a SwiGLU
  MLP, their outputs summed and then added to the residual; a per-position table passed to each block, as RoPE
  models pass theirs.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dse.spec import ModelSpec, WorkloadSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class GPT2Attention(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.n_head, self.head_dim = m.heads, m.d_head
        self.split_size = m.heads * m.d_head
        self.c_attn = nn.Linear(m.hidden, 3 * self.split_size)
        self.c_proj = nn.Linear(self.split_size, m.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        q, k, v = (t.view(b, s, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, self.split_size))


class GPT2MLP(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.c_fc = nn.Linear(m.hidden, m.ffn)
        self.c_proj = nn.Linear(m.ffn, m.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(m.hidden), GPT2Attention(m)
        self.ln_2, self.mlp = nn.LayerNorm(m.hidden), GPT2MLP(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        assert m.max_seq is not None
        self.wte, self.wpe = nn.Embedding(m.vocab, m.hidden), nn.Embedding(m.max_seq, m.hidden)
        self.layers = nn.ModuleList(GPT2Block(m) for _ in range(m.layers))
        self.ln_f = nn.LayerNorm(m.hidden)
        self.lm_head = nn.Linear(m.hidden, m.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class MultiQueryAttention(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = m.heads, m.n_kv_heads, m.d_head
        self.query_key_value = nn.Linear(m.hidden, (m.heads + 2 * m.n_kv_heads) * m.d_head, bias=False)
        self.dense = nn.Linear(m.heads * m.d_head, m.hidden, bias=False)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        sizes = [n * self.head_dim for n in (self.num_heads, self.num_kv_heads, self.num_kv_heads)]
        q, k, v = self.query_key_value(x).split(sizes, dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        q, k = (t * rotation[:s].to(t.dtype) for t in (q, k))  # a stand-in for RoPE: a per-position table
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.dense(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.gate = nn.Linear(m.hidden, m.ffn, bias=False)
        self.up = nn.Linear(m.hidden, m.ffn, bias=False)
        self.down = nn.Linear(m.ffn, m.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class ParallelBlock(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.ln = nn.RMSNorm(m.hidden)
        self.attention, self.mlp = MultiQueryAttention(m), SwiGLU(m)

    def forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return self.attention(h, rotation) + self.mlp(h) + x


class ParallelMQA(nn.Module):
    def __init__(self, m: ModelSpec, w: WorkloadSpec) -> None:
        super().__init__()
        self.register_buffer("rotation", torch.ones(w.seq_len, m.d_head), persistent=False)
        self.embed = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleList(ParallelBlock(m) for _ in range(m.layers))
        self.norm = nn.RMSNorm(m.hidden)
        self.head = nn.Linear(m.hidden, m.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, self.rotation)
        return self.head(self.norm(x))


def gpt2(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return GPT2(model).to(DTYPES[model.dtype])


def parallel_mqa(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return ParallelMQA(model, workload).to(DTYPES[model.dtype])
