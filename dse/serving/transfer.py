"""Moving a prompt's KV cache from a prefill instance to a decode instance (a disaggregated deployment's hand-off).

The prefill instance's GPUs hold the prompt's cache split as its layout splits it (heads over tp, layers over pp;
MLA's latent on every tensor-parallel rank); each decode GPU must receive its own share, as the decode layout splits
it. Every GPU sends and receives at once over its own link into the network dimension the two instances meet in,
so the hand-off takes the longer of the two sides:

    seconds(tokens) = latency + tokens x max(unique bytes per token / prefill GPUs, bytes per token per decode GPU)
                                / (link bandwidth x efficiency)

A replicated share (KV heads fewer than tp, the MLA latent) is sent once, split among the GPUs that hold it (NIXL
and Mooncake read it from any holder). The pools are placed so that a node holds instances of both where they fit
(the planner's choice: prefill and decode instances side by side share NVLink): the instances meet in the innermost
dimension that holds a unit of each. The hand-off competes there with the pools' own traffic: where an instance's
collectives cross that dimension too (wide EP across nodes), it gets the share of the link they leave (their busy
share of the instance's step, at its largest iteration). With `kv_transfer: layers` each layer's share moves as
its prefill ends (Splitwise), so the hand-off shows only what outlasts the rest of the prefill, and at least one
layer's share.
"""

from dataclasses import dataclass
from math import prod

from dse.modelstats import layer_kinds
from dse.spec import ModelSpec
from dse.system import SystemSpec


def kv_bytes_per_token(model: ModelSpec, itemsize: float) -> float:
    """The model's KV-cache bytes per token, all layers, each held once: keys and values of every KV head (GQA), or
    MLA's compressed latent and RoPE key. A selective scan keeps a state per sequence, not per token, and adds
    nothing here."""
    per_layer = {
        "attn": 2 * model.n_kv_heads * model.d_head,
        "mla": (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) if model.mla else 0,
        "ssm": 0,
    }
    return itemsize * sum(per_layer[mixer] for mixer, _ in layer_kinds(model))


def meeting_depth(system: SystemSpec, prefill_unit: int, decode_unit: int) -> int:
    """The innermost network dimension (its index) whose block of NPUs holds a prefill unit and a decode unit side
    by side."""
    for depth in range(len(system.network)):
        if prod(d.npus for d in system.network[: depth + 1]) >= prefill_unit + decode_unit:
            return depth
    return len(system.network) - 1


def spans(system: SystemSpec, depth: int, unit: int) -> bool:
    """Whether a unit of `unit` NPUs reaches beyond one block inside dimension `depth`, so that its own collectives
    cross that dimension's links too."""
    return unit > prod(d.npus for d in system.network[:depth])


@dataclass(frozen=True)
class KVLink:
    """The hand-off of one prompt's KV cache between a prefill and a decode instance (see the module docstring)."""

    bandwidth_Bps: float
    """What one GPU sends (or receives) per second over the dimension the instances meet in."""
    latency_s: float
    bytes_per_token: float
    """The larger of a prefill GPU's share to send and a decode GPU's share to receive, per prompt token."""
    layers: int
    """Layers the cache is streamed in under kv_transfer: layers; 0 when it moves whole after the prefill."""
    contention: float = 0.0
    """The share of the link's time the pools' own collectives take (an instance whose collectives cross the same
    dimension: wide EP's all-to-all over the NICs the hand-off uses); the hand-off gets the rest."""

    def seconds(self, tokens: float, prefill_s: float = 0.0) -> float:
        """The hand-off of a prompt of `tokens`, after a prefill of `prefill_s` (which the streamed layers hide
        under: all but the last layer's share, or what outlasts the prefill)."""
        whole = tokens * self.bytes_per_token / (self.bandwidth_Bps * (1.0 - self.contention))
        if self.layers:
            whole = max(whole / self.layers, whole - prefill_s * (self.layers - 1) / self.layers)
        return self.latency_s + whole


def kv_link(
    model: ModelSpec,
    system: SystemSpec,
    cache_itemsize: float,
    prefill_gpus: int,
    decode_bytes_per_token: float,
    depth: int,
    streamed: bool,
    contention: float = 0.0,
) -> KVLink:
    """The KV link of a prefill instance whose prompt's cache lies on `prefill_gpus` GPUs (an attention
    data-parallel rank's tp x pp) and a decode instance whose fullest GPU holds `decode_bytes_per_token` of a
    token's cache, meeting in network dimension `depth` (`meeting_depth`)."""
    dim = system.network[depth]
    unique = kv_bytes_per_token(model, cache_itemsize)
    return KVLink(
        bandwidth_Bps=dim.bandwidth_GBps * 1e9 * dim.efficiency,
        latency_s=dim.latency_ns * 1e-9,
        bytes_per_token=max(unique / prefill_gpus, decode_bytes_per_token),
        layers=model.layers if streamed else 0,
        contention=contention,
    )
