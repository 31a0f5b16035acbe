"""How generation scales: printed figures, not a timed test.

1. Llama-3-70B on 1024 ranks (TP8, PP8, DP16, 1F1B, global batch 128, seq 8192): generate the workload and
   export every rank's Chakra trace (`dse generate --chakra`).
2. A 540B-class dense model on 32,768 ranks (TP8, PP8, DP512): generate the workload in memory.
3. The same 540B model at DP 16..512: generation time must not grow with the DP degree (rank classes).

Each case runs in a fresh process so that its peak RSS is its own.

    .venv/bin/python benchmarks/generate_scale.py [--out /tmp/dse-chakra] [--keep]
"""

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL_540B = {
    "name": "dense-540b-class",
    "family": "gpt",
    "layers": 104,
    "hidden": 20480,
    "heads": 128,
    "ffn": 81920,
    "vocab": 51200,
    "norm": "layernorm",
    "activation": "gelu",
    "position": "learned",
    "max_seq": 2048,
    "tied_embeddings": True,
    "bias": True,
}


def point(case: str, dp: int = 512) -> dict:
    """70b: 8 micro-batches per DP rank (global batch 128 at DP 16); 540b: 8 micro-batches of 2048 tokens."""
    if case == "70b":
        return {
            "model": "llama3-70b",
            "workload": {"seq_len": 8192, "global_batch": 8 * dp, "micro_batch": 1},
            "parallel": {"tp": 8, "pp": 8, "dp": dp, "sp": True, "zero": 1, "pp_schedule": "1f1b"},
            "system": {"base": "dgx-h100", "network": {1: {"npus": dp * 8}}},
        }
    return {
        "model": MODEL_540B,
        "workload": {"seq_len": 2048, "global_batch": 8 * dp, "micro_batch": 1},
        "parallel": {"tp": 8, "pp": 8, "dp": dp, "sp": True, "zero": 1, "pp_schedule": "1f1b"},
        "system": {"base": "dgx-h100", "network": {1: {"npus": dp * 8}}},
    }


def child(case: str, out: str, dp: int) -> None:
    """Runs in the subprocess: time generation (and export), print one JSON line."""
    from dse.point import chakra
    from dse.point.points import build_point, expand
    from generators.symbolic import SymbolicGenerator

    start = time.perf_counter()
    p = build_point(expand(point(case, dp)), case)
    workload = SymbolicGenerator().generate(p)
    generated = time.perf_counter()
    files = 0
    if out:
        files = len(chakra.export(workload, out, [d.npus for d in p.system.network]))
    done = time.perf_counter()
    size = sum(f.stat().st_size for f in Path(out).glob("*")) if out else 0
    calls = sum(len(prog.calls) for prog in workload.programs)
    print(
        json.dumps(
            {
                "ranks": p.parallel.world,
                "rank_classes": len(workload.programs),
                "blocks": len(workload.blocks),
                "calls": calls,
                "generate_s": generated - start,
                "export_s": done - generated,
                "files": files,
                "bytes_written": size,
                "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


def run(case: str, out: str = "", dp: int = 512) -> dict:
    cmd = [sys.executable, __file__, "--child", case, "--dp", str(dp)] + (["--out", out] if out else [])
    result = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="where the 70B traces go (default: a temporary folder, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the 70B traces")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--dp",
        type=int,
        default=0,
        help="only the 70B export at this DP degree (e.g. 2 to set it beside a scaled-down STAGE run)",
    )
    args = parser.parse_args()
    if args.child:
        child(args.child, args.out or "", args.dp or 512)
        return
    out = args.out or tempfile.mkdtemp(prefix="dse-chakra-")
    try:
        r = run("70b", out, dp=args.dp or 16)
        print(
            f"Llama-3-70B, {r['ranks']} ranks (TP8 PP8 DP{r['ranks'] // 64}, 8 micro-batches of seq 8192): "
            f"generate {r['generate_s']:.2f} s, "
            f"Chakra export {r['export_s']:.1f} s ({r['files']} files, {r['bytes_written'] / 2**30:.2f} GiB), "
            f"total {r['generate_s'] + r['export_s']:.1f} s, peak RSS {r['peak_rss_MiB']:.0f} MiB"
        )
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if args.dp:
        return
    r = run("540b")
    print(
        f"540B-class dense, {r['ranks']} ranks (TP8 PP8 DP512): in-memory workload in {r['generate_s']:.2f} s, "
        f"{r['rank_classes']} rank classes, {r['blocks']} blocks, {r['calls']} calls, "
        f"peak RSS {r['peak_rss_MiB']:.0f} MiB (targets: < 60 s, < 1024 MiB)"
    )
    for dp in (16, 64, 512):
        r = run("540b", dp=dp)
        print(f"  DP {dp:4d} ({r['ranks']:6d} ranks): generate {r['generate_s']:.2f} s, {r['calls']} calls")


if __name__ == "__main__":
    main()
