"""The mixture-of-experts MLP of `generators.symbolic.dense`: router, dispatch, the experts as grouped GEMMs, combine.

Kept apart from the dense module's other layers because it is the one layer whose sizes depend on routing (the
busiest EP rank's slots, the experts inference reaches) and whose layout changes along the way (the experts split
over ep, the slots regrouped by local expert)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dse.errors import InfeasibleError
from dse.routing import active_experts, busiest_rank_share
from dse.spec import DesignPoint
from generators.symbolic.dist import DUP, PARTIAL, Partition
from generators.symbolic.tensors import SCALED, STensor, make_layout

if TYPE_CHECKING:
    from generators.symbolic.dense import DenseModule

ROUTER_FLOPS = 6.0
"""Per router logit: softmax (exp, sum, divide) and the top-k selection."""


def active_expert_count(point: DesignPoint, copies: float) -> float:
    """The experts the micro-batch's `copies` routed token copies reach: inference's grouped GEMM reads only
    their weights (the copies of one EP group, its ranks' tokens, spread over all e experts). A training step
    counts every expert: its micro-batches reach them all (4096 tokens x top-2 miss none of 256 experts to
    within 1e-13) and its backward differentiates the weights as held, not a view of them."""
    m, p, w = point.model, point.parallel, point.workload
    assert m.moe is not None
    unbalanceable = busiest_rank_share(w.routing.imbalance, p.ep)
    if unbalanceable:
        raise InfeasibleError(unbalanceable)
    if w.mode == "train":
        return m.moe.experts
    return active_experts(m.moe.experts, copies / (p.dp // p.ep) / p.cp)


def regroups_slots(point: DesignPoint) -> bool:
    """Whether a training step's MoE layer regroups its slots by local expert (Megatron's permutation 2): with more
    than one local expert, and slots arriving over ep or gathered over tp under SP. It reads the ep and tp degrees
    as plain numbers, not as the sizes a module trace is recorded over, so recordings are keyed by it
    (`recording.trace_structure`)."""
    m, p = point.model, point.parallel
    if point.workload.mode != "train" or m.moe is None:
        return False
    return m.moe.experts // p.ep > 1 and (p.ep > 1 or (p.tp > 1 and p.sp))


def moe(mod: DenseModule, h2: STensor) -> STensor:
    """Router and top-k, dispatch of each token's k copies to their experts (an all-to-all over ep when the
    experts are split: tokens * hidden * top_k bytes each way), the experts as batched GEMMs over the experts
    that receive tokens (TP splits their width), combine weighted by the gates; shared experts run densely
    beside them. The busiest EP rank is traced (workload.routing): its slots, and so its GEMMs and its
    all-to-all bytes, are the imbalance times the mean's, and the other ranks wait for it at the combine.
    Training regroups the slots by local expert as Megatron does (a copy each way, re-formed in backward)."""
    m, tr = mod.point.model, mod.tracer
    assert m.moe is not None
    x = mod.experts_dim
    # Under SP each TP rank routes its own sequence shard; the dispatched copies go over ep (all-to-all), then
    # are gathered over tp for the TP-split experts (Megatron's all-to-all token dispatcher).
    router = mod.use(mod.param("router", ("h", "e")))
    logits = tr.einsum("router", h2, router, ("b", "s", "e"))
    gates = tr.pointwise("topk_softmax", (logits,), ROUTER_FLOPS)
    routed = tr.relabel("dispatch", h2, (x, "c", "h"), {"b": "c", "s": "c"})
    dispatched_tp = routed.dist("tp")
    expert_layout = {a: routed.dist(a) for a in tr.degrees if a != "ep"} | {"ep": Partition(x)}
    routed = tr.redistribute(routed, expert_layout)
    # Megatron's permutation 2 (sort_chunks_by_idxs), with more than one local expert: slots arriving by source
    # rank (all-to-all, SP gather) copied into expert order and back (DeepEP's serving kernels write them so)
    regrouped = regroups_slots(mod.point)
    if regrouped:
        routed = tr.redistribute(routed, expert_layout | {"tp": DUP})
        routed = tr.pointwise("experts.sort", (routed,), 0.0, linear=True, partials=(SCALED,))
    act = mod.activated("experts.", lambda w: expert_linear(mod, f"experts.{w}", routed, ("h", "r"), (x, "c", "r")))
    out = expert_linear(mod, "experts.w2", act, ("r", "h"), (x, "c", "h"))
    if regrouped:
        out = tr.pointwise("experts.unsort", (out,), 0.0, linear=True, partials=(SCALED,))
    # Back to the tokens' ranks: under SP the experts' partial sums are reduce-scattered over tp to the slots
    # of each rank's sequence shard first, so the all-to-all moves each rank's own tokens only.
    back = {a: out.dist(a) for a in tr.degrees if a != "ep"}
    back["ep"] = Partition("c")
    if "tp" in tr.degrees and isinstance(dispatched_tp, Partition):
        back["tp"] = dispatched_tp
        out = tr.redistribute(out, {a: out.dist(a) for a in tr.degrees if a != "tp"} | {"tp": dispatched_tp})
    out = tr.redistribute(out, back)
    # combine returns each slot to its token: the batch and sequence splits of h2 (dp, ep, cp, SP) come back
    restore = {a: d for a, d in h2.layout if isinstance(d, Partition) and out.dist(a) != PARTIAL}
    y = tr.relabel("combine", out, ("b", "s", "h"), {"c": "b"}, 2.0 * m.moe.top_k, (gates,), overrides=restore)
    if m.moe.shared_experts:
        # the routed output is laid out as the tokens are (sequence-split under SP); the shared experts'
        # tp partial sums come to it (a reduce-scatter under SP, as their row-parallel linear ends in Megatron)
        shared = mod.dense_mlp(h2, "rs", "shared.")
        y = mod.add("moe_sum", y, shared)
    return y


def expert_linear(mod: DenseModule, name: str, x: STensor, dims: tuple[str, str], out_dims: tuple[str, ...]) -> STensor:
    """One of the experts' GEMMs: the weights of every expert the rank holds ([e, dims], split over ep, their
    width r over tp) are what memory holds; the grouped GEMM reads those of the experts that receive tokens,
    a view of them over dimension `experts_dim` (none in training, which reads them all)."""
    held = mod.use(mod.param(name, ("e", *dims), Partition("r"), Partition("e")))
    read = held
    if mod.experts_dim != "e":
        layout = {axis: Partition("a") if d == Partition("e") else d for axis, d in held.layout}
        read = STensor(f"{name}.active", ("a", *dims), make_layout(**layout), held.itemsize, param=True)
        mod.tracer.emitter.same_origin(read, held)
    return mod.tracer.einsum(name, x, read, out_dims)
