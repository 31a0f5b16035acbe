"""Our analytical model against the real ASTRA-sim on a fixed set of points: the step-time and exposed-communication
gaps, and what each ASTRA-sim evaluation costs.

The set covers what the two models price differently: dense 3D parallelism, FSDP, mixture-of-experts with expert
parallelism, context parallelism, interleaved pipelines, and 128 and 1024 GPUs (the latter on a scaled-down world
of two data-parallel replicas, `max_npus`). Both models get the same workload and system; ASTRA-sim's compute
nodes carry our compute model's durations, so the gaps are the network's and the schedule's.
Needs ASTRA_SIM_BIN (the congestion-unaware analytical binary). Run:
    ASTRA_SIM_BIN=../shared/astra-sim/AstraSim_Analytical_Congestion_Unaware .venv/bin/python benchmarks/cross_model.py
"""

import argparse
import time
from typing import Any

from dse.point.points import build_point, expand
from dse.spec import DesignPoint
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from simulators.astrasim import AstraSimCostModel, AstraSimOptions


def _point(model: str, seq: int, batch: int, parallel: dict[str, Any], nodes: int, **workload: Any) -> DesignPoint:
    raw = {
        "model": model,
        "workload": {"seq_len": seq, "global_batch": batch, "micro_batch": 1, **workload},
        "parallel": parallel,
        "system": {"base": "dgx-h100", "network": {1: {"npus": nodes}}},
    }
    return build_point(expand(raw), model)


POINTS = {
    "dense 3D, 8 GPUs": _point("llama3-8b", 4096, 16, {"tp": 2, "pp": 2, "dp": 2, "sp": True, "zero": 1}, 1),
    "FSDP, 8 GPUs": _point("llama3-8b", 8192, 16, {"dp": 8, "zero": 3, "recompute": "selective"}, 1),
    "MoE EP8, 16 GPUs": _point("mixtral-8x7b", 4096, 32, {"dp": 16, "ep": 8, "zero": 1}, 2),
    "CP4 TP2, 8 GPUs": _point("llama3-8b", 32768, 2, {"tp": 2, "cp": 4, "sp": True}, 1),
    "interleaved PP4 v2, 8 GPUs": _point(
        "llama3-8b", 4096, 32, {"pp": 4, "dp": 2, "pp_schedule": "interleaved", "virtual_stages": 2}, 1
    ),
    "dense 3D, 128 GPUs": _point("llama3-70b", 8192, 32, {"tp": 8, "pp": 8, "dp": 2, "sp": True, "zero": 1}, 16),
    "dense 3D, 1024 GPUs (scaled to 128)": _point(
        "llama3-70b", 8192, 256, {"tp": 8, "pp": 8, "dp": 16, "sp": True, "zero": 1}, 128
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the points whose name contains this text")
    parser.add_argument("--max-npus", type=int, default=128, help="ASTRA-sim's max_npus (scaled world)")
    args = parser.parse_args()
    generator = SymbolicGenerator()
    astra = AstraSimCostModel(AstraSimOptions(max_npus=args.max_npus, timeout_s=3600))
    print(f"{'point':38} {'ours ms':>10} {'astra ms':>10} {'gap':>7} {'exposed ours':>13} {'astra':>9} {'astra s':>8}")
    for name, point in POINTS.items():
        if args.only and args.only not in name:
            continue
        workload = generator.generate(point)
        ours = AnalyticalCostModel().simulate(workload, point.system)
        began = time.perf_counter()
        theirs = astra.simulate(workload, point.system)
        seconds = time.perf_counter() - began
        gap = theirs.step_time_s / ours.step_time_s - 1
        print(
            f"{name:38} {ours.step_time_s * 1e3:10.2f} {theirs.step_time_s * 1e3:10.2f} {gap:+7.1%} "
            f"{ours.exposed_comm_time_s * 1e3:13.2f} {theirs.exposed_comm_time_s * 1e3:9.2f} {seconds:8.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
