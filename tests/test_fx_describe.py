"""The model is the source of truth (issue 35): a factory's model described from the module itself, its counts
by hand; a point that contradicts it refused naming the field and both values; a point that gives only its
factory evaluated with the module's exact parameter count."""

import json

import pytest

pytest.importorskip("torch")

import torch
import torch.nn.functional as F
from fx_tiny_llama import FeedForward, llama
from torch import nn

from dse.cli.main import main
from dse.errors import SpecError
from dse.interfaces import ModelDescription
from dse.modelstats import param_count
from dse.point.described import agree, filled
from dse.spec import ModelSpec, WorkloadSpec
from generators.fx.describe import describe
from generators.fx.factories import resolve

WORKLOAD = WorkloadSpec(seq_len=64, global_batch=1)
TINY = {"name": "t", "family": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128}
TINY |= {"vocab": 512, "norm": "rmsnorm", "activation": "swiglu"}


class GPT2Block(nn.Module):
    """GPT-2's block: fused QKV with biases, LayerNorm, a GeLU MLP of 4 h."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.c_attn, self.c_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(h, -1))
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 512, positions: int = 128):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.layers = nn.ModuleList(GPT2Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def gpt2(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    """A factory of fixed sizes, reading nothing of the spec."""
    return GPT2()


def test_the_tiny_llama_is_described_with_its_counts_by_hand() -> None:
    described, _ = describe(llama, "fx_tiny_llama:llama", TINY, WORKLOAD)
    h, d, heads, kv, f, v = 64, 16, 4, 2, 128, 512
    layer = h * d * (heads + 2 * kv) + heads * d * h + 3 * h * f + 2 * h
    assert described.parameters == described.active == 2 * layer + 2 * v * h + h == 139_584
    assert described.fields == {
        **{k: TINY[k] for k in TINY if k != "name"},
        "dtype": "bf16",
        "bias": False,
        "position": "rope",
        "tied_embeddings": False,
    }
    assert described.unexpressed is None


def test_a_gpt2_style_model_is_described_with_its_counts_by_hand() -> None:
    described, _ = describe(gpt2, "gpt2", {"name": "g"}, WORKLOAD)
    h, v, p = 64, 512, 128
    layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h) + 2 * 2 * h
    assert described.parameters == 2 * layer + v * h + p * h + 2 * h == 141_056  # the head tied: counted once
    fields = described.fields
    assert (fields["layers"], fields["hidden"], fields["heads"], fields["kv_heads"], fields["ffn"]) == (
        2,
        64,
        4,
        4,
        256,
    )
    assert (fields["norm"], fields["activation"], fields["position"], fields["max_seq"]) == (
        "layernorm",
        "gelu",
        "learned",
        128,
    )
    assert fields["tied_embeddings"] and fields["bias"] and fields["family"] == "gpt"
    assert described.unexpressed is None  # ModelSpec's closed form of these fields is the module's count
    spec = ModelSpec.model_validate(filled({"name": "g"}, ModelDescription("gpt2", fields, 0, 0)))
    assert param_count(spec) == described.parameters


class ListMoE(nn.Module):
    """Experts in an nn.ModuleList, routed by the data-dependent loop most MoE code has (`torch.where` per expert,
    which meta cannot run: the description needs only what the forward showed before it)."""

    def __init__(self, hidden: int, experts: int, width: int, top_k: int) -> None:
        super().__init__()
        self.top_k, self.router = top_k, nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(ModelSpec(**{**TINY, "ffn": width})) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            batch, token, slot = torch.where(chosen == index)
            out[batch, token] += weights[batch, token, slot, None] * expert(x[batch, token])
        return out


def list_moe(model: ModelSpec, workload: WorkloadSpec) -> nn.Module:
    built = llama(ModelSpec(**TINY), workload)
    for block in built.layers:
        block.feed_forward = ListMoE(64, experts=4, width=32, top_k=2).to(torch.bfloat16)
    return built


@pytest.mark.parametrize("stacked", [True, False])
def test_a_moe_is_described_with_its_active_parameters_by_hand(stacked) -> None:
    """Stacked experts (the reference `moe` factory: a dense first layer, then [n, ...] weights) and a ModuleList
    of experts routed by a data-dependent loop: experts, top_k, widths and active counts by hand."""
    h, attention, norms, e, k = 64, 64 * 16 * 8 + 4 * 16 * 64, 2 * 64, 4, 2
    if stacked:
        moe = {"experts": e, "top_k": k, "expert_ffn": 96, "shared_experts": 0, "first_dense_layers": 1}
        given = {**TINY, "family": "mixtral", "layers": 3, "moe": moe}
        described, _ = describe(resolve("moe"), "moe", given, WORKLOAD)
        expert, dense = 3 * h * 96, attention + 3 * h * 128 + norms
        layers = dense + 2 * (attention + h * e + e * expert + norms)
    else:
        moe = {"experts": e, "top_k": k, "expert_ffn": 32, "shared_experts": 0, "first_dense_layers": 0}
        described, _ = describe(list_moe, "list_moe", {"name": "m"}, WORKLOAD)
        expert = 3 * h * 32
        layers = 2 * (attention + h * e + e * expert + norms)
    assert described.parameters == layers + 2 * 512 * h + h
    assert described.active == described.parameters - 2 * (e - k) * expert  # two MoE layers, top 2 of 4
    assert described.fields["moe"] == moe and described.fields["family"] == "mixtral"
    assert described.unexpressed is None


def test_a_parallel_block_with_multi_query_attention_is_described_with_its_counts_by_hand() -> None:
    """tests/fx_zoo_dense.py's parallel block: one norm feeding attention (a fused QKV of 4 + 2 x 1 heads) and a
    SwiGLU MLP side by side, which the autograd graph on meta shows (the MLP's input owes nothing to attention)."""
    from fx_zoo_dense import parallel_mqa

    given = {**TINY, "kv_heads": 1}
    described, _ = describe(parallel_mqa, "fx_zoo_dense:parallel_mqa", given, WORKLOAD)
    h, d = 64, 16
    layer = h * d * (4 + 2 * 1) + 4 * d * h + 3 * h * 128 + h  # one norm a block
    assert described.parameters == 2 * layer + 2 * 512 * h + h == 135_360
    assert described.fields["parallel_block"] == "shared_norm" and described.fields["kv_heads"] == 1
    assert described.unexpressed is None  # ModelSpec's parallel_block counts it


def test_a_factory_contradicting_the_spec_is_refused_naming_the_field_and_both_values() -> None:
    described, _ = describe(gpt2, "gpt2", {"name": "g"}, WORKLOAD)
    description = ModelDescription("test_fx_describe:gpt2", described.fields, described.parameters, described.active)
    with pytest.raises(
        SpecError,
        match=r"field 'model.ffn': the spec says 4096, the model built by factory "
        r"'test_fx_describe:gpt2' has 256; remove the field",
    ):
        agree({"name": "g", "layers": 2, "ffn": 4096}, description)
    agree({"name": "g", "layers": 2, "ffn": 256, "head_dim": 16, "family": "gpt"}, description)  # agrees
    with pytest.raises(SpecError, match=r"field 'model.family': the spec says 'mixtral'"):
        agree({"family": "mixtral"}, description)


def test_a_spec_setting_a_section_the_model_has_to_null_is_refused() -> None:
    """`moe: null` is a claim (no experts), not a field left to the model: a mixture of experts contradicts it."""
    described, _ = describe(list_moe, "list_moe", {"name": "m"}, WORKLOAD)
    description = ModelDescription("test_fx_describe:list_moe", described.fields, described.parameters, 0)
    with pytest.raises(SpecError, match=r"field 'model.moe': the spec says None, the model built by factory"):
        agree({"name": "m", "moe": None}, description)
    agree({"name": "m", "mla": None, "ssm": None}, description)  # sections it lacks agree with null


@pytest.fixture(scope="module")
def only_factory(tmp_path_factory) -> object:
    folder = tmp_path_factory.mktemp("describe")
    point = {
        "model": {"name": "own", "fx_factory": "test_fx_describe:gpt2"},
        "workload": {"seq_len": 64, "global_batch": 8, "micro_batch": 1},
        "parallel": {"dp": 8},
        "system": {"base": "dgx-h100", "network": {1: {"npus": 1}}},
    }
    (folder / "only.yaml").write_text(json.dumps(point))
    return folder / "only.yaml"


def test_a_point_giving_only_its_factory_evaluates_with_the_modules_count(only_factory, capsys) -> None:
    assert main(["check", str(only_factory), "--generator", "fx"]) == 0
    out = capsys.readouterr().out
    assert "model factory 'test_fx_describe:gpt2': 2 layers, 141,056 parameters (141,056 active)" in out
    assert main(["evaluate", str(only_factory), "--generator", "fx", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step_time_s"] > 0
    assert main(["check", str(only_factory)]) == 2  # the symbolic generator needs the fields
    assert "give them, or use generator fx" in capsys.readouterr().err


def test_a_typod_factory_is_one_line_and_exit_2(only_factory, tmp_path, capsys) -> None:
    typo = tmp_path / "typo.yaml"
    typo.write_text(only_factory.read_text().replace("test_fx_describe:", "test_fx_descibe:"))
    assert main(["check", str(typo), "--generator", "fx"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1
    assert "field 'model.fx_factory': cannot import 'test_fx_descibe'" in error
