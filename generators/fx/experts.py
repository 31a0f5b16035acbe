"""A block's mixture of experts found by its structure, and laid out for expert and tensor parallelism.

Found, not named: the experts are a module holding n identical expert MLPs, either an nn.ModuleList of n modules
with the same parameter shapes (each two or three matrices: up, [gate,] down) or stacked weights [n, ...] (the
reference model's GroupedExperts, Hugging Face Mixtral's fused `gate_up_proj` / `down_proj`); the router is a
matrix [n, hidden] beside them (an nn.Linear to n outputs, or a bare weight as Hugging Face's routers hold); the
MoE is their nearest common ancestor. top_k is read from the routing's own torch.topk, observed while the block
runs once on meta (`generators.fx.routing`), or else from an attribute (`top_k`, `num_experts_per_tok`).

Laid out as `generators.fx.models.moe` is, whose experts `moe_plan` splits over ep and tp (the symbolic generator's
MoE collective for collective). The user's routing code is kept wherever the expert parallel layout allows it:
- stacked experts called with the routing (Hugging Face's `experts(hidden, top_k_index, top_k_weights)`): the
  experts module alone is replaced, by `SlottedExperts` (capacity dispatch, grouped experts, combine); the MoE's
  forward, router, softmax, top-k and normalisation stay the user's, at every degree;
- a ModuleList of experts at tp 1 and ep 1: nothing is replaced; its per-expert loop captures as it is under
  fixed-capacity routing;
- otherwise (a ModuleList under ep or tp): the MoE module is replaced, for the capture only, by the reference
  `MoE` of the same shapes (router [n, hidden], n experts of the same width, top_k). A per-expert loop runs its
  experts one after another, each on its own tokens, so its tokens cannot reach the ranks holding their experts by
  one all-to-all before the first expert runs, as expert parallelism needs; laying the experts out one collective
  each would price E all-to-alls (and E all-gathers under sp) where Megatron and the symbolic generator have one.
  The swap keeps the parameters' shapes, so the GEMMs and the collectives' bytes; it does not keep the router's
  own elementwise code (softmax before or after top-k).
The parameters are counted on the model as built, before any of this.
"""

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from generators.fx.models.moe import GroupedExperts, MoE, TopKRouter, dispatched
from generators.fx.routing import FixedCapacity, Routing, RoutingError, capacity

TOP_K_ATTRIBUTES = ("top_k", "num_experts_per_tok", "topk", "k")


@dataclass(frozen=True)
class Experts:
    """A block's MoE as found: module paths in the block, and the experts' shapes."""

    moe: str
    """The MoE module: the nearest module holding both the experts and the router."""
    experts: str
    router: str
    """The module holding the router's [count, hidden] matrix."""
    count: int
    hidden: int
    width: int
    gated: bool
    """Three matrices per expert (SwiGLU: gate, up, down, the first two possibly fused), else two."""
    stacked: bool
    like: torch.Tensor
    """An expert weight: the dtype and the device (meta) the reference layout is built with."""


def find_experts(block: nn.Module) -> Experts | None:
    """The block's MoE, by structure (see the module docstring); None when it has no experts with a router."""
    modules = dict(block.named_modules())
    for path, module in modules.items():
        found = _expert_matrices(module)
        if found is None:
            continue
        count, matrices, stacked = found
        for moe in _ancestors(path):
            router = _router(modules, moe, path, count, {m for shape in matrices for m in shape})
            if router is not None:
                name, hidden = router
                widths = [a * b // hidden for a, b in matrices]
                if any(a * b % hidden for a, b in matrices) or len(matrices) not in (2, 3):
                    break
                width = min(widths)
                like = next(module.parameters())
                return Experts(moe, path, name, count, hidden, width, sum(widths) == 3 * width, stacked, like)
    return None


def _expert_matrices(module: nn.Module) -> tuple[int, list[tuple[int, int]], bool] | None:
    """(n, one expert's matrix shapes, stacked) when `module` holds n >= 2 identical experts."""
    if isinstance(module, nn.ModuleList) and len(module) >= 2:
        shapes = [[tuple(p.shape) for p in child.parameters() if p.dim() == 2] for child in module]
        if all(s == shapes[0] for s in shapes) and len(shapes[0]) >= 2:
            return len(module), shapes[0], False  # type: ignore[return-value]
        return None
    weights = list(module.parameters(recurse=False))
    matrices = [p for p in weights if p.dim() == 3]
    if len(matrices) >= 2 and len({p.shape[0] for p in matrices}) == 1 and matrices[0].shape[0] >= 2:
        return matrices[0].shape[0], [tuple(p.shape[1:]) for p in matrices], True  # type: ignore[misc]
    return None


def _ancestors(path: str) -> Iterator[str]:
    """The paths enclosing `path`, nearest first ('' the block)."""
    parts = path.split(".")
    for end in range(len(parts) - 1, -1, -1):
        yield ".".join(parts[:end])


def _router(
    modules: dict[str, nn.Module], moe: str, experts: str, count: int, sizes: set[int]
) -> tuple[str, int] | None:
    """(path, hidden) of a module under `moe`, outside the experts, holding a [count, hidden] matrix whose hidden
    is one of the experts' matrices' sizes."""
    prefix = f"{moe}." if moe else ""
    for name, module in modules.items():
        if (name == moe or name.startswith(prefix)) and not (name == experts or name.startswith(f"{experts}.")):
            for p in module.parameters(recurse=False):
                if p.dim() == 2 and p.shape[0] == count and p.shape[1] in sizes:
                    return name, p.shape[1]
    return None


def _takes_routing(module: nn.Module) -> bool:
    """The experts module is called with the routing (hidden, top_k_index, top_k_weights), not with slots."""
    return len(inspect.signature(module.forward).parameters) >= 3


class SlottedExperts(nn.Module):
    """A stacked experts module called with the routing, as the reference layout: (hidden [tokens, h], top_k_index
    [tokens, k], top_k_weights [tokens, k]) -> [tokens, h] by capacity dispatch, GroupedExperts and a combine."""

    def __init__(self, found: Experts, imbalance: float) -> None:
        super().__init__()
        self.count, self.imbalance = found.count, imbalance
        with torch.device(found.like.device):
            self.experts = GroupedExperts(found.count, found.hidden, found.width, found.gated, found.like.dtype)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        slots = capacity(tokens, top_k, self.count, self.imbalance)
        return dispatched(self.experts, self.count, hidden, top_k_weights, top_k_index, slots)


def lay_out_experts(block: nn.Module, args: tuple, kwargs: dict, parallel: bool, imbalance: float) -> Experts | None:
    """The block's MoE made the reference layout where it must be (see the module docstring), for a capture
    `parallel` over tp or ep with experts padded by `imbalance`; what was found (None: no MoE)."""
    found = find_experts(block)
    if found is None:
        return None
    experts = block.get_submodule(found.experts)
    if isinstance(experts, GroupedExperts):
        moe = block.get_submodule(found.moe)
        if isinstance(moe, MoE):  # the reference model: its own capacity factor, padded to the busiest expert
            moe.capacity_factor *= imbalance
    elif found.stacked and _takes_routing(experts):
        block.set_submodule(found.experts, SlottedExperts(found, imbalance))
    elif parallel:
        _refuse_others(block, found)
        top_k = _top_k(block, args, kwargs, found)
        with torch.device(found.like.device):
            gate = nn.Linear(found.hidden, found.count, bias=False, dtype=found.like.dtype)
            grouped = GroupedExperts(found.count, found.hidden, found.width, found.gated, found.like.dtype)
        block.set_submodule(found.moe, MoE.of(TopKRouter(gate, top_k), grouped, imbalance))
    return found


def _refuse_others(block: nn.Module, found: Experts) -> None:
    """The MoE holds nothing but its experts and its router, which the reference layout replaces: anything else
    (shared experts, a norm) would be dropped from the capture."""
    moe = block.get_submodule(found.moe)
    prefix = f"{found.moe}." if found.moe else ""
    kept = [found.experts, found.router]
    for name, _ in moe.named_parameters():
        path = prefix + name
        if not any(path.startswith(f"{k}.") for k in kept):
            raise RoutingError(
                f"the MoE at '{found.moe}' ({type(moe).__name__}) holds '{name}' besides its experts in a ModuleList "
                f"and its router; expert or tensor parallelism lays such a MoE out as generators/fx/models/moe.py's "
                "and cannot keep it: hold the experts as stacked weights called with the routing, or use tp 1 and ep 1"
            )


def user_routing(block: nn.Module, args: tuple, kwargs: dict, imbalance: float) -> Routing | None:
    """The routing of the block's MoE when it runs its own data-dependent code (its experts are not in the reference
    layout: the compile sizes its index ops by it, `routing.compiled_with`), seen while the block runs once on meta;
    None for every other block."""
    found = find_experts(block)
    if found is None or isinstance(block.get_submodule(found.experts), GroupedExperts):
        return None
    routing = _observed(block, args, kwargs, found, imbalance)
    if routing is None:
        raise RoutingError(
            f"the MoE at '{found.moe}' routes without a torch.topk over its {found.count} experts: the capture "
            "cannot size its dispatch (see generators/fx/routing.py)"
        )
    return routing


class _Routed(Exception):
    """Stops the block once its MoE has run."""


def _observed(block: nn.Module, args: tuple, kwargs: dict, found: Experts, imbalance: float) -> Routing | None:
    """The routing of the MoE's own last torch.topk over its experts, seen while the block runs on meta up to the
    MoE's end (None when it calls none, or the block fails on meta first: its capture reports that)."""
    mode = FixedCapacity(imbalance)

    def stop(module: nn.Module, inputs: tuple, output: object) -> None:
        raise _Routed

    hook = block.get_submodule(found.moe).register_forward_hook(stop)
    try:
        with torch.no_grad(), mode:
            block(*args, **kwargs)
    except Exception:  # _Routed, or the block's own failure
        pass
    finally:
        hook.remove()
    return mode.routing if mode.routing is not None and mode.routing.experts == found.count else None


def _top_k(block: nn.Module, args: tuple, kwargs: dict, found: Experts) -> int:
    """The k of the MoE's own torch.topk (`_observed`); else an attribute of the MoE or its router."""
    routing = _observed(block, args, kwargs, found, 1.0)
    if routing is not None:
        return routing.top_k
    moe = block.get_submodule(found.moe)
    for module in (moe, block.get_submodule(found.router)):
        for name in TOP_K_ATTRIBUTES:
            value = getattr(module, name, None)
            if isinstance(value, int) and 0 < value <= found.count:
                return value
    raise RoutingError(
        f"the MoE at '{found.moe}' ({type(moe).__name__}) routes without a torch.topk over its {found.count} "
        f"experts and has no `top_k` attribute: the capture cannot tell how many experts a token goes to"
    )
