"""Reference models for the FX generator: model factories `factory(model, workload) -> nn.Module` whose module
maps tokens [batch, seq] to logits [batch, seq, vocab] and exposes its blocks as `.layers`.

Registered as entry points of the group `dse.fx_models` (`llama`, `moe`, and `hf` for Hugging Face models when
`transformers` is installed); a user's own factory has the same signature. Every factory builds on whatever device
is current, so under `with torch.device("meta")` no weight is allocated, at any scale.

The fx generator captures their blocks (generators/fx/capture.py: its tensor-parallel plan is derived from the
block's structure, generators/fx/plans.py).
"""

from torch import nn

from dse.spec import ModelSpec, WorkloadSpec
from generators.fx.models.transformer import Transformer


def llama(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    """A dense decoder (llama or gpt family): RMSNorm or LayerNorm, RoPE or learned positions, GQA, SwiGLU or GeLU,
    tied or untied embeddings, biases as the spec says; weights in the spec's dtype."""
    if model.moe is not None:
        raise ValueError(f"model '{model.name}' has a model.moe section; use the fx model factory 'moe'")
    return Transformer(model, workload)


def moe(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    """The same decoder with a top-k routed MoE MLP (model.moe) after moe.first_dense_layers dense layers; experts
    have room for exactly their balanced share of tokens (capacity factor 1, see `generators.fx.models.moe`)."""
    if model.moe is None:
        raise ValueError(f"model '{model.name}' has no model.moe section; use the fx model factory 'llama'")
    return Transformer(model, workload)
