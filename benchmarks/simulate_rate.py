"""The analytical cost model alone: the default path (the compiled reference over the steady form) against the
interpreted reference schedule of the whole step (`exact`), on the issue's reference workload.

Llama-3-70B on 1024 H100s (TP8 PP8 DP16 1F1B, global batch 1024, seq 8192), the points of evaluate_rate.py.
Workloads are generated once, outside the timing, so the figures are the cost model's own. Prints milliseconds per
simulation for both paths, the speed-up, and the largest relative difference of step time and peak memory.
Run: .venv/bin/python benchmarks/simulate_rate.py
"""

import time

from evaluate_rate import points

from dse import plugins
from simulators.analytical import AnalyticalCostModel


def main() -> None:
    generator = plugins.generator("symbolic")
    batch = [(point, generator.generate(point)) for point in points()]
    fast_model, exact_model = AnalyticalCostModel(), AnalyticalCostModel(exact=True)
    timings = {"fast": 0.0, "exact": 0.0}
    worst_step = worst_memory = 0.0
    for point, workload in batch:
        start = time.process_time()
        fast = fast_model.simulate(workload, point.system)
        middle = time.process_time()
        exact = exact_model.simulate(workload, point.system)
        timings["fast"] += middle - start
        timings["exact"] += time.process_time() - middle
        worst_step = max(worst_step, abs(fast.step_time_s / exact.step_time_s - 1))
        worst_memory = max(worst_memory, abs(fast.peak_memory_bytes / exact.peak_memory_bytes - 1))
    n = len(batch)
    print(f"{n} points, {sum(len(p.calls) for p in batch[0][1].programs)} calls in the first workload")
    print(f"  default:   {1e3 * timings['fast'] / n:.1f} ms per simulation ({n / timings['fast']:.0f} per second)")
    print(f"  reference: {1e3 * timings['exact'] / n:.1f} ms per simulation")
    print(
        f"  speed-up {timings['exact'] / timings['fast']:.1f}x; largest difference: step time {worst_step:.2e}, "
        f"peak memory {worst_memory:.2e}"
    )


if __name__ == "__main__":
    main()
