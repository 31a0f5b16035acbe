"""A digest of what the analytical cost model prices over a few hundred varied training points: every metric a study
records and every rank class's figures, written to a JSON file or compared with one.

Issue 36's acceptance asks that faster pricing leave results unchanged over "at least 200 varied points (models,
schedules, sp, cp, ep, zero, recompute)". The points are drawn deterministically (a seeded generator, in a fixed
order) from families of a catalog model on a catalog system: dense GQA and unfused-attention models, MoE and MLA,
Mamba and a Mamba-attention hybrid, over 1F1B, interleaved, ZB-H1, GPipe and DualPipeV, sequence and context
parallelism, expert parallelism, ZeRO 0-3 and every recompute policy, on several systems. Draws the tool finds
infeasible are skipped (so every kept point is priced), and the same seed gives the same points in any version that
agrees on feasibility. Each point is priced as a study prices a trial (`dse.point.evaluate.evaluate`: the symbolic
generator, the analytical cost model, every installed objective); recorded are its metrics and, per rank class,
end, compute, communication and exposed communication seconds, peak memory and the seconds per category.

Run: .venv/bin/python benchmarks/pricing_digest.py --write FILE       (record)
     .venv/bin/python benchmarks/pricing_digest.py --against FILE [--rtol 1e-9]
The comparison prints every point and figure that differs by more than rtol (relative; 0: exactly) or is missing
on either side, and exits 1 if any does.
"""

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dse import plugins
from dse.errors import DseError
from dse.point.evaluate import evaluate
from dse.point.feasibility import check_feasible
from dse.point.points import build_point, expand
from dse.spec import DesignPoint

SEED = 36
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Family:
    """A model on a system at one scale, and the choices its points are drawn from (parallel.* and
    workload.micro_batch; a missing one keeps the default)."""

    name: str
    model: dict[str, Any]
    system: str
    gpus: int
    seq_len: int
    global_batch: int
    points: int
    choices: dict[str, tuple] = field(default_factory=dict)


SCHEDULES = ("1f1b", "1f1b", "interleaved", "zb_h1", "gpipe", "dualpipev")
"""1F1B twice: the schedule most studies run, and the one with the steady-state pricing most points take."""
RECOMPUTE = ("none", "selective", "full", "selective_op")
DENSE = {
    "tp": (1, 2, 4, 8),
    "pp": (1, 2, 4, 8),
    "cp": (1, 1, 2),
    "sp": (True, False),
    "zero": (0, 1, 2, 3),
    "recompute": RECOMPUTE,
    "pp_schedule": SCHEDULES,
    "micro_batch": (1, 2),
}
MOE = DENSE | {"ep": (1, 2, 4, 8), "cp": (1,)}

FAMILIES = (
    Family("llama3-8b", {"base": "llama3-8b"}, "dgx-h100", 64, 4096, 128, 50, DENSE),
    Family(
        "gpt3-175b unfused",
        {"base": "gpt3-175b", "flash_attention": False, "dropout": True},
        "dgx-h100",
        1024,
        2048,
        1536,
        24,
        DENSE | {"tp": (4, 8), "pp": (8, 16), "cp": (1,), "micro_batch": (1, 2)},
    ),
    Family("llama3-70b", {"base": "llama3-70b"}, "dgx-b200", 256, 8192, 256, 24, DENSE | {"pp": (2, 4, 8)}),
    Family("llama2-13b", {"base": "llama2-13b"}, "mi300x-8", 64, 4096, 128, 20, DENSE),
    Family("llama2-7b", {"base": "llama2-7b"}, "dgx-a100", 32, 4096, 64, 16, DENSE),
    Family("mixtral-8x7b", {"base": "mixtral-8x7b"}, "dgx-h100", 128, 4096, 256, 26, MOE),
    Family("deepseek-v2-lite", {"base": "deepseek-v2-lite"}, "dgx-h100", 64, 4096, 128, 20, MOE),
    Family("mamba-2.8b", {"base": "mamba-2.8b"}, "dgx-a100", 32, 4096, 64, 16, DENSE | {"cp": (1,)}),
    Family("tiny-hybrid", {"base": "tiny-hybrid"}, "dgx-h100", 16, 1024, 64, 16, DENSE | {"cp": (1,)}),
    Family("tiny-deepseek", {"base": "tiny-deepseek"}, "rail-h100", 32, 1024, 64, 14, MOE),
    Family("tiny-llama", {"base": "tiny-llama"}, "fattree-2to1-h100", 32, 1024, 128, 14, DENSE),
)
"""240 points in all."""


def draws(family: Family, rng: random.Random) -> Iterator[tuple[str, dict[str, Any]]]:
    """(a label, the point's raw fields) of the family's draws, endlessly, in the generator's order."""
    while True:
        pick = {name: rng.choice(values) for name, values in family.choices.items()}
        tp, pp, cp, ep = pick.get("tp", 1), pick.get("pp", 1), pick.get("cp", 1), pick.get("ep", 1)
        dp = family.gpus // (tp * pp * cp)
        parallel: dict[str, Any] = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "ep": ep}
        parallel |= {k: pick[k] for k in ("zero", "recompute", "pp_schedule") if k in pick}
        parallel["sp"] = pick.get("sp", False) and tp > 1
        if parallel.get("pp_schedule") == "interleaved":
            parallel["virtual_stages"] = 2
        if pp == 1:
            parallel["pp_schedule"] = "1f1b"
        raw = {
            "model": dict(family.model),
            "workload": {
                "seq_len": family.seq_len,
                "global_batch": family.global_batch,
                "micro_batch": pick.get("micro_batch", 1),
            },
            "parallel": parallel,
            "system": {"base": family.system, "network": {1: {"npus": family.gpus // GPUS_PER_NODE}}},
        }
        label = (
            f"{family.name} tp{tp} pp{pp} cp{cp} ep{ep} dp{dp} sp{int(parallel['sp'])} zero{parallel.get('zero', 0)} "
            f"{parallel.get('recompute', 'none')} {parallel['pp_schedule']} mb{raw['workload']['micro_batch']}"
        )
        yield label, raw


def points() -> Iterator[tuple[str, DesignPoint]]:
    """The digest's points: each family's first `points` distinct feasible draws."""
    rng = random.Random(SEED)
    for family in FAMILIES:
        kept: set[str] = set()
        for attempt, (label, raw) in enumerate(draws(family, rng)):
            if len(kept) == family.points or attempt > 400 * family.points:
                break
            if label in kept:
                continue
            try:
                point = build_point(expand(raw), label)
                check_feasible(point)
            except DseError:
                continue
            kept.add(label)
            yield label, point
        if len(kept) < family.points:
            raise SystemExit(f"{family.name}: only {len(kept)} feasible points of {family.points} drawn")


def digest(point: DesignPoint, generator: Any, cost_model: Any) -> dict[str, Any]:
    """Every figure of a priced point, by name."""
    evaluation = evaluate(point, generator, cost_model)
    figures: dict[str, Any] = {f"metric.{k}": v for k, v in evaluation.metrics.items()}
    for c in evaluation.result.classes:
        for name in ("end_s", "compute_s", "comm_s", "exposed_comm_s", "peak_memory_bytes"):
            figures[f"{c.name}.{name}"] = getattr(c, name)
        for category, seconds in c.time_by_category.items():
            figures[f"{c.name}.category.{category}"] = seconds
    return figures


def run() -> dict[str, dict[str, Any]]:
    generator = plugins.generator("symbolic")
    cost_model = plugins.cost_model("analytical", {})
    out: dict[str, dict[str, Any]] = {}
    began = time.process_time()
    for label, point in points():
        out[label] = digest(point, generator, cost_model)
    print(f"{len(out)} points priced in {time.process_time() - began:.1f} CPU-s", file=sys.stderr)
    return out


def differences(ours: dict[str, dict[str, Any]], theirs: dict[str, dict[str, Any]], rtol: float) -> list[str]:
    """One line per point or figure that is missing on a side or differs by more than rtol."""
    lines = [f"{label}: only in the file" for label in theirs if label not in ours]
    lines += [f"{label}: not in the file" for label in ours if label not in theirs]
    for label in (label for label in ours if label in theirs):
        a, b = ours[label], theirs[label]
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                lines.append(f"{label}: {name} only {'in the file' if name in b else 'now'}")
            elif not _close(a[name], b[name], rtol):
                lines.append(f"{label}: {name} {b[name]!r} -> {a[name]!r}")
    return lines


def _close(a: Any, b: Any, rtol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int | float) or not isinstance(b, int | float):
        return a == b
    return a == b or math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, help="record the digest into this JSON file")
    mode.add_argument("--against", type=Path, help="compare with the digest in this JSON file")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative difference allowed (default 0: exact)")
    args = parser.parse_args()
    if args.against is not None and not args.against.is_file():
        print(f"{args.against}: no such file; record one first with --write", file=sys.stderr)
        sys.exit(2)
    result = run()
    if args.write is not None:
        args.write.write_text(json.dumps(result, indent=1, sort_keys=True))
        print(f"{len(result)} points, {sum(map(len, result.values()))} figures written to {args.write}")
        return
    theirs = json.loads(args.against.read_text())
    lines = differences(result, theirs, args.rtol)
    print("\n".join(lines) if lines else f"{len(result)} points: every figure within rtol {args.rtol:g}")
    if lines:
        points = {line.split(": ")[0] for line in lines}
        worst, where = largest_difference(result, theirs)
        print(f"{len(lines)} figures of {len(points)} points differ; largest relative difference {worst:.2e} ({where})")
    sys.exit(1 if lines else 0)


def largest_difference(ours: dict[str, dict[str, Any]], theirs: dict[str, dict[str, Any]]) -> tuple[float, str]:
    """The largest relative difference of a number both sides have, and where."""
    worst, where = 0.0, ""
    for label in ours.keys() & theirs.keys():
        for name in ours[label].keys() & theirs[label].keys():
            a, b = ours[label][name], theirs[label][name]
            if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool) and a != b:
                relative = abs(a - b) / max(abs(a), abs(b))
                if relative > worst:
                    worst, where = relative, f"{label}: {name}"
    return worst, where


if __name__ == "__main__":
    main()
