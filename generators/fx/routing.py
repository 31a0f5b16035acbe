"""Data-dependent routing captured with a fixed capacity per expert, as MoE training frameworks pad their dispatch.

Most MoE code finds each expert's tokens with an index op whose size depends on the routing's values: `idx, k =
torch.where(top_k_index == e)`, `mask.nonzero()`, `x[mask]`. A graph captured on fake (meta) tensors cannot hold
such a size, and the capture failed on it. While a block is captured, `FixedCapacity` makes those ops return a
fixed number of rows (torch's `nonzero_static`), the number a dropless framework pads each expert to:

    capacity = ceil(imbalance x tokens x top_k / experts)

the expert's share of the routed (token, k) pairs, padded by `workload.routing.imbalance`, the busiest expert's
load over the mean: the symbolic generator's slots per expert `c` (generators/symbolic/dense.py), so that the two
generators mean the same by that field.

Which case an op is in is told by its mask's size against the routing the block last ran: the mode records the
tokens, top_k and experts of the latest `torch.topk` (its input [..., experts] and its k), which a token-choice
router calls before it dispatches. A mask of
- `experts` elements is over the experts themselves (which experts got tokens: Hugging Face's `expert_hit`): all
  of them are returned, as a step of many tokens reaches every expert (so a mask of that size is read as this
  case even where tokens or tokens x top_k happen to equal the experts, e.g. decoding as many sequences);
- tokens or tokens x top_k elements selects one expert's (token, k) pairs: `capacity` rows;
- experts x tokens or experts x tokens x top_k elements spans every expert's pairs: tokens x top_k rows (each
  pair is routed once).
Any other mask is refused, naming its shape. Only the capture's tensors (on meta) are sized: real ones, such as
a device mesh's, keep torch's ops. The padding rows index row 0 (a valid token), as the slots of
`generators.fx.models.moe` do; only shapes are captured, never values.

Two mechanisms, one sizing (`Routing`). Eagerly on meta (the model run up to the block, the block run once to
observe its routing), a TorchFunctionMode, `FixedCapacity`: it sees torch's functions and the Tensor methods
(`mask.nonzero()`, `x[mask]`) and records the topk. Under torch.compile(fullgraph=True), `compiled_with`: dynamo
traces a TorchFunctionMode, but not inside higher-order ops (the capture checkpoints every block, and dynamo traces
a checkpointed body with modes off), so for the compile the Python functions themselves are replaced, which
dynamo inlines everywhere, sized by the routing the eager run observed. Boolean-mask indexing (`x[mask]`,
`out[mask] += y`) is sized under compile too, though dynamo does not look up a replaced `Tensor.__getitem__`: the
fake kernel of the ATen index op it records (`meta_index_Tensor`) finds the mask's elements with
`mask.nonzero()`, which is replaced (tests/test_fx_masked_routing.py).
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._dynamo import trace_rules
from torch.overrides import TorchFunctionMode

from dse.errors import DseError

_TOPK = {torch.topk, Tensor.topk}
_NONZERO = {torch.nonzero, Tensor.nonzero, torch.argwhere, Tensor.argwhere}
_WHERE = {torch.where, Tensor.where}
_MASKED = {torch.masked_select, Tensor.masked_select}


class RoutingError(DseError):
    """A data-dependent index op the fixed-capacity routing cannot size."""


def capacity(tokens: int, top_k: int, experts: int, imbalance: float = 1.0) -> int:
    """Slots per expert: the balanced share of the routed (token, k) pairs, padded to the busiest expert's load."""
    return math.ceil(imbalance * tokens * top_k / experts)


@dataclass(frozen=True)
class Routing:
    """A block's routing as its torch.topk showed it, and the sizes of its data-dependent index ops."""

    tokens: int
    top_k: int
    experts: int
    imbalance: float = 1.0

    def rows(self, mask: Tensor) -> int:
        """How many indices a data-dependent op over `mask` returns."""
        tokens, top_k, experts, n = self.tokens, self.top_k, self.experts, mask.numel()
        if n == experts:
            return experts
        if n in (tokens, tokens * top_k):
            return min(n, capacity(tokens, top_k, experts, self.imbalance))
        if n in (tokens * experts, tokens * top_k * experts):
            return tokens * top_k
        raise RoutingError(
            f"a data-dependent index op on a mask of shape {tuple(mask.shape)}, which is neither over the "
            f"{experts} experts, one expert's share of {tokens} tokens x top_k {top_k}, nor every expert's: the "
            "capture cannot size it (see generators/fx/routing.py)"
        )

    def indices(self, mask: Tensor) -> Tensor:
        """[rows, mask.dim()] indices of `mask`'s true elements: all of them for a mask over the experts."""
        rows = self.rows(mask)
        whole = torch.ones_like(mask) if rows == mask.numel() else mask
        return torch.nonzero_static(whole, size=rows, fill_value=0)

    def sized(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`func(*args, **kwargs)`, of a fixed size when it is a data-dependent index op on the capture's tensors."""
        if func in _NONZERO and _on_meta(args[0]):
            found = self.indices(args[0])
            return found.unbind(1) if kwargs.get("as_tuple") else found
        if func in _WHERE and len(args) == 1 and not kwargs and _on_meta(args[0]):
            return self.indices(args[0]).unbind(1)
        if func in _MASKED and _on_meta(mask := args[1] if len(args) > 1 else kwargs["mask"]):
            x = args[0]
            return x.expand(torch.broadcast_shapes(x.shape, mask.shape))[self.indices(mask).unbind(1)]
        if func in (Tensor.__getitem__, Tensor.__setitem__) and _on_meta(args[1], torch.bool):
            args = (args[0], self.indices(args[1]).unbind(1), *args[2:])
        return func(*args, **kwargs)


class FixedCapacity(TorchFunctionMode):
    """Eagerly, on meta: data-dependent index ops return a fixed number of rows (see the module docstring), sized
    by the routing of the last torch.topk, which is kept (`routing`) for the block's compile (`compiled_with`)."""

    def __init__(self, imbalance: float = 1.0) -> None:
        super().__init__()
        self.imbalance = imbalance
        self.routing: Routing | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _TOPK:
            scores, k = args[0], args[1] if len(args) > 1 else kwargs["k"]
            experts = scores.shape[kwargs.get("dim", args[2] if len(args) > 2 else -1)]
            self.routing = Routing(scores.numel() // experts, k, experts, self.imbalance)
            return func(*args, **kwargs)
        if self.routing is None:
            if any(_on_meta(a) for a in args[:2]) and (
                func in _NONZERO | _MASKED or (func in _WHERE and len(args) == 1)
            ):
                raise RoutingError(
                    "a data-dependent index op (nonzero, where, masked_select) before any torch.topk: the capture "
                    "sizes it by the routing's top-k, which this block has not run"
                )
            return func(*args, **kwargs)
        return self.routing.sized(func, args, kwargs)


_PATCHED = ((torch, "nonzero"), (Tensor, "nonzero"), (torch, "argwhere"), (Tensor, "argwhere"), (torch, "where"))
_PATCHED += ((torch, "masked_select"), (Tensor, "masked_select"))


@contextmanager
def compiled_with(routing: Routing) -> Iterator[None]:
    """While a block is compiled: its data-dependent index ops sized by `routing` (observed eagerly by
    FixedCapacity). Dynamo traces a TorchFunctionMode, but not inside higher-order ops such as activation
    checkpointing's, whose bodies it traces with modes off; so the Python functions are replaced instead (dynamo
    inlines them everywhere), without the topk record, a side effect such bodies may not have; boolean-mask
    indexing through the index op's fake kernel, which calls `Tensor.nonzero` (see the module docstring)."""
    # dynamo's tables of torch's functions and Tensor methods are built once, on first use: built while ours stand
    # in for them they would lack torch's own, and every later capture would find those untraceable
    trace_rules.get_torch_obj_rule_map()
    trace_rules.get_tensor_method()
    originals = {(owner, name): getattr(owner, name) for owner, name in _PATCHED}

    def sized(func: Any) -> Any:
        return lambda *args, **kwargs: routing.sized(func, args, kwargs)

    for (owner, name), func in originals.items():
        setattr(owner, name, sized(func))
    try:
        yield
    finally:
        for (owner, name), func in originals.items():
            setattr(owner, name, func)


def _on_meta(mask: Any, dtype: torch.dtype | None = None) -> bool:
    """A tensor of the capture (on meta; of `dtype` when given): real tensors (a device mesh's) keep torch's ops."""
    return isinstance(mask, Tensor) and mask.device.type == "meta" and dtype in (None, mask.dtype)
