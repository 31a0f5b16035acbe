"""Every tested Hugging Face architecture through the fx generator (issue 35): a tiny model of each
(`generators.fx.models.hf.ARCHITECTURES`: hidden 64, 2 layers, vocab 512, 4 heads of 16 with 2 key/value heads
where the config has them, 4 experts of 32) built from its config class on meta, its layers and both ends captured
and a step generated, in training and decoding (a StaticCache of seq_len), at each tensor-parallel degree asked
for. Prints one line per (architecture, mode, tp): ok with the built model's parameters and the seconds taken, or
the generator's one-line error. Too slow for CI (about 2 s a line); tests/test_fx_hf_archs.py captures blocks
of some. Decoding (one token per sequence) runs without sp.

    .venv/bin/python benchmarks/fx_hf_archs.py [--tp 1 2] [--modes train decode] [--only phi3 gpt_neox]

Falcon runs too, though it is not a registered factory (`generators.fx.models.hf:falcon`). DeepSeek-V3's spec
carries its latent attention (`mla`) in place of key/value heads.
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128, "vocab": 512}
MOE = {"experts": 4, "top_k": 2, "expert_ffn": 32}


def model_fields(model_type: str) -> dict:
    fields = {"base": "tiny-llama", **TINY, "fx_factory": f"generators.fx.models.hf:{model_type}"}
    if model_type in ("mixtral", "qwen3_moe", "deepseek_v3"):
        fields |= {"base": "tiny-moe", "moe": MOE}
    if model_type.startswith("gemma"):
        fields["activation"] = "geglu"
    if model_type == "gpt_neox":  # multi-head attention, LayerNorms, biases, attention and MLP side by side
        fields |= {"kv_heads": fields["heads"], "norm": "layernorm", "activation": "gelu", "bias": True}
        fields["parallel_block"] = "two_norms"
    if model_type == "falcon":  # Falcon-40B's layout (GQA): fused qkv, two LayerNorms side by side, GeLU MLP
        fields |= {"norm": "layernorm", "activation": "gelu", "parallel_block": "two_norms"}
    if model_type == "deepseek_v3":
        fields |= {"family": "deepseek", "mla": MLA, "kv_heads": None, "head_dim": None}
        fields["moe"] = MOE | {"shared_experts": 1, "first_dense_layers": 1}
    return fields


def run(model_type: str, mode: str, tp: int) -> str:
    import torch

    from dse import plugins
    from dse.point.points import build_point, expand
    from generators.fx.models import hf

    parallel = {"tp": tp, "sp": tp > 1 and mode == "train"}  # decoding one token per sequence has no sp
    raw = {"model": model_fields(model_type), "system": "tiny-ring", "parallel": parallel}
    raw["workload"] = {"seq_len": 64, "global_batch": 4, "micro_batch": 2, "mode": mode}
    point = build_point(expand(raw), f"{model_type} {mode} tp {tp}")
    start = time.perf_counter()
    try:
        plugins.generator("fx").generate(point)
    except Exception as error:
        return f"FAIL {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    with torch.device("meta"):
        built = getattr(hf, model_type)(point.model, point.workload)
    return f"ok   parameters {sum(p.numel() for p in built.parameters()):,}  {time.perf_counter() - start:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--modes", nargs="+", default=["train", "decode"], choices=["train", "decode"])
    parser.add_argument("--only", nargs="+", help="these model types (default: all tested)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    try:
        import transformers  # noqa: F401

        from generators.fx.models.hf import ARCHITECTURES
    except ImportError:
        print("transformers or torch is not installed: pip install -e '.[fx,hf]'")
        return 0
    for model_type in args.only or (*ARCHITECTURES, "falcon"):
        for mode in args.modes:
            for tp in args.tp:
                print(f"{model_type:12s} {mode:6s} tp {tp}  {run(model_type, mode, tp)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
