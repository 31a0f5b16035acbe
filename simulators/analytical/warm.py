"""Compile the analytical model's kernels into numba's disk cache before first use (`make` runs this after installing).

Every kernel is compiled once per checkout and kept in `__pycache__` (README, "analytical model"). Without this step
the first process that prices a point compiles the per-point kernels (about 24 s of CPU on the 2-core machine this
was measured on, 2026-11-30, with an empty NUMBA_CACHE_DIR) and the first that prices a batch the batch path's
(about 15 s more): a user's first `dse evaluate` and every worker of a first study would wait for them. Pricing
one small pipeline point on the default path, which fast-forwards its layer runs and extends its steady form, and
the same workload as a batch, compiles them all.

Run: python -m simulators.analytical.warm
"""

import time

from dse.point.points import build_point, expand
from generators.symbolic import SymbolicGenerator
from simulators.analytical.cost_model import BATCH_FROM, AnalyticalCostModel

WARM_POINT = {
    "model": "tiny-llama",
    "workload": {"seq_len": 256, "global_batch": 32, "micro_batch": 1},
    "parallel": {"tp": 2, "pp": 2, "dp": 2, "sp": True, "zero": 1, "pp_schedule": "1f1b"},
    "system": "tiny-ring",
}
"""Two stages of a few layers with 32 micro-batches: a steady form and layer runs, on the catalog's test system."""


def main() -> None:
    start = time.process_time()
    point = build_point(expand(WARM_POINT), "warm-up point")
    workload = SymbolicGenerator().generate(point)
    model = AnalyticalCostModel()
    model.simulate(workload, point.system)
    model.simulate_many(workload, [point.system] * BATCH_FROM)
    print(f"analytical kernels compiled or loaded in {time.process_time() - start:.1f} CPU-s")


if __name__ == "__main__":
    main()
