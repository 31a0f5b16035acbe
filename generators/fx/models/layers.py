"""The pieces of a decoder layer as torchtitan's LLaMA writes them (its module names, its tensor layouts), so a
DTensor TP plan written for torchtitan targets these modules unchanged.

Everything here takes its sizes from a `ModelSpec` and nothing from a checkpoint; every module builds on the meta
device (no weights allocated) and keeps no state that depends on the batch, so one model serves every batch size,
but for a decoding model's KV caches (`KVCache`: gpt-fast's, sized for the step's batch and context).
Attention derives its local head count from the tensor it receives (`view(b, s, -1, head_dim)`), which is what
lets `ColwiseParallel` on wq/wk/wv split the heads without the module knowing the TP degree.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from dse.spec import ModelSpec

ROPE_THETA = 500_000.0
"""Llama 3's RoPE base (torchtitan's default); the base changes no shape, FLOP or byte."""
NORM_EPS = 1e-5
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""The dtype a model's weights are built in. fp8 training keeps bf16 weights and casts in its GEMMs (which plain
PyTorch on a CPU cannot express), so fp8 models are built in bf16."""


def dtype_of(m: ModelSpec) -> torch.dtype:
    return TORCH_DTYPES[m.dtype]


def linear(m: ModelSpec, fan_in: int, fan_out: int, bias: bool) -> nn.Linear:
    """nn.Linear built directly in the spec's dtype (a cast afterwards cannot swap tensors under FakeTensorMode)."""
    return nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype_of(m))


def norm(m: ModelSpec) -> nn.Module:
    """The spec's norm: RMSNorm (a weight) or LayerNorm (a weight and a bias), as modelstats counts them."""
    if m.norm == "rmsnorm":
        return nn.RMSNorm(m.hidden, eps=NORM_EPS, dtype=dtype_of(m))
    return nn.LayerNorm(m.hidden, eps=NORM_EPS, dtype=dtype_of(m))


def rope_table(m: ModelSpec, seq_len: int) -> torch.Tensor:
    """RoPE's rotation per position and channel pair, on the current default device (meta under
    `torch.device("meta")`): torchtitan's complex `freqs_cis` [seq, head_dim/2] for rope_impl 'complex', its cos and
    sin [seq, head_dim/2, 2] for 'real'."""
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, m.d_head, 2, dtype=torch.float32) / m.d_head)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    if m.rope_impl == "complex":
        return torch.polar(torch.ones_like(angles), angles)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim] rotated by position: as complex pairs times a complex table (Meta's llama,
    torchtitan), or the same rotation on real pairs by a cos/sin table (no complex dtype in the graph)."""
    seq = x.shape[1]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    if table.is_complex():
        rotated = torch.view_as_real(torch.view_as_complex(pairs) * table[:seq].view(1, seq, 1, -1))
    else:
        cos, sin = (table[:seq, :, i].view(1, seq, 1, -1) for i in (0, 1))
        real, imag = pairs.unbind(-1)
        rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(3).type_as(x)


class KVCache(nn.Module):
    """A decoding layer's keys and values of `batch` sequences of `seq_len` tokens, [batch, seq_len, kv_heads,
    head_dim] each (the symbolic generator's b t g d), as buffers (gpt-fast's KVCache): a captured step has them as
    inputs it updates in place, and a tensor-parallel plan splits their heads as it splits wk's and wv's."""

    def __init__(self, m: ModelSpec, batch: int, seq_len: int) -> None:
        super().__init__()
        shape = (batch, seq_len, m.n_kv_heads, m.d_head)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype_of(m)), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype_of(m)), persistent=False)

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new keys and values [batch, new, heads, head_dim] written at `positions` [new]; the whole cache."""
        self.k.index_copy_(1, positions, k)
        self.v.index_copy_(1, positions, v)
        return self.k, self.v


class Attention(nn.Module):
    """Grouped-query attention: wq/wk/wv/wo projections, RoPE on queries and keys, one fused causal SDPA call; with a
    `cache` (decoding), the new token's keys and values appended to it and its query attending over all of it.

    Keys and values keep their n_kv_heads heads into the kernel (`enable_gqa=True`): the captured graph shows one
    fused attention op and no copies of K/V per query head, as a GPU's FlashAttention runs it."""

    def __init__(self, m: ModelSpec, cache: KVCache | None = None) -> None:
        super().__init__()
        self.head_dim = m.d_head
        self.cache = cache
        self.wq = linear(m, m.hidden, m.heads * m.d_head, m.bias)
        self.wk = linear(m, m.hidden, m.n_kv_heads * m.d_head, m.bias)
        self.wv = linear(m, m.hidden, m.n_kv_heads * m.d_head, m.bias)
        self.wo = linear(m, m.heads * m.d_head, m.hidden, m.bias)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor | None, input_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [batch, seq, hidden]; freqs_cis: the RoPE table from position 0, or from the first new token's when
        decoding (`rope_table`), None for learned positions. The signature is torchtitan's, so its
        PrepareModuleInput layouts for (x, freqs_cis) apply. Decoding, x is one token per sequence at `input_pos`
        [1], the cache's last slot: the cache then holds the step's whole context, which its query sees unmasked."""
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim) for proj in (self.wq, self.wk, self.wv))
        if freqs_cis is not None:
            q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        if self.cache is not None:
            assert input_pos is not None and s == 1, "a decoding layer takes one new token per sequence"
            k, v = self.cache.update(input_pos, k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=self.cache is None,
            scale=1.0 / math.sqrt(self.head_dim),
            enable_gqa=True,
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) or GeLU (w2(gelu(w1 x))) MLP of inner width `width`."""

    def __init__(self, m: ModelSpec, width: int) -> None:
        super().__init__()
        self.w1 = linear(m, m.hidden, width, m.bias)
        self.w2 = linear(m, width, m.hidden, m.bias)
        self.w3 = linear(m, m.hidden, width, m.bias) if m.activation == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
