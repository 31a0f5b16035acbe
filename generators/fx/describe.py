"""What a model factory's module is, read from the module itself: the ModelSpec fields it has, and its exact
parameter counts.

With the fx generator the model is the source of truth: a point may leave its model fields out (they are filled
from here), and those it gives must agree with the module (`dse.point.described`). Everything is read
from the model built on the meta device (no weights) and one forward of one sequence on meta:

- sizes by structure: the length of the block stack (`block_stack`: `model.layers`, else the ModuleList of
  blocks); the token embedding (the nn.Embedding called on the tokens) gives hidden and vocab, a second embedding
  called outside the blocks learned positions (max_seq its rows), as does a bare [1, positions, hidden] Parameter
  there; the MLP's inner width is the narrowest non-hidden side of its matrices (a fused gate+up is twice it),
  three such matrices a gated MLP, two a plain one; a norm is RMS-style by its class name, else LayerNorm;
- heads and head_dim from the query of the attention call (F.scaled_dot_product_attention, or
  nn.MultiheadAttention's num_heads, or attention written out: a product making [.., heads, s, s] scores, seen
  through a TorchFunctionMode), kv_heads from the attention's matrices (the key may be repeated to every head before the
  call);
- experts by structure (`experts.find_experts`: an nn.ModuleList of identical modules, or parameters stacked
  [n, ...], beside a router [n, hidden]), top_k from the routing's `topk` over n scores during the forward, which
  runs under the capture's fixed-capacity routing (`routing.FixedCapacity`: it records that topk, and sizes a
  data-dependent dispatch so that meta can run it).

Parameters are the module's own sum of numel (a tied table once); active ones count each MoE layer's routed experts
top_k of n. `unexpressed` says where ModelSpec's closed form (dse.modelstats) cannot count the module (a bias on
some projections only, a parallel block): the module's count is then the one reported, with the difference named.
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

import torch
from pydantic import ValidationError
from torch import nn
from torch.overrides import TorchFunctionMode

from dse.errors import SpecError
from dse.modelstats import active_param_count, param_count
from dse.spec import ModelSpec, MoESpec, WorkloadSpec
from generators.fx.disk_cache import model_sources
from generators.fx.experts import Experts, find_experts
from generators.fx.routing import FixedCapacity

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
ACTIVATIONS = {"silu": "swiglu", "gelu": "gelu"}
"""The activation function of a gated MLP (gated: 'glu' in the spec's word) by the name of what it calls."""
SCORES = ("matmul", "__matmul__", "einsum", "bmm")
"""The products that make an attention's scores where the code writes attention out rather than calling SDPA."""


@dataclass(frozen=True)
class Description:
    """A built model's ModelSpec fields (`fields`, moe a mapping) and exact parameter counts."""

    fields: dict[str, Any]
    parameters: int
    active: int
    unexpressed: str | None = None
    """Where ModelSpec's closed-form count (dse.modelstats) differs from the module's, said in words; else None."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Seen:
    """What the meta forward showed: the attention calls' query/key shapes, the module stack at each, the
    activation functions called and the embeddings called with their inputs, and the routing's last top-k."""

    attention: list[tuple[tuple[int, ...], tuple[int, ...], tuple[nn.Module, ...]]] = field(default_factory=list)
    """Each attention call's query and value shapes and the module stack at it."""
    routing: FixedCapacity = field(default_factory=FixedCapacity)
    activations: list[tuple[str, tuple[nn.Module, ...]]] = field(default_factory=list)
    embeddings: list[tuple[nn.Module, Any]] = field(default_factory=list)
    stack: list[nn.Module] = field(default_factory=list)
    inputs: dict[int, Any] = field(default_factory=dict)
    """Each module's first input, by id, in the order the modules were first called."""
    outputs: dict[int, Any] = field(default_factory=dict)


class _Watch(TorchFunctionMode):
    """Records the calls the description needs; the attention call answered by its output's shape alone."""

    def __init__(self, seen: _Seen, seq: int) -> None:
        super().__init__()
        self.seen, self.seq = seen, seq

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        stack = tuple(self.seen.stack)
        if name == "scaled_dot_product_attention":
            q, v = args[0], args[2]
            self.seen.attention.append((tuple(q.shape), tuple(v.shape), stack))
            return q.new_empty((*q.shape[:-1], v.shape[-1]))
        if name == "multi_head_attention_forward":  # nn.MultiheadAttention: its heads an argument, [s, (b,) e]
            query, heads = args[0], args[4]
            shape = (heads, query.shape[0], query.shape[-1] // heads)
            self.seen.attention.append((shape, shape, stack))
        if name in ACTIVATIONS:
            self.seen.activations.append((name, stack))
        out = func(*args, **kwargs)
        if name in SCORES and isinstance(out, torch.Tensor) and out.dim() >= 4 and out.shape[-2:] == (self.seq,) * 2:
            # attention written out (q @ k^T, an einsum): [.., heads, s, s] scores from queries [.., s, head_dim]
            first = next(a for a in args if isinstance(a, torch.Tensor))
            shape = (out.shape[-3], self.seq, first.numel() * out.shape[-1] // out.numel())
            self.seen.attention.append((shape, shape, stack))
        return out


@contextlib.contextmanager
def _watched(model: nn.Module, seen: _Seen, seq: int) -> Iterator[None]:
    """The module stack kept in `seen` and each embedding's call recorded, while the model runs."""

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.stack.append(module)
        first = args[0] if args else next(iter(kwargs.values()), None)  # Hugging Face's hidden_states=...
        seen.inputs.setdefault(id(module), first)
        if isinstance(module, nn.Embedding) and args:
            seen.embeddings.append((module, args[0]))

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        seen.outputs.setdefault(id(module), output[0] if isinstance(output, tuple) and output else output)
        if seen.stack and seen.stack[-1] is module:
            seen.stack.pop()

    hooks = [m.register_forward_pre_hook(enter, with_kwargs=True) for m in model.modules()]
    hooks += [m.register_forward_hook(leave, always_call=True) for m in model.modules()]
    try:
        with _Watch(seen, seq), seen.routing:
            yield
    finally:
        for hook in hooks:
            hook.remove()


def spec_for_factory(given: dict[str, Any]) -> ModelSpec:
    """The ModelSpec a factory is called with: the point's model fields, validated where they are complete; else
    as given (a field the point leaves out is then missing, which a factory that reads it says)."""
    try:
        return ModelSpec.model_validate(given)
    except ValidationError:
        sections = {"moe": MoESpec}
        done = {
            k: sections[k].model_validate(v) if k in sections and isinstance(v, dict) else v for k, v in given.items()
        }
        return ModelSpec.model_construct(**done)


def describe(
    factory: Callable[..., nn.Module], name: str, given: dict[str, Any], workload: WorkloadSpec
) -> tuple[Description, list[str]]:
    """The description of `factory`'s model, called with the point's model fields `given` and a training
    `workload` (run on meta on one sequence), and the source files it comes from (`disk_cache.model_sources`)."""
    try:
        with torch.device("meta"):
            built = factory(spec_for_factory(given), workload)
    except AttributeError as error:
        missing = str(error).rsplit("'", 2)[-2] if "'ModelSpec' object has no attribute" in str(error) else None
        if missing is None:
            raise
        raise SpecError(
            f"field 'model.{missing}': model factory '{name}' reads it and the point leaves it out; give it"
        ) from None
    if not isinstance(built, nn.Module):
        raise SpecError(f"field 'model.fx_factory': '{name}' returned {type(built).__name__}, not a torch.nn.Module")
    layers = block_stack(built)
    if layers is None:
        kind = type(built).__name__
        raise SpecError(
            f"field 'model.fx_factory': '{name}' built a {kind} without an nn.ModuleList of its blocks (blocks of "
            "one class, as `layers` or nanoGPT's `transformer.h`); hold them in one"
        )
    seen, experts = _Seen(), [find_experts(block) for block in layers]
    # the forward runs until the first block with experts (its routing's top_k), or the first block, is done
    last = next((index for index, found in enumerate(experts) if found is not None), 0)
    stop = layers[last].register_forward_hook(_stop)
    # a dispatch meta cannot run: seen is enough
    with _watched(built, seen, workload.seq_len), contextlib.suppress(Exception):
        built(torch.zeros(1, workload.seq_len, dtype=torch.long, device="meta"))
    stop.remove()
    return _description(built, layers, experts, seen, given), model_sources(factory, built)


def block_stack(model: nn.Module) -> nn.ModuleList | None:
    """The model's block stack: its `layers` if that is an nn.ModuleList, else the nn.ModuleList of modules of one
    class holding the most parameters (nanoGPT's `transformer.h`, torch's `nn.TransformerEncoder.layers`); None
    when it has none."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return layers
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1]
    return max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


class _Enough(Exception):
    """Stops the forward once what the description needs has run."""


def _stop(module: nn.Module, args: tuple, output: Any) -> None:
    raise _Enough


def _description(
    built: nn.Module, layers: nn.ModuleList, experts: list[Experts | None], seen: _Seen, given: dict[str, Any]
) -> Description:
    tokens = next(((e, x) for e, x in seen.embeddings if x.dtype == torch.long and x.dim() == 2), None)
    if tokens is None:
        raise SpecError("field 'model.fx_factory': the model's forward called no nn.Embedding on the tokens")
    embedding = tokens[0]
    vocab, hidden = embedding.weight.shape
    inside = {id(m) for m in layers.modules()}
    positions = [e.weight for e, _ in seen.embeddings if e is not embedding and id(e) not in inside]
    positions = positions or _position_tables(built, layers, vocab, hidden)
    fields: dict[str, Any] = {"layers": len(layers), "hidden": hidden, "vocab": vocab}
    fields["dtype"] = DTYPES.get(embedding.weight.dtype, given.get("dtype", "bf16"))
    fields["position"] = "learned" if positions else given.get("position", "rope")
    if positions:
        fields["max_seq"] = positions[0].shape[-2]
    tables = {id(t) for t in (embedding.weight, *positions)}  # the head: a [vocab, hidden] matrix besides
    outside = {id(p) for p in layers.parameters()} | tables
    head = [p for p in built.parameters() if p.shape == (vocab, hidden) and id(p) not in outside]
    fields["tied_embeddings"] = not head
    blocks = [_block(block, found, hidden, seen) for block, found in zip(layers, experts, strict=True)]
    first = blocks[0]
    fields |= first["attention"] | first["layout"] | {"norm": first["norm"], "bias": any(b["bias"] for b in blocks)}
    dense = [b for b in blocks if b["experts"] is None]
    moe = [b for b in blocks if b["experts"] is not None]
    routed_idle = 0
    if dense:
        fields |= {"ffn": dense[0]["ffn"], "activation": dense[0]["activation"]}
    if moe:
        n, top_k = moe[0]["experts"], _top_k(seen, moe[0]["experts"])
        fields.setdefault("activation", moe[0]["activation"])
        leading = next((i for i, b in enumerate(blocks) if b["experts"] is not None), 0)
        fields["moe"] = {"experts": n, "top_k": top_k, "expert_ffn": moe[0]["ffn"]}
        fields["moe"] |= {"shared_experts": moe[0]["shared"], "first_dense_layers": leading}
        routed_idle = sum(b["routed"] * (n - top_k) // n for b in moe)
    fields["family"] = ("deepseek" if fields["moe"]["shared_experts"] else "mixtral") if moe else _dense_family(fields)
    parameters = sum(p.numel() for p in built.parameters())
    active = parameters - routed_idle
    return Description(fields, parameters, active, _unexpressed(given, fields, parameters, active))


def _position_tables(built: nn.Module, layers: nn.ModuleList, vocab: int, hidden: int) -> list[torch.Tensor]:
    """Learned positions held as a bare nn.Parameter outside the blocks, [positions, hidden] or [1, positions,
    hidden] (as ViT's and many a hand-written GPT's), not by an nn.Embedding or an nn.Linear."""
    inside = {id(p) for p in layers.parameters()}
    held = [p for m in built.modules() if not isinstance(m, nn.Embedding | nn.Linear) for p in m.parameters(False)]
    return [
        p
        for p in held
        if id(p) not in inside
        and p.dim() >= 2
        and p.shape[-1] == hidden
        and p.shape[-2] not in (1, vocab)
        and p.numel() == p.shape[-2] * hidden
    ]


def _dense_family(fields: dict[str, Any]) -> str:
    return "llama" if fields.get("activation") == "swiglu" else "gpt"


def _top_k(seen: _Seen, experts: int) -> int:
    routing = seen.routing.routing  # the forward stops after the first MoE block: its routing is the last
    k = routing.top_k if routing is not None and routing.experts == experts else None
    if k is None:
        raise SpecError(
            f"field 'model.moe.top_k': the model has {experts} experts but its forward called no topk over "
            f"{experts} scores; give model.moe.top_k"
        )
    return k


def _matrices(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.dim() >= 2]


def _inner(shapes: list[tuple[int, ...]], hidden: int) -> int:
    """An MLP's inner width: the narrowest side of its matrices that is not the hidden size."""
    return min((side for shape in shapes for side in shape[-2:] if side != hidden), default=hidden)


def _block(block: nn.Module, found: Experts | None, hidden: int, seen: _Seen) -> dict[str, Any]:
    """One block's attention sizes, norm, bias, MLP width and activation, and its experts if it has them."""
    calls = [(q, k) for q, k, stack in seen.attention if block in stack]
    children = [m for m in block.children() if any(True for _ in m.parameters())]
    norms = [m for m in children if is_norm(m)]
    attention = next((m for m in children if any(m in s for _, _, s in seen.attention)), None)
    others = [m for m in children if m not in norms and m is not attention]
    # the MLP: the child whose code calls the activation, else the last; attention done in the block's own
    # forward (no child of its own) is then its other matrices
    mlp = next((m for m in others if any(m in s for _, s in seen.activations)), others[-1] if others else None)
    mixer = [attention] if attention is not None else [m for m in others if m is not mlp]
    out: dict[str, Any] = {"attention": {}, "norm": _norm_kind(norms[0]) if norms else "rmsnorm"}
    latent = None
    if calls:
        q, v = calls[0]
        heads, head_dim = q[-3], q[-1]
        latent = _latent([m for c in mixer for m in c.modules() if isinstance(m, nn.Linear)], hidden, heads, q, v)
        weights = sum(p.numel() for m in mixer for p in _matrices(m))
        kv = (weights // (hidden * head_dim) - 2 * heads) // 2
        out["attention"] = {"heads": heads, "kv_heads": kv if kv > 0 else v[-3]}
        if heads * head_dim != hidden:
            out["attention"]["head_dim"] = head_dim
        if latent is not None:
            out["attention"] = {"heads": heads, "mla": latent}
    linears = [m for c in (*mixer, mlp) if c is not None for m in c.modules() if isinstance(m, nn.Linear)]
    out["layout"] = _layout(attention, mixer, mlp, norms, seen, latent is not None)
    out["bias"] = any(m.bias is not None for m in linears) and "qkv_bias" not in out["layout"]
    activation = next((name for name, stack in seen.activations if mlp is not None and mlp in stack), "silu")
    out["experts"] = None if found is None else found.count
    if found is None:
        shapes = [tuple(p.shape) for p in _matrices(mlp)] if mlp is not None else []
        ffn = _inner(shapes, hidden)
        gated = sum(p.numel() for p in _matrices(mlp)) // (hidden * ffn) >= 3 if mlp is not None else False
        out |= {"ffn": ffn, "activation": _activation(activation, gated)}
        return out
    n, moe = found.count, block.get_submodule(found.moe)
    experts = {id(p) for p in block.get_submodule(found.experts).parameters()}
    routed = sum(p.numel() for p in moe.parameters() if id(p) in experts)
    one = routed // n
    # shared experts: the MoE's other matrices, but the router's [n, hidden]
    shared = sum(p.numel() for p in moe.parameters() if id(p) not in experts and p.dim() >= 2 and n not in p.shape)
    out |= {"ffn": found.width, "activation": _activation(activation, found.gated), "routed": routed}
    out["shared"] = shared // one if one and shared % one == 0 else (1 if shared else 0)
    return out


def _latent(
    linears: list[nn.Linear], hidden: int, heads: int, q: tuple[int, ...], v: tuple[int, ...]
) -> dict[str, int | None] | None:
    """The `model.mla` fields of a latent attention (DeepSeek's MLA), by its projections' shapes, else None: the key
    and value heads come up from a latent (a Linear kv_lora_rank -> heads x (qk_nope_head_dim + v_head_dim)) that a
    Linear makes from the hidden state with the shared RoPE key (hidden -> kv_lora_rank + qk_rope_head_dim), and the
    queries from their own latent (q_lora_rank -> heads x (nope + rope)) or from the hidden state."""
    qk, dv = q[-1], v[-1]
    downs = {m.out_features for m in linears if m.in_features == hidden != m.out_features}
    ups = [m for m in linears if m.in_features != hidden and m.out_features % heads == 0]

    def rope(up: nn.Linear) -> int:  # an up projection's RoPE width, were it the key's and value's
        return qk - (up.out_features // heads - dv)

    # a query up projection (heads x (nope + rope)) could pass for one when v_head_dim == qk_rope_head_dim
    candidates = [m for m in ups if 0 < rope(m) < qk and m.in_features + rope(m) in downs]
    if not candidates:
        return None
    kv_up = min(candidates, key=lambda m: m.out_features == heads * qk)
    nope = qk - rope(kv_up)
    q_up = next((m for m in ups if m is not kv_up and m.out_features == heads * qk and m.in_features in downs), None)
    return {
        "kv_lora_rank": kv_up.in_features,
        "q_lora_rank": None if q_up is None else q_up.in_features,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": qk - nope,
        "v_head_dim": dv,
    }


def _layout(
    attention: nn.Module | None,
    mixer: list[nn.Module],
    mlp: nn.Module | None,
    norms: list[nn.Module],
    seen: _Seen,
    latent: bool = False,
) -> dict[str, Any]:
    """The block's layout fields of ModelSpec that are away from their defaults: biases on the query, key and value
    projections alone (`qkv_bias`), a LayerNorm without bias (`norm_bias`), norms on the query and key heads
    (`qk_norm`; a `latent` attention's norms are its latents'), the attention and the MLP side by side
    (`parallel_block`: the MLP's input does not come from the attention's output)."""
    out: dict[str, Any] = {}
    called = list(seen.inputs)
    projections = sorted(
        (m for c in mixer for m in c.modules() if isinstance(m, nn.Linear) and id(m) in seen.inputs),
        key=lambda m: called.index(id(m)),
    )
    others = [m for m in (mlp.modules() if mlp is not None else ()) if isinstance(m, nn.Linear)]
    qkv, output = projections[:-1], projections[-1:]
    if qkv and all(m.bias is not None for m in qkv) and all(m.bias is None for m in (*output, *others)):
        out["qkv_bias"] = True
    if norms and _norm_kind(norms[0]) == "layernorm" and getattr(norms[0], "bias", None) is None:
        out["norm_bias"] = False
    inner = [m for c in mixer for m in c.modules() if m is not c and is_norm(m)]
    if inner and not latent:
        out["qk_norm"] = True
    if attention is not None and mlp is not None and _side_by_side(seen, attention, mlp):
        out["parallel_block"] = "shared_norm" if len(norms) == 1 else "two_norms"
    return out


def is_norm(module: nn.Module) -> bool:
    """Whether a module is a norm by its weights: it has some, and all are vectors (a LayerNorm's, an RMSNorm's, a
    module wrapping them); an nn.Linear's or an nn.Embedding's are matrices."""
    weights = list(module.parameters())
    return bool(weights) and all(p.dim() == 1 for p in weights)


def _side_by_side(seen: _Seen, attention: nn.Module, mlp: nn.Module) -> bool:
    """Whether the MLP's input was computed without the attention's output (autograd's graph on meta)."""
    source, target = seen.outputs.get(id(attention)), seen.inputs.get(id(mlp))
    if not isinstance(source, torch.Tensor) or not isinstance(target, torch.Tensor):
        return False
    if source.grad_fn is None or target.grad_fn is None:
        return False
    todo, met = [target.grad_fn], set()
    while todo:
        function = todo.pop()
        if function is source.grad_fn:
            return False
        if id(function) not in met:
            met.add(id(function))
            todo += [f for f, _ in function.next_functions if f is not None]
    return True


def _activation(called: str, gated: bool) -> str:
    """The spec's activation word: a gated MLP's 'swiglu' (or 'geglu' where the spec has it), else 'gelu'."""
    if not gated:
        return "gelu"
    word = "geglu" if called == "gelu" else "swiglu"
    return word if word in get_args(ModelSpec.model_fields["activation"].annotation) else "swiglu"


def _norm_kind(module: nn.Module) -> str:
    name = type(module).__name__.lower()
    if "rms" in name:
        return "rmsnorm"
    return "layernorm" if isinstance(module, nn.LayerNorm) or "layernorm" in name else "rmsnorm"


def _unexpressed(given: dict[str, Any], fields: dict[str, Any], parameters: int, active: int) -> str | None:
    """Where ModelSpec's closed-form count of the described model differs from the module's, or None."""
    try:
        spec = ModelSpec.model_validate({"name": "described", **given, **fields})
    except ValidationError as error:
        return f"the ModelSpec fields cannot hold it ({error.errors()[0]['msg']})"
    counted, counted_active = param_count(spec), active_param_count(spec)
    if (counted, counted_active) == (parameters, active):
        return None
    return (
        f"ModelSpec's closed form counts {counted:,} parameters ({counted_active:,} active), the module has "
        f"{parameters:,} ({active:,}): a layout its fields cannot say (a bias on some projections only, a parallel "
        "block, ...)"
    )
