"""Models for the fx generator's error and output tests (tests/test_fx_speed.py), built on fx_tiny_llama's: one
with a bug in its block's code at a known line (BUG_LINE), and heads that return what Hugging Face and training
scripts return instead of bare logits."""

import torch
import torch.nn.functional as F
from fx_tiny_llama import DTYPES, Block, FeedForward, Transformer
from torch import nn

from dse.spec import ModelSpec, WorkloadSpec


class MisshapedFeedForward(FeedForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.w1(x) * self.w3.weight)  # the bug: w3's weight where w3(x) belongs


BUG_LINE = 15
"""The line of MisshapedFeedForward.forward's bug."""


class MisshapedBlock(Block):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__(m)
        self.feed_forward = MisshapedFeedForward(m)


class WithLoss(Transformer):
    """forward(tokens) -> (logits, loss), as a training script's model returns."""

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(tokens)
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


class AsMapping(Transformer):
    """forward(tokens) -> {"logits": ...}, as a Hugging Face ModelOutput is."""

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": super().forward(tokens)}


class HiddenOnly(Transformer):
    """forward(tokens) -> the last hidden state and the norm's output: no logits at all."""

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rotation)
        return {"hidden": x}


def _built(
    cls: type[Transformer], model: ModelSpec, workload: WorkloadSpec, block: type[nn.Module] = Block
) -> nn.Module:
    return cls(model, workload, block).to(DTYPES[model.dtype])


def misshaped(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return _built(Transformer, model, workload, MisshapedBlock)


def with_loss(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return _built(WithLoss, model, workload)


def as_mapping(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return _built(AsMapping, model, workload)


def hidden_only(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    return _built(HiddenOnly, model, workload)
