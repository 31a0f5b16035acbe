"""The decoder stack of a `ModelSpec` in plain PyTorch with torchtitan's LLaMA module names:

    tok_embeddings, [pos_embeddings], layers[i].{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm,
    feed_forward.{w1,w2,w3} | moe.{router.gate, experts.{w1,w2,w3}, shared_experts}}, norm, output

`layers` is an nn.ModuleList of blocks, each called as `block(x, freqs_cis)`, so a pipeline split or a per-block
FSDP wrap can take the list apart. The layer kinds (dense or MoE MLP per layer) are modelstats' `layer_kinds`, so
the parameter count is the catalog's by construction of the same formulas, not by a fudge.
"""

import torch
from torch import nn

from dse.modelstats import layer_kinds
from dse.spec import ModelSpec, WorkloadSpec
from generators.fx.models.layers import Attention, FeedForward, dtype_of, linear, norm, rope_table
from generators.fx.models.moe import MoE

UNSUPPORTED_MIXERS = {"mla": "model.mla (latent attention)", "ssm": "model.ssm (state-space layers)"}


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + MLP(norm(.)), the MLP dense or MoE."""

    def __init__(self, m: ModelSpec, mlp: str, capacity_factor: float) -> None:
        super().__init__()
        self.attention_norm = norm(m)
        self.attention = Attention(m)
        self.ffn_norm = norm(m)
        self.moe_enabled = mlp == "moe"
        if self.moe_enabled:
            self.moe = MoE(m, capacity_factor)
        else:
            self.feed_forward = FeedForward(m, m.ffn)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab]; weights in the spec's dtype, the RoPE table (float32, or
    complex64) for the workload's seq_len."""

    def __init__(self, m: ModelSpec, w: WorkloadSpec, capacity_factor: float = 1.0) -> None:
        super().__init__()
        kinds = layer_kinds(m)
        for mixer, _ in kinds:
            if mixer in UNSUPPORTED_MIXERS:
                raise ValueError(
                    f"model '{m.name}': {UNSUPPORTED_MIXERS[mixer]} has no reference FX model; use the symbolic "
                    "generator or a model factory of your own"
                )
        self.spec = m
        self.tok_embeddings = nn.Embedding(m.vocab, m.hidden, dtype=dtype_of(m))
        self.pos_embeddings = (
            nn.Embedding(m.max_seq, m.hidden, dtype=dtype_of(m)) if m.position == "learned" and m.max_seq else None
        )
        self.layers = nn.ModuleList(TransformerBlock(m, mlp, capacity_factor) for _, mlp in kinds)
        self.norm = norm(m)
        self.output = linear(m, m.hidden, m.vocab, bias=False)
        if m.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        rope = m.position == "rope"
        self.register_buffer("freqs_cis", rope_table(m, w.seq_len) if rope else None, persistent=False)

    def init_buffers(self) -> None:
        """Compute the RoPE table on the model's device: a model built on meta and moved with `to_empty` has the
        right shapes but no values, which capture on fake tensors never reads, but a real run does. (A later
        `model.to(dtype)` casts the table too: call this again after it.)"""
        if self.freqs_cis is not None:
            with torch.device(self.freqs_cis.device):
                self.freqs_cis = rope_table(self.spec, self.freqs_cis.shape[0])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))
