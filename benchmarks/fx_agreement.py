"""The fx and symbolic generators agree (issue 35, item 4): `generators.fx.compare` on a matrix of real-size points
and on the example points the fx docs and tests ship, printed, not a timed test (captures of real-size models take
seconds each; CI runs a reduced version at small shapes, tests/test_fx_compare.py).

The matrix: llama3-8b and mixtral-8x7b (catalog models, built by the fx generator's reference factories) at tp 1, 2
and 8 by pp 1 and 4, with sp wherever tp > 1 and ZeRO 3 on a third of the points, on DGX H100 nodes. Per point the
compare table (parameters, GEMM FLOPs and collective bytes equal, peak memory and step time within 3 %), then one
summary line per point; exits 1 when any checked figure of any point is off, 2 when a point cannot be generated.

    .venv/bin/python benchmarks/fx_agreement.py [--only llama3-8b] [--quiet]

Exits 0 without comparing anything when the fx generator is not installed (the optional extra `fx`).
"""

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS: list[dict[str, Any]] = [
    {"tp": 1, "pp": 1, "dp": 8, "zero": 3},
    {"tp": 2, "pp": 1, "dp": 4, "sp": True, "zero": 1},
    {"tp": 8, "pp": 1, "dp": 1, "sp": True},
    {"tp": 1, "pp": 4, "dp": 2, "zero": 1},
    {"tp": 2, "pp": 4, "dp": 2, "sp": True, "zero": 3},
    {"tp": 8, "pp": 4, "dp": 1, "sp": True},
]
"""Each model's six layouts: tp 1, 2, 8 by pp 1, 4; the dp making whole 8-GPU nodes."""
MODELS = ("llama3-8b", "mixtral-8x7b")
WORKLOAD = {"seq_len": 4096, "global_batch": 32, "micro_batch": 1}
SHIPPED = [
    (
        "tests/fx_tiny_llama.py TP2 (tests/test_fx_generator.py's)",
        {
            "model": {"base": "tiny-llama", "fx_factory": "fx_tiny_llama:llama"},
            "workload": {"seq_len": 256, "global_batch": 8, "micro_batch": 1},
            "parallel": {"tp": 2, "dp": 4, "sp": True},
            "system": "tiny-ring",
        },
    ),
    (
        "llama3-8b TP8 (the README's fx example)",
        {
            "model": "llama3-8b",
            "workload": {"seq_len": 8192, "global_batch": 16, "micro_batch": 1},
            "parallel": {"tp": 8, "dp": 2, "sp": True},
            "system": {"base": "dgx-h100", "network": {1: {"npus": 2}}},
        },
    ),
]
"""The example points: the fx tests' tiny-llama TP2 point and a llama3-8b TP8 one. studies/points/ holds no point
the fx generator builds as shipped beyond these shapes (their recompute and ZeRO settings are covered by the
matrix)."""


def matrix() -> list[tuple[str, dict[str, Any]]]:
    points = []
    for model in MODELS:
        for layout in LAYOUTS:
            nodes = layout["tp"] * layout["pp"] * layout["dp"] // 8
            raw = {
                "model": model,
                "workload": dict(WORKLOAD),
                "parallel": dict(layout),
                "system": {"base": "dgx-h100", "network": {1: {"npus": nodes}}},
            }
            label = " ".join(f"{k}{'' if v is True else v}" for k, v in layout.items())
            points.append((f"{model} {label}", raw))
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="only the points whose label contains this")
    parser.add_argument("--quiet", action="store_true", help="the failing rows only, not every table")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:  # any other import error is a bug to show, not a skip
        print("the fx generator is not installed (pip install -e '.[fx]'): nothing compared")
        return 0
    from generators.fx.generator import FxGenerator

    sys.path.insert(0, str(ROOT / "tests"))  # the tiny-llama example's factory, fx_tiny_llama
    from dse.errors import DseError
    from dse.point.points import build_point, expand
    from generators.fx.compare import compare, figures, render
    from generators.symbolic import SymbolicGenerator

    fx = FxGenerator()
    summary, code = [], 0
    for label, raw in [*matrix(), *SHIPPED]:
        if args.only and args.only not in label:
            continue
        start = time.perf_counter()
        try:
            point = build_point(expand(raw), label)
            rows = compare(*(figures(g.generate(point), point) for g in (fx, SymbolicGenerator())))
        except DseError as exc:
            summary.append(f"| {label} | - | - | ERROR: {exc} |")
            code = max(code, 2)
            continue
        seconds = time.perf_counter() - start
        bad = [r for r in rows if not r.ok]
        peaks = [r for r in rows if r.figure == "peak memory bytes"]
        worst = max(peaks, key=lambda r: abs(r.difference))  # the stage furthest off (pipelines differ by stage)
        step = next(r for r in rows if r.figure == "step time s")
        shown = [r for r in rows if not r.ok] if args.quiet else rows
        print(f"\n### {label} ({seconds:.1f} s)\n\n{render(shown, 'fx', 'symbolic')}", flush=True)
        verdict = "pass" if not bad else f"FAIL ({', '.join(sorted({f'{r.rank_class} {r.figure}' for r in bad}))})"
        memory = f"{100 * worst.difference:+.2f} % ({worst.rank_class})"
        summary.append(f"| {label} | {memory} | {100 * step.difference:+.2f} % | {verdict} |")
        code = max(code, 1 if bad else 0)
    print("\n| point | peak memory (worst stage) | step time | verdict |\n| --- | ---: | ---: | --- |")
    print("\n".join(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
