"""Design points per second per core, generate + simulate, for Llama-3-70B on 1024 H100s.

The issue's reference configuration (TP8, PP8, DP16, 1F1B, global batch 1024, seq 8192), varied over
micro-batch size, recompute and ZeRO stage so that no result is reused. Prints the rate and the split between
generation and simulation. Run: .venv/bin/python benchmarks/evaluate_rate.py
"""

import itertools
import time

from dse import plugins
from dse.evaluate import evaluate
from dse.points import build_point, expand

BASE = {
    "model": "llama3-70b",
    "workload": {"seq_len": 8192, "global_batch": 1024},
    "parallel": {"tp": 8, "pp": 8, "dp": 16, "sp": True, "pp_schedule": "1f1b"},
    "system": {"base": "dgx-h100", "network": {1: {"npus": 128}}},
}


def points():
    for micro_batch, recompute, zero in itertools.product([1, 2], ["none", "selective", "full"], [0, 1, 2]):
        raw = expand(BASE)
        raw["workload"]["micro_batch"] = micro_batch
        raw["parallel"].update(recompute=recompute, zero=zero)
        yield build_point(raw, "benchmark")


def main() -> None:
    generator, cost_model = plugins.generator("symbolic"), plugins.cost_model("analytical")
    batch = list(points())
    gen = sim = 0.0
    start = time.process_time()
    for point in batch:
        result = evaluate(point, generator, cost_model)
        gen += result.generate_s
        sim += result.simulate_s
    cpu = time.process_time() - start
    print(f"llama3-70b on 1024 H100 (TP8 PP8 DP16 1F1B, GBS 1024, seq 8192): {len(batch)} points")
    print(f"  points per second per core: {len(batch) / cpu:.1f}")
    print(f"  mean generate: {1e3 * gen / len(batch):.1f} ms, mean simulate: {1e3 * sim / len(batch):.1f} ms")


if __name__ == "__main__":
    main()
