"""The FX generator's reference models: built on meta at any scale, with the catalog's parameter counts, torchtitan's
module names, routing that captures as one static graph, and the GEMM FLOPs the symbolic generator counts."""

import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from dse.errors import SpecError  # noqa: E402
from dse.modelstats import active_param_count, attention_flops_per_token, matmul_params, param_count  # noqa: E402
from dse.spec import ModelSpec  # noqa: E402
from generators.fx.models import llama, moe  # noqa: E402
from generators.fx.models.moe import MoE, active_parameter_count  # noqa: E402
from generators.symbolic import count_parameters  # noqa: E402
from tests.helpers import make_point  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def on_meta(factory, point):
    with torch.device("meta"):
        return factory(point.model, point.workload)


@pytest.mark.parametrize(
    ("model", "factory"),
    [
        ("tiny-llama", llama),
        ("llama3-8b", llama),
        ("llama3-405b", llama),
        ("tiny-gpt", llama),  # LayerNorm, GeLU, biases, learned positions
        ({"base": "tiny-llama", "tied_embeddings": True}, llama),
        ("tiny-moe", moe),
        ("mixtral-8x7b", moe),
        ({"base": "tiny-moe", "moe": {"shared_experts": 1, "first_dense_layers": 1}}, moe),
    ],
)
def test_parameter_counts_are_the_catalogs_and_nothing_is_allocated(model, factory) -> None:
    point = make_point(model)
    module = on_meta(factory, point)
    assert all(p.is_meta for p in module.parameters())
    total = sum(p.numel() for p in module.parameters())
    assert total == param_count(point.model) == count_parameters(point)
    assert active_parameter_count(module) == active_param_count(point.model)


def test_known_figures() -> None:
    """The published sizes, through the reference models: Llama 3 8B 8.03e9, Mixtral 8x7B 46.7e9 (12.9e9 active)."""
    llama8b = on_meta(llama, make_point("llama3-8b"))
    mixtral = on_meta(moe, make_point("mixtral-8x7b"))
    assert sum(p.numel() for p in llama8b.parameters()) == 8_030_261_248
    assert sum(p.numel() for p in mixtral.parameters()) == 46_702_792_704
    assert active_parameter_count(mixtral) == 12_879_925_248


def test_module_names_are_torchtitans() -> None:
    module = on_meta(moe, make_point({"base": "tiny-moe", "moe": {"first_dense_layers": 1}}))
    names = {n for n, _ in module.named_parameters()}
    dense = {f"layers.0.{p}.weight" for p in ("attention.wq", "attention.wk", "attention.wv", "attention.wo")}
    dense |= {f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    dense |= {"layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"}
    routed = {"layers.1.moe.router.gate.weight", "layers.1.moe.experts.w1", "layers.1.moe.experts.w2"}
    outside = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    assert dense | routed | outside <= names
    assert not any(n.startswith("layers.0.moe") or n.startswith("layers.1.feed_forward") for n in names)


def test_factories_refuse_what_they_do_not_build() -> None:
    with pytest.raises(ValueError, match="use the fx model factory 'moe'"):
        on_meta(llama, make_point("tiny-moe"))
    with pytest.raises(ValueError, match="use the fx model factory 'llama'"):
        on_meta(moe, make_point("tiny-llama"))
    with pytest.raises(SpecError, match=r"the reference FX model has no latent attention \(model.mla\)"):
        on_meta(moe, make_point("tiny-deepseek"))


def test_entry_points_name_the_factories() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["dse.fx_models"]
    for name, target in declared.items():
        module, attr = target.split(":")
        assert callable(getattr(import_module(module), attr)), name
    assert {"llama", "moe", "hf"} <= set(declared)


def _spec(**fields) -> ModelSpec:
    base = {"name": "t", "family": "mixtral", "layers": 1, "hidden": 16, "heads": 2, "vocab": 32, "norm": "rmsnorm"}
    return ModelSpec(**(base | {"activation": "swiglu", "dtype": "fp32"} | fields))


def test_moe_equals_a_loop_over_experts_when_nothing_is_dropped() -> None:
    """Capacity for every copy (factor experts / top_k): the gather/scatter dispatch computes exactly what
    Mixtral's eager loop (each token through its top_k experts, weighted by the renormalised gates) does."""
    spec = _spec(moe={"experts": 4, "top_k": 2, "expert_ffn": 8, "shared_experts": 1})
    torch.manual_seed(0)
    layer = MoE(spec, capacity_factor=4 / 2)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(3, 5, 16)
    flat = x.reshape(-1, 16)
    logits, chosen = layer.router.gate(flat).topk(2, dim=-1)
    gates = torch.softmax(logits, dim=-1)
    ex = layer.experts
    expected = layer.shared_experts(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            e = int(chosen[t, j])
            hidden = torch.nn.functional.silu(ex.w1[e] @ flat[t]) * (ex.w3[e] @ flat[t])
            expected[t] += gates[t, j] * (ex.w2[e] @ hidden)
    torch.testing.assert_close(layer(x), expected.view(3, 5, 16))


def test_moe_drops_copies_beyond_capacity_first_choices_first() -> None:
    """One slot per expert and every token routed to the same two experts: only token 0's copies are served."""
    layer = MoE(_spec(moe={"experts": 4, "top_k": 2, "expert_ffn": 8}), capacity_factor=0.1)
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[:2] = 1.0  # experts 0 and 1 score x.sum(); positive inputs pick them
        for p in layer.experts.parameters():
            p.fill_(0.1)
    assert layer.capacity(3) == 1
    y = layer(torch.ones(1, 3, 16))
    assert y[0, 0].abs().sum() > 0
    assert torch.equal(y[0, 1:], torch.zeros(2, 16))


@pytest.mark.parametrize(("model", "factory"), [("tiny-llama", llama), ("tiny-moe", moe), ("mixtral-8x7b", moe)])
def test_gemm_flops_are_the_symbolic_generators(model, factory) -> None:
    """torch's flop counter over a training step on meta: the matrix products are 6 x tokens x the active matmul
    parameters (norm weights, which modelstats' matmul_params includes, multiply nothing), exactly, and attention
    (on meta SDPA runs as two bmm each way) 3 x the forward's full, not causal-halved, count."""
    point = make_point(model, seq_len=256)
    m, batch = point.model, 2
    module = on_meta(factory, point)
    with torch.device("meta"), FlopCounterMode(display=False) as counter:
        module(torch.zeros(batch, 256, dtype=torch.long)).sum().backward()
    counts = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    tokens = batch * 256
    norm_weights = (2 * m.layers + 1) * m.hidden
    attention = 3 * attention_flops_per_token(m, 256) * tokens
    assert set(counts) == {"aten.mm", "aten.bmm"}
    assert counts["aten.mm"] + counts["aten.bmm"] == 6 * tokens * (matmul_params(m) - norm_weights) + attention


def capture(module, batch: int, seq: int) -> tuple[list[str], list[str]]:
    """The ATen ops of a training step's forward and backward graphs: the meta-built module made fake on the CPU
    (where SDPA dispatches to its fused CPU kernel; on meta it falls back to its math path), then
    torch.compile(fullgraph=True) through aot_autograd, which fails on any graph break."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def keep(gm, inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep)

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            module = module.to_empty(device="cpu")
            tokens = torch.zeros(batch, seq, dtype=torch.long)
            torch.compile(module, backend=backend, fullgraph=True)(tokens).float().sum().backward()
    finally:
        torch._dynamo.reset()
    forward, backward = graphs
    return forward, backward


SDPA_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SDPA_CPU_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
DATA_DEPENDENT = ("aten.nonzero.default", "aten._local_scalar_dense.default", "aten.masked_select.default")


@pytest.mark.parametrize(("model", "factory"), [("tiny-llama", llama), ("tiny-moe", moe)])
def test_training_step_captures_as_one_graph_with_fused_attention(model, factory) -> None:
    """No graph break, no data-dependent op (the MoE's routing included), one fused SDPA per layer each way."""
    forward, backward = capture(on_meta(factory, make_point({"base": model, "layers": 2})), 2, 256)
    assert forward.count(SDPA_CPU) == 2
    assert backward.count(SDPA_CPU_BACKWARD) == 2
    assert not any(op in forward + backward for op in DATA_DEPENDENT)


@pytest.mark.parametrize(
    "model", ["tiny-llama", "llama3-8b", {"base": "tiny-llama", "tied_embeddings": True}, "tiny-moe"]
)
def test_hugging_face_models_from_a_config_in_code(model) -> None:
    """With transformers installed: LlamaForCausalLM / MixtralForCausalLM of the spec, built on meta from a config
    written in code (nothing downloaded), with the catalog's parameter count."""
    pytest.importorskip("transformers")
    from generators.fx.models.hf import hf

    point = make_point(model)
    module = on_meta(hf, point)
    assert all(p.is_meta for p in module.parameters())
    assert sum(p.numel() for p in module.parameters()) == param_count(point.model)
    assert len(module.layers) == point.model.layers


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
def test_hugging_face_models_capture_with_fused_attention(model) -> None:
    """Hugging Face's Mixtral (transformers 5) routes dropless through aten._grouped_mm, without data-dependent
    shapes, so it captures too."""
    pytest.importorskip("transformers")
    from generators.fx.models.hf import hf

    forward, backward = capture(on_meta(hf, make_point({"base": model, "layers": 2})), 2, 64)
    assert forward.count(SDPA_CPU) == 2
    assert backward.count(SDPA_CPU_BACKWARD) == 2
    assert not any(op in forward + backward for op in DATA_DEPENDENT)


@pytest.mark.parametrize(
    "parallel", [{"dp": 2}, {"tp": 2, "dp": 2, "sp": True}, {"tp": 4}, {"tp": 2, "dp": 2, "pp": 2, "zero": 1}]
)
def test_a_hugging_face_model_through_the_fx_generator_agrees_with_symbolic(parallel) -> None:
    """LlamaForCausalLM captured by the fx generator (its block, embedding and head, under the same TP plan in
    Hugging Face's module names; mask-free causal attention: one fused op) gives the symbolic generator's figures
    for the same spec: parameters, GEMM FLOPs and every collective's bytes exact (the vocab-parallel loss's three
    all-reduces on both sides), peak memory within the compare's 3 %; not the step time, which at these sizes
    kernel launches decide (benchmarks/fx_agreement.py checks it at real sizes)."""
    pytest.importorskip("transformers")
    from dse import plugins
    from generators.fx.compare import compare, figures

    symbolic = make_point("tiny-llama", seq_len=128, micro_batch=2, **parallel)
    captured = symbolic.model_copy(update={"model": symbolic.model.model_copy(update={"fx_factory": "hf"})})
    rows = compare(
        figures(plugins.generator("fx").generate(captured), captured),
        figures(plugins.generator("symbolic").generate(symbolic), symbolic),
    )
    assert all(r.ok for r in rows if r.figure != "step time s"), [r for r in rows if not r.ok]
    w, p = symbolic.workload, symbolic.parallel
    for r in rows:
        if r.figure in ("parameters on a rank", "GEMM FLOPs") or r.figure.endswith(" bytes"):
            assert r.figure == "peak memory bytes" or r.a == r.b, r
    microbatches = w.global_batch // p.dp // w.micro_batch
    assert next(r.a for r in rows if r.figure == "ops: attention") == 2 * symbolic.model.layers // p.pp * microbatches


def test_both_rope_implementations_rotate_alike() -> None:
    """rope_impl real (cos/sin on real pairs, no complex dtype in the graph) gives what complex gives."""
    fields = {"family": "llama", "heads": 2, "kv_heads": 1, "ffn": 24, "dtype": "fp32", "activation": "swiglu"}
    workload = make_point("tiny-llama", seq_len=8).workload
    models = [llama(_spec(**fields, rope_impl=impl), workload) for impl in ("complex", "real")]
    models[1].load_state_dict(models[0].state_dict())
    tokens = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(models[1](tokens), models[0](tokens))
    assert models[0].freqs_cis.is_complex() and not models[1].freqs_cis.is_complex()


def test_a_meta_model_materialised_gets_its_rope_table_back() -> None:
    point = make_point("tiny-llama", seq_len=64)
    module = on_meta(llama, point).to_empty(device="cpu")
    module.init_buffers()
    torch.testing.assert_close(module.freqs_cis, llama(point.model, point.workload).freqs_cis)


def test_hf_without_transformers_says_how_to_install_it(monkeypatch) -> None:
    """`make test` installs transformers: the test hides it (a None entry in sys.modules fails its import)."""
    from generators.fx.models.hf import hf

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match=r"needs transformers: pip install 'dse-orchestrator\[hf\]'"):
        hf(make_point("tiny-llama").model, make_point("tiny-llama").workload)
