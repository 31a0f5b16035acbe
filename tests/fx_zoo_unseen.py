"""Decoder models written from scratch in plain torch the way people write them, none shaped like the fx zoo's
(tests/fx_zoo_dense.py, tests/fx_zoo_moe.py): the fx generator's judge of "any PyTorch model" (issue 35). Each
factory has fixed sizes and reads nothing of the spec, as a user's own model would (hidden 128, 4 heads of 32, an
MLP of 512, 2 blocks, a vocabulary of 512, 64 positions):

- `mha`: attention through `nn.MultiheadAttention` (one fused `in_proj_weight` Parameter, not Linears) with a
  causal mask, LayerNorm, a GeLU MLP in an nn.Sequential;
- `torch_encoder`: torch's own `nn.TransformerEncoderLayer` (norm_first, batch_first, GeLU) under
  `nn.TransformerEncoder` with a causal mask, as the PyTorch tutorials build a decoder-only model;
- `einsum`: attention by einsum with a hand-written softmax and a registered causal-mask buffer, as nanoGPT's
  non-flash path: `att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))`;
- `nanogpt`: nanoGPT's model.py (a fused `c_attn`, `c_proj`, a GeLU MLP, learned positions, the head tied by
  `self.transformer.wte.weight = self.lm_head.weight`, blocks at `transformer.h`, forward(idx, targets=None)
  returning (logits, loss));
- `with_loss`: a model returning a dict {'logits', 'loss'} computing its loss when given targets;
- `fused_swiglu`: an RMSNorm written by hand and a SwiGLU whose gate and up are one Linear split by `chunk(2, -1)`;
- `nanogpt_layers`: `nanogpt` with its blocks at `layers` too.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from dse.spec import ModelSpec, WorkloadSpec

HIDDEN, HEADS, FFN, LAYERS, VOCAB, POSITIONS = 128, 4, 512, 2, 512, 64


def causal_mask(t: int, device: torch.device) -> torch.Tensor:
    return torch.triu(torch.full((t, t), float("-inf"), device=device), diagonal=1)


class MHABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = causal_mask(x.shape[1], x.device)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MHAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.zeros(1, POSITIONS, HIDDEN))
        self.layers = nn.ModuleList(MHABlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def mha(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return MHAModel()


class EncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(
            HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        x = self.encoder(self.embed(tokens) * math.sqrt(HIDDEN), mask=mask, is_causal=True)
        return self.head(self.norm(x))


def torch_encoder(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return EncoderLM()


class EinsumAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(3))
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.register_buffer("bias", torch.tril(torch.ones(POSITIONS, POSITIONS)).view(1, 1, POSITIONS, POSITIONS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, HEADS, c // HEADS) for p in (self.q, self.k, self.v))
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(c // HEADS)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = att.exp() / att.exp().sum(-1, keepdim=True)
        y = torch.einsum("bhqk,bkhd->bqhd", att, v)
        return self.o(y.reshape(b, t, c))


class EinsumBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attention = EinsumAttention()
        self.fc_in, self.fc_out = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.fc_out(F.relu(self.fc_in(self.norm2(x))))


class EinsumModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(EinsumBlock() for _ in range(LAYERS))
        self.final = nn.LayerNorm(HIDDEN)
        self.unembed = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens)
        for block in self.layers:
            x = block(x)
        return self.unembed(self.final(x))


def einsum(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return EinsumModel()


class CausalSelfAttention(nn.Module):
    """nanoGPT's, flash path (F.scaled_dot_product_attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)
        self.n_head, self.n_embd = HEADS, HIDDEN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(HIDDEN), CausalSelfAttention()
        self.ln_2, self.mlp = nn.LayerNorm(HIDDEN), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, HIDDEN),
                wpe=nn.Embedding(POSITIONS, HIDDEN),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList([Block() for _ in range(LAYERS)]),
                ln_f=nn.LayerNorm(HIDDEN),
            )
        )
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference-time mini-optimization: only the last position
            loss = None
        return logits, loss


def nanogpt(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return GPT()


class WithLoss(nn.Module):
    """Blocks of nanoGPT's, a forward(input_ids, labels=None) -> {'logits', 'loss'} as trainers expect."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"logits": logits, "loss": loss}


def with_loss(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return WithLoss()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class FusedSwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, HIDDEN))


class SwiGLUBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(HIDDEN), SelfAttention()
        self.mlp_norm, self.mlp = RMSNorm(HIDDEN), FusedSwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class FusedSwiGLUModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(SwiGLUBlock() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def fused_swiglu(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return FusedSwiGLUModel()


def nanogpt_layers(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    """nanoGPT with its blocks also at `layers` (the same ModuleList), for the parts of the fx generator that still
    look for them there."""
    built = GPT()
    built.layers = built.transformer.h
    return built
