"""The decoder stack of a `ModelSpec` in plain PyTorch with torchtitan's LLaMA module names:

    tok_embeddings, [pos_embeddings], layers[i].{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm,
    feed_forward.{w1,w2,w3} | moe.{router.gate, experts.{w1,w2,w3}, shared_experts}}, norm, output

`layers` is an nn.ModuleList of blocks, each called as `block(x, freqs_cis)` (decoding `block(x, freqs_cis,
input_pos)`), so a pipeline split or a per-block FSDP wrap can take the list apart. The layer kinds (dense or MoE
MLP per layer) are modelstats' `layer_kinds`, so the parameter count is the catalog's by construction of the same
formulas, not by a fudge.
"""

import torch
from torch import nn

from dse.errors import SpecError
from dse.modelstats import layer_kinds
from dse.spec import ModelSpec, WorkloadSpec
from generators.fx.models.layers import Attention, FeedForward, KVCache, dtype_of, linear, norm, rope_table
from generators.fx.models.moe import MoE

UNSUPPORTED_MIXERS = {"mla": "latent attention (model.mla)", "ssm": "state-space layers (model.ssm)"}


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + MLP(norm(.)), the MLP dense or MoE."""

    def __init__(self, m: ModelSpec, mlp: str, capacity_factor: float, cache: KVCache | None = None) -> None:
        super().__init__()
        self.attention_norm = norm(m)
        self.attention = Attention(m, cache)
        self.ffn_norm = norm(m)
        self.moe_enabled = mlp == "moe"
        if self.moe_enabled:
            self.moe = MoE(m, capacity_factor)
        else:
            self.feed_forward = FeedForward(m, m.ffn)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor | None, input_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, input_pos)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab]; weights in the spec's dtype, the RoPE table (float32, or
    complex64) for the workload's seq_len. Built for a decode workload, every layer holds a KV cache of its
    micro-batch's sequences at its seq_len (gpt-fast's `setup_caches`), and the forward is gpt-fast's decoding step
    `forward(tokens, input_pos)`."""

    def __init__(self, m: ModelSpec, w: WorkloadSpec, capacity_factor: float = 1.0) -> None:
        super().__init__()
        kinds = layer_kinds(m)
        for mixer, _ in kinds:
            if mixer in UNSUPPORTED_MIXERS:
                raise SpecError(
                    f"field 'model.fx_factory': the reference FX model has no {UNSUPPORTED_MIXERS[mixer]} (model "
                    f"'{m.name}'); use a model factory of your own (Hugging Face's: generators.fx.models.hf:<model "
                    "type>) or generator symbolic"
                )
        self.spec = m
        self.tok_embeddings = nn.Embedding(m.vocab, m.hidden, dtype=dtype_of(m))
        self.pos_embeddings = (
            nn.Embedding(m.max_seq, m.hidden, dtype=dtype_of(m)) if m.position == "learned" and m.max_seq else None
        )
        decode = w.mode == "decode"
        self.layers = nn.ModuleList(
            TransformerBlock(m, mlp, capacity_factor, KVCache(m, w.micro_batch, w.seq_len) if decode else None)
            for _, mlp in kinds
        )
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

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] from position 0; decoding, tokens [batch, 1] at positions `input_pos` [1], whose
        keys and values each layer writes to its cache there (RoPE and learned positions taken at input_pos)."""
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device) if input_pos is None else input_pos
            h = h + self.pos_embeddings(positions)
        freqs_cis = self.freqs_cis if self.freqs_cis is None or input_pos is None else self.freqs_cis[input_pos]
        for layer in self.layers:
            h = layer(h, freqs_cis) if input_pos is None else layer(h, freqs_cis, input_pos)
        return self.output(self.norm(h))
