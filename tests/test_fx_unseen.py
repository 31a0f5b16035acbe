"""Models written from scratch as people write them (tests/fx_zoo_unseen.py), none shaped like the fx zoo: what the
fx generator reads from them (heads from nn.MultiheadAttention's call and from attention written out by einsum,
the block stack of nanoGPT's `transformer.h` and of torch's nn.TransformerEncoder, exact parameter counts by
hand), a Hugging Face GPT-2 given its MLP width, and the one-line refusal of code that views a tp-split projection
by a constant head count."""

import inspect
import json

import pytest

pytest.importorskip("torch")

import fx_zoo_unseen as zoo
from helpers import make_point, run_cli

from dse.errors import DseError
from dse.spec import ModelSpec, WorkloadSpec
from generators.fx.compare import figures
from generators.fx.describe import describe
from generators.fx.generator import FxGenerator
from generators.symbolic import SymbolicGenerator

WORKLOAD = WorkloadSpec(seq_len=64, global_batch=8, micro_batch=1)
H, F, V, P, L = zoo.HIDDEN, zoo.FFN, zoo.VOCAB, zoo.POSITIONS, zoo.LAYERS
NORMS = 2 * 2 * H  # a block's two LayerNorms, weight and bias
MLP = H * F + F + F * H + H  # a two-matrix MLP with biases
COUNTS = {
    # learned positions an nn.Parameter; MultiheadAttention's in_proj_weight [3h, h] and bias, out_proj with bias
    "mha": V * H + P * H + L * (NORMS + 3 * H * H + 3 * H + H * H + H + MLP) + 2 * H + V * H,
    # torch's encoder layer: the same attention, norms and MLP (linear1, linear2)
    "torch_encoder": V * H + L * (NORMS + 4 * H * H + 4 * H + MLP) + 2 * H + V * H + V,
    # q, k, v, o without bias
    "einsum": V * H + L * (NORMS + 4 * H * H + MLP) + 2 * H + V * H,
    # nanoGPT: token and position tables, c_attn and c_proj with biases, the head tied to the token table
    "nanogpt": V * H + P * H + L * (NORMS + 4 * H * H + 4 * H + MLP) + 2 * H,
}


@pytest.mark.parametrize("name", COUNTS)
def test_a_scratch_models_heads_stack_and_parameters_are_read_from_it(name) -> None:
    described, _ = describe(getattr(zoo, name), name, {"name": name}, WORKLOAD)
    assert described.parameters == COUNTS[name]
    fields = described.fields
    assert (fields["layers"], fields["hidden"], fields["vocab"]) == (L, H, V)
    assert (fields["heads"], fields["kv_heads"], fields["ffn"]) == (zoo.HEADS, zoo.HEADS, F)
    assert fields["tied_embeddings"] == (name == "nanogpt")
    assert (fields["position"] == "learned") == (name in ("nanogpt", "mha"))  # mha's an nn.Parameter [1, P, h]


def test_a_hugging_face_gpt2_takes_its_mlp_width_as_n_inner() -> None:
    """GPT-2's config has n_inner for the MLP width (None: 4 x hidden); the point's filled ffn is written there."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config

    from generators.fx.models.hf import config_overrides

    spec = ModelSpec(
        name="g", family="gpt", layers=2, hidden=128, heads=4, ffn=384, vocab=512, norm="layernorm", activation="gelu"
    )
    assert config_overrides(spec, WORKLOAD, GPT2Config())["n_inner"] == 384


SEQ, BATCH = 64, 8
TOKENS = SEQ * BATCH
# the matmul weights of mha, torch_encoder and nanogpt alike: per block the attention's 4 h x h and the MLP's two
# h x f, and the head
MATMUL = L * (4 * H * H + 2 * H * F) + V * H
LEARNED = {"position": "learned", "max_seq": P}


def fx_point(factory: str, fields: dict | None = None, **parallel: object):
    """A point of the zoo's factory at the test sizes, its model fields those the module has (`fields` over them)."""
    given = {"layers": L, "hidden": H, "heads": zoo.HEADS, "ffn": F, "vocab": V, "tied_embeddings": False}
    given |= {"position": "rope", "norm": "layernorm", "activation": "gelu", "dtype": "fp32", **(fields or {})}
    return make_point(
        "tiny-gpt",
        system={"base": "dgx-h100", "network": {1: {"npus": 1}}},
        seq_len=SEQ,
        global_batch=BATCH,
        overrides={"model.fx_factory": factory, **{f"model.{k}": v for k, v in given.items()}},
        **parallel,
    )


@pytest.fixture(scope="module")
def generators() -> tuple[FxGenerator, SymbolicGenerator]:
    return FxGenerator(), SymbolicGenerator()


@pytest.mark.parametrize("layout", [{"dp": 8}, {"tp": 2, "dp": 4}], ids=["tp1", "tp2"])
def test_multihead_attention_with_a_mask_is_fused_and_split_by_heads(generators, layout) -> None:
    """nn.MultiheadAttention given a causal float mask: one fused attention op each way (its GEMM FLOPs those of the
    weights alone, 6 x tokens x matmul weights), split over tp by whole heads (`generators.fx.multihead`) with
    every collective's bytes the symbolic generator's."""
    fx, symbolic = generators
    point = fx_point("fx_zoo_unseen:mha", LEARNED, **layout)
    ours, theirs = figures(fx.generate(point), point), figures(symbolic.generate(point), point)
    assert sum(c.gemm_flops * c.ranks for c in ours.classes) == 6 * TOKENS * MATMUL
    (a,), (b,) = ours.classes, theirs.classes
    if layout["dp"] == 8:
        assert a.parameters == COUNTS["mha"]
    assert a.ops["attention"] == b.ops["attention"] == 2 * L * 8 // layout["dp"]  # a forward and a backward each
    assert dict(a.comm_bytes) == pytest.approx(dict(b.comm_bytes), rel=1e-12)


def test_a_position_parameter_under_sp_is_added_before_the_sequence_is_cut(generators) -> None:
    """A position table held as an nn.Parameter cannot meet the embedding's sequence shard: the embedding's partial
    sums are all-reduced and the sequence cut at the first block, as Megatron runs learned positions. Against the
    symbolic generator's reduce-scatter (forward) and all-gather (backward) of the embedding's output: the same
    bytes all-reduced instead, and no all-gather, per micro-batch."""
    fx, symbolic = generators
    point = fx_point("fx_zoo_unseen:mha", LEARNED, tp=2, sp=True, dp=4)
    (a,), (b,) = figures(fx.generate(point), point).classes, figures(symbolic.generate(point), point).classes
    assert a.gemm_flops * a.ranks == 6 * TOKENS * MATMUL
    embedding = SEQ * H * 4 * (BATCH // 4)  # fp32, the rank's micro-batches (2 of one sequence)
    assert a.comm_bytes["all_reduce"] == b.comm_bytes["all_reduce"] + embedding
    assert a.comm_bytes["reduce_scatter"] == b.comm_bytes["reduce_scatter"] - embedding
    assert a.comm_bytes["all_gather"] == b.comm_bytes["all_gather"] - embedding


def test_nanogpt_is_given_its_targets_and_counted_exactly(generators) -> None:
    """nanoGPT's forward returns the last position's logits unless given targets: the epilogue passes the tokens
    as them. Its parameters are the module's (the head tied), its GEMM FLOPs 6 x tokens x matmul weights."""
    fx, _ = generators
    point = fx_point("fx_zoo_unseen:nanogpt_layers", {**LEARNED, "tied_embeddings": True}, dp=8)
    (a,) = figures(fx.generate(point), point).classes
    assert a.parameters == COUNTS["nanogpt"]
    assert a.gemm_flops * a.ranks == 6 * TOKENS * MATMUL


def test_code_viewing_a_split_projection_by_a_constant_is_refused_in_one_line() -> None:
    """The einsum attention views q by the module-level HEADS, which tp 2 leaves at 4 over a rank's 2 heads: the
    capture's error names the line of the user's code."""
    with pytest.raises(DseError) as refused:
        FxGenerator().generate(fx_point("fx_zoo_unseen:einsum", tp=2, sp=True, dp=4))
    source, first = inspect.getsourcelines(zoo.EinsumAttention.forward)
    line = first + next(i for i, text in enumerate(source) if "view(b, t, HEADS" in text)
    message = str(refused.value)
    assert "\n" not in message and f"fx_zoo_unseen.py:{line}," in message and "in module 'attention'" in message
    assert message.endswith("not by the input's width or a constant, or give a plan of your own (model.fx_plan)")


def test_hugging_face_gpt2_splits_its_conv1d_projections(generators) -> None:
    """Hugging Face's GPT-2 computes its projections by Conv1D (x @ W + b), made nn.Linear for the plan, and trains
    with attention dropout 0.1, which the fused kernels apply inside: at tp 2 its GEMM FLOPs are 6 x tokens x
    matmul weights and every collective's bytes the symbolic generator's."""
    pytest.importorskip("transformers")
    fx, symbolic = generators
    fields = {"family": "gpt", "tied_embeddings": True, "position": "learned", "max_seq": SEQ, "ffn": 4 * H}
    point = fx_point("generators.fx.models.hf:gpt2", fields, tp=2, dp=4)
    (a,), (b,) = figures(fx.generate(point), point).classes, figures(symbolic.generate(point), point).classes
    assert a.gemm_flops * a.ranks == 6 * TOKENS * (L * 12 * H * H + V * H)
    assert a.ops["attention"] == b.ops["attention"]
    assert dict(a.comm_bytes) == pytest.approx(dict(b.comm_bytes), rel=1e-12)


def test_evaluate_says_where_the_closed_form_cannot_count_the_module(tmp_path) -> None:
    """The einsum model's projections have no bias while its MLP's do, which ModelSpec's fields cannot say: the
    step is sized by the closed form, and `dse evaluate` says so on stderr with both counts."""
    fields = {"layers": L, "hidden": H, "heads": zoo.HEADS, "ffn": F, "vocab": V, "tied_embeddings": False}
    fields |= {"position": "rope", "norm": "layernorm", "activation": "gelu", "dtype": "fp32"}
    point = {
        "model": {"base": "tiny-llama", "fx_factory": "fx_zoo_unseen:einsum", **fields},
        "workload": {"seq_len": SEQ, "global_batch": BATCH, "micro_batch": 1},
        "parallel": {"dp": 8},
        "system": {"base": "dgx-h100", "network": {1: {"npus": 1}}},
    }
    (tmp_path / "einsum.yaml").write_text(json.dumps(point))
    code, out, err = run_cli("evaluate", str(tmp_path / "einsum.yaml"), "--generator", "fx", "--json")
    assert code == 0 and json.loads(out)["step_time_s"] > 0
    assert f"the module has {COUNTS['einsum']:,}" in err and "sized by the closed form" in err
