"""The layouts the model fields describe beside Llama's and GPT-2's (dse/spec.py: `parallel_block`, `qkv_bias`,
`norm_bias`, `qk_norm`, `activation: geglu`) against plain torch.nn models of them built here: the parameter count
exactly, the symbolic generator's parameters on a rank at tp 2 and its layer's GEMM FLOPs by hand, and the
tensor-parallel collectives of a parallel block (its two branches reduced once)."""

from collections import Counter
from typing import Any

import pytest
from helpers import make_point

from dse.errors import SpecError
from dse.modelstats import param_count
from dse.spec import ModelSpec, ignored_setting
from generators.symbolic import count_parameters
from generators.symbolic.generator import _Builder

torch = pytest.importorskip("torch")
nn = torch.nn

H, HEADS, FFN, VOCAB, SEQ, LAYERS = 64, 4, 256, 512, 128, 2
BASE = {"name": "layout", "family": "gpt", "layers": LAYERS, "hidden": H, "heads": HEADS, "ffn": FFN, "vocab": VOCAB}


def layer_norm(width: int) -> nn.Module:
    return nn.LayerNorm(width)


def weight_only_layer_norm(width: int) -> nn.Module:
    return nn.LayerNorm(width, bias=False)


def rms_norm(width: int) -> nn.Module:
    return nn.RMSNorm(width)


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (kv_heads of them for k and v), each bias as given,
    and optionally a norm over head_dim on each query and key head (Qwen3)."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        d, kv = c["head_dim"], c["kv_heads"]
        self.heads, self.kv, self.d = HEADS, kv, d
        self.q = nn.Linear(H, HEADS * d, bias=c["qkv_bias"])
        self.k = nn.Linear(H, kv * d, bias=c["qkv_bias"])
        self.v = nn.Linear(H, kv * d, bias=c["qkv_bias"])
        self.o = nn.Linear(HEADS * d, H, bias=c["out_bias"])
        self.q_norm = c["norm"](d) if c["qk_norm"] else nn.Identity()
        self.k_norm = c["norm"](d) if c["qk_norm"] else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q(x).view(b, s, self.heads, self.d)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, s, self.kv, self.d)).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv, self.d).transpose(1, 2)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        return self.o(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """GeLU's two matrices, or a gated MLP's three: act(gate(x)) * up(x), act SiLU (SwiGLU) or GeLU (GeGLU)."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.act = nn.SiLU() if c["activation"] == "swiglu" else nn.GELU()
        self.up = nn.Linear(H, FFN, bias=c["mlp_bias"])
        self.gate = nn.Linear(H, FFN, bias=c["mlp_bias"]) if c["activation"] != "gelu" else None
        self.down = nn.Linear(FFN, H, bias=c["mlp_bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.down(self.act(self.up(x)))
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then + mlp(ln2(.)); parallel: x + attn(ln1(x)) + mlp(ln1 or ln2 of x)."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.parallel = c["parallel"]
        self.ln1 = c["norm"](H)
        self.ln2 = None if self.parallel == "shared" else c["norm"](H)
        self.attn, self.mlp = Attention(c), MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is None:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        h1 = self.ln1(x)
        return x + self.attn(h1) + self.mlp(h1 if self.ln2 is None else self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, H)
        self.wpe = nn.Embedding(SEQ, H) if c["learned"] else None
        self.blocks = nn.ModuleList(Block(c) for _ in range(LAYERS))
        self.ln_f = c["norm"](H)
        self.lm_head = nn.Linear(H, VOCAB, bias=False)
        if c["tied"]:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


TORCH = {
    "norm": layer_norm,
    "head_dim": H // HEADS,
    "kv_heads": HEADS,
    "qkv_bias": False,
    "out_bias": False,
    "mlp_bias": False,
    "qk_norm": False,
    "activation": "gelu",
    "parallel": None,
    "learned": False,
    "tied": False,
}
ALL_BIASES = {"qkv_bias": True, "out_bias": True, "mlp_bias": True}
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (the model fields beside BASE, the torch model's choices beside TORCH)
    "gpt2": (
        {"norm": "layernorm", "activation": "gelu", "position": "learned", "max_seq": SEQ, "tied_embeddings": True}
        | {"bias": True},
        {"learned": True, "tied": True, **ALL_BIASES},
    ),
    "nanogpt-no-bias": (
        {"norm": "layernorm", "norm_bias": False, "activation": "gelu", "position": "learned", "max_seq": SEQ}
        | {"tied_embeddings": True},
        {"norm": weight_only_layer_norm, "learned": True, "tied": True},
    ),
    "falcon-parallel-mqa": (
        {"norm": "layernorm", "activation": "gelu", "kv_heads": 1, "parallel_block": "shared_norm"}
        | {"tied_embeddings": True},
        {"kv_heads": 1, "parallel": "shared", "tied": True},
    ),
    "neox-parallel-two-norms": (
        {"norm": "layernorm", "activation": "gelu", "parallel_block": "two_norms", "bias": True},
        {"parallel": "two", **ALL_BIASES},
    ),
    "qwen2-qkv-bias": (
        {"family": "llama", "norm": "rmsnorm", "activation": "swiglu", "kv_heads": 2, "qkv_bias": True},
        {"norm": rms_norm, "activation": "swiglu", "kv_heads": 2, "qkv_bias": True},
    ),
    "qwen3-qk-norm": (
        {"family": "llama", "norm": "rmsnorm", "activation": "swiglu", "kv_heads": 2, "qk_norm": True}
        | {"tied_embeddings": True},
        {"norm": rms_norm, "activation": "swiglu", "kv_heads": 2, "qk_norm": True, "tied": True},
    ),
    "gemma-geglu": (
        {"family": "llama", "norm": "rmsnorm", "activation": "geglu", "kv_heads": 1, "head_dim": 32}
        | {"tied_embeddings": True},
        {"norm": rms_norm, "activation": "geglu", "kv_heads": 1, "head_dim": 32, "tied": True},
    ),
    "swiglu-all-biases": (
        {"family": "llama", "norm": "rmsnorm", "activation": "swiglu", "bias": True},
        {"norm": rms_norm, "activation": "swiglu", **ALL_BIASES},
    ),
}


def spec(name: str) -> ModelSpec:
    return ModelSpec.model_validate(BASE | LAYOUTS[name][0])


def point(name: str, **parallel: Any):
    return make_point(spec(name).model_dump(), seq_len=SEQ, global_batch=8, **parallel)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_parameter_count_is_the_torch_models(name):
    model = Decoder(TORCH | LAYOUTS[name][1])
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, VOCAB)
    built = sum(p.numel() for p in model.parameters())
    assert param_count(spec(name)) == built
    assert count_parameters(point(name, dp=8)) == built


def norm_weights(m: ModelSpec, width: int) -> int:
    return width * (2 if m.norm == "layernorm" and m.norm_bias else 1)


def hand_rank_layer(m: ModelSpec, tp: int) -> int:
    """A layer's parameters on one of tp ranks (Megatron): q and the MLP's inner projections column-parallel (biases
    too), k and v split by kv head (a kv head held whole by each rank it serves when there are fewer than tp), the
    output projections row-parallel, their biases and the norms whole."""
    d, q_out, kv_out = m.d_head, m.heads * m.d_head // tp, max(m.n_kv_heads, tp) // tp * m.d_head
    attention = H * q_out + 2 * H * kv_out + q_out * H
    if m.bias or m.qkv_bias:
        attention += q_out + 2 * kv_out
    inner = FFN // tp * (2 if m.activation != "gelu" else 1)
    mlp = H * inner + FFN // tp * H + (inner if m.bias else 0)
    outputs = 2 * H if m.bias else 0
    norms = norm_weights(m, H) * (1 if m.parallel_block == "shared_norm" else 2)
    return attention + mlp + outputs + norms + (2 * norm_weights(m, d) if m.qk_norm else 0)


def traced_layer(name: str, **parallel: Any) -> tuple[ModelSpec, Any, Any]:
    """The point's model, its built workload and its one layer's trace (a dense model traces one kind)."""
    p = point(name, **parallel)
    builder = _Builder(p)
    workload = builder.build()
    (traced,) = builder.layer_traces.values()
    rank = sum(builder.tracing.tracer.nbytes(w) for w in traced.params) / p.model.dtype_bytes
    return p.model, workload, rank


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_ranks_layer_parameters_and_gemm_flops_at_tp_2_are_the_hand_figures(name):
    m, workload, rank = traced_layer(name, dp=4, tp=2)
    assert rank == hand_rank_layer(m, 2)
    forward = next(b for b in workload.blocks if b.name == "layer.forward")
    gemm = sum(op.flops for op in forward.ops if op.category == "gemm")
    kv = max(m.n_kv_heads, 2) // 2
    projections = H * m.d_head * (HEADS // 2 * 2 + 2 * kv)  # q and o, k and v on the rank
    mlp = (3 if m.activation != "gelu" else 2) * H * FFN // 2
    assert gemm == 2 * SEQ * (projections + mlp)


@pytest.mark.parametrize(
    ("kernels", "expected"), [("fused", {"geglu": 9}), ("eager", {"geglu.gelu": 8, "geglu.mul": 1})]
)
def test_geglu_is_gelu_on_the_gate_times_up(kernels, expected):
    """GeLU's 8 FLOPs an element on the gate and the product's 1: one kernel fused, two eager."""
    p = make_point(
        spec("gemma-geglu").model_dump(), seq_len=SEQ, global_batch=8, overrides={"workload.kernels": kernels}, dp=8
    )
    forward = next(b for b in _Builder(p).build().blocks if b.name == "layer.forward")
    elements = SEQ * FFN
    assert {op.name: op.flops / elements for op in forward.ops if op.name.startswith("geglu")} == expected


def tp_collectives(workload: Any) -> Counter:
    """(forward or backward, collective, bytes) of a layer's TP collectives, counted."""
    found: Counter = Counter()
    for block in workload.blocks:
        if block.name in ("layer.forward", "layer.backward"):
            for op in block.ops:
                if op.kind.value == "collective" and op.axis == "tp":
                    found[(block.name.split(".")[1], op.category, op.comm_bytes)] += 1
    return found


ACTIVATION = SEQ * H * 2
"""Bytes of one sequence's [s, h] activations in bf16: what each TP collective of a layer moves."""
SEQUENTIAL_COLLECTIVES = {
    False: {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 2},
    True: {
        ("forward", "all_gather"): 2,
        ("forward", "reduce_scatter"): 2,
        ("backward", "all_gather"): 4,
        ("backward", "reduce_scatter"): 2,
    },
}
PARALLEL_COLLECTIVES = {
    # (parallel_block, sp): what a layer runs. The branch sum is reduced once (forward); the norm output both
    # branches read is gathered once under sp, and its gradient, the sum of the branches', reduced once. Two norms
    # have two inputs to gather and two gradients to reduce. Backward under sp: the reduction's adjoint (an
    # all-gather of the output gradient) and, per norm output, its regather for the weight gradients.
    ("shared_norm", False): {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 1},
    ("two_norms", False): {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 2},
    ("shared_norm", True): {
        ("forward", "all_gather"): 1,
        ("forward", "reduce_scatter"): 1,
        ("backward", "all_gather"): 2,
        ("backward", "reduce_scatter"): 1,
    },
    ("two_norms", True): {
        ("forward", "all_gather"): 2,
        ("forward", "reduce_scatter"): 1,
        ("backward", "all_gather"): 3,
        ("backward", "reduce_scatter"): 2,
    },
}


@pytest.mark.parametrize(("block", "sp"), sorted(PARALLEL_COLLECTIVES))
def test_a_parallel_block_reduces_its_two_branches_once(block, sp):
    name = "falcon-parallel-mqa" if block == "shared_norm" else "neox-parallel-two-norms"
    _, workload, _ = traced_layer(name, dp=4, tp=2, sp=sp)
    expected = {(*key, float(ACTIVATION)): count for key, count in PARALLEL_COLLECTIVES[block, sp].items()}
    assert tp_collectives(workload) == expected
    _, sequential, _ = traced_layer("gpt2", dp=4, tp=2, sp=sp)
    assert tp_collectives(sequential) == {(*k, float(ACTIVATION)): n for k, n in SEQUENTIAL_COLLECTIVES[sp].items()}


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"parallel_block": "two_norms", "moe": {"experts": 4, "top_k": 1, "expert_ffn": 64}}, "'moe' layers"),
        ({"family": "hybrid", "parallel_block": "shared_norm", "ssm": {"attention_every": 2}}, "'ssm' layers"),
    ],
)
def test_a_parallel_block_beside_experts_or_scans_is_refused_in_one_line(fields, fragment):
    with pytest.raises(ValueError) as refused:
        ModelSpec.model_validate(BASE | {"norm": "layernorm", "activation": "gelu"} | fields)
    assert "parallel_block" in str(refused.value) and fragment in str(refused.value)


@pytest.mark.parametrize(
    ("name", "fields", "fragment"),
    [
        ("gpt2", {"qkv_bias": True}, "model.qkv_bias': True only takes effect with model.bias: false"),
        (
            "qwen2-qkv-bias",
            {"norm_bias": False},
            "model.norm_bias': False only takes effect with model.norm: layernorm",
        ),
    ],
)
def test_a_layout_field_that_says_nothing_is_refused(name, fields, fragment):
    p = point(name, dp=8)
    model = p.model.model_copy(update=fields)
    reason = ignored_setting(p.model_copy(update={"model": model}))
    assert reason is not None and fragment in reason, reason


def test_points_that_leave_the_layout_fields_at_their_defaults_keep_their_keys():
    dumped = make_point("tiny-llama").model.model_dump()
    assert not {"qkv_bias", "norm_bias", "qk_norm", "parallel_block"} & set(dumped)
    with pytest.raises(SpecError):
        make_point("tiny-llama", overrides={"model.parallel_block": "sideways"})
