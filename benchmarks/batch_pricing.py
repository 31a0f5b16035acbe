"""Points per CPU-second of a hardware sweep, priced point by point and in one batch, side by side in one process.

One parallel configuration, one generated workload, many systems: `AnalyticalCostModel.simulate` per system on a
sample (the default path, each system's first and only visit), and `simulate_many` on all of them (the
reference schedule recorded once and evaluated for every system at once; `simulators/analytical/batch.py`),
twice: first recording the workload's structure (its tape: a sweep's first batch of a workload), then with the
structure kept (`batch_structure`: the sweep's later batches of it, with systems it has not priced yet).
Two configurations: evaluate_rate.py's Llama-3-70B on 1024 H100s (TP8 PP8 DP16, 1F1B, GBS 1024, seq 8192,
selective recompute, ZeRO-1) and Llama-2-13B on 64 H100s (TP4 PP4 DP4, GBS 512, seq 4096). Two grids each:
- 1,000 systems, HBM size (4) x NVLink bandwidth (5) x InfiniBand bandwidth (5) x accelerator peak FLOP/s (10):
  HBM size changes no duration, so these are 250 distinct timings, each evaluated once;
- 1,000 systems that all time differently: NVLink (10) x InfiniBand (10) x peak FLOP/s (10).
The generated workload is shared by both ways (a sweep generates it once). The process is warmed up first, as a
sweep's evaluator is after its first batch: a fresh process's first batch also pays the kernel's first touch of
its arrays' memory (about 150 MB for Llama-3-70B's 250 timings, 0.3-0.5 s here), printed once on its own line.
The batch's figures are checked against the per-point ones on the sample (largest relative difference of step
time and peak memory printed: both are the reference schedule over the steady form, equal to rounding).
Run: .venv/bin/python benchmarks/batch_pricing.py [--sample 30]
"""

import argparse
import itertools
import time

from dse import plugins
from dse.point.points import assign, build_point, expand
from dse.search.tuning import tune_process
from dse.system import SystemSpec
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.batch_structure import forget

CONFIGURATIONS = {
    "llama3-70b on 1024 H100 (TP8 PP8 DP16)": {
        "model": "llama3-70b",
        "workload": {"seq_len": 8192, "global_batch": 1024, "micro_batch": 1},
        "parallel": {
            "tp": 8,
            "pp": 8,
            "dp": 16,
            "sp": True,
            "pp_schedule": "1f1b",
            "recompute": "selective",
            "zero": 1,
        },
        "system": {"base": "dgx-h100", "network": {1: {"npus": 128}}},
    },
    "llama2-13b on 64 H100 (TP4 PP4 DP4)": {
        "model": "llama2-13b",
        "workload": {"seq_len": 4096, "global_batch": 512, "micro_batch": 1},
        "parallel": {"tp": 4, "pp": 4, "dp": 4, "sp": True, "pp_schedule": "1f1b", "recompute": "selective", "zero": 1},
        "system": {"base": "dgx-h100", "network": {1: {"npus": 8}}},
    },
}
PEAKS = [400, 600, 800, 989, 1200, 1500, 2000, 2500, 3000, 4000]
GRIDS = {
    "HBM x NVLink x IB x peak (250 timings)": list(
        itertools.product([80, 96, 141, 192], [300, 450, 600, 900, 1800], [25, 50, 100, 200, 400], PEAKS)
    ),
    "NVLink x IB x peak (1,000 timings)": list(
        itertools.product(
            [80],
            [200, 300, 450, 600, 750, 900, 1200, 1500, 1800, 3600],
            [12.5, 25, 50, 75, 100, 150, 200, 300, 400, 800],
            PEAKS,
        )
    ),
}

FIRST = next(iter(GRIDS))


def _systems(base: dict, grid: list[tuple[float, float, float, float]]) -> list[SystemSpec]:
    systems = []
    for hbm, nvlink, ib, peak in grid:
        raw = expand(base)
        for path, value in (
            ("system.accelerator.hbm_GiB", hbm),
            ("system.network.0.bandwidth_GBps", nvlink),
            ("system.network.1.bandwidth_GBps", ib),
            ("system.accelerator.peak_tflops.bf16", peak),
        ):
            assign(raw, path, value)
        systems.append(build_point(raw, "benchmark").system)
    return systems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=30, help="systems priced point by point per grid")
    sample_size = parser.parse_args().sample
    tune_process()  # as in a study's evaluator actors
    generator = plugins.generator("symbolic")
    label, base = next(iter(CONFIGURATIONS.items()))
    workload, systems = generator.generate(build_point(expand(base), "benchmark")), _systems(base, GRIDS[FIRST])
    start = time.process_time()
    AnalyticalCostModel().simulate_many(workload, systems)
    print(f"fresh process, {label}, {FIRST}: {len(systems) / (time.process_time() - start):.0f} points/CPU-s")
    for label, base in CONFIGURATIONS.items():
        workload = generator.generate(build_point(expand(base), "benchmark"))
        grids = {name: _systems(base, grid) for name, grid in GRIDS.items()}
        print(label)
        for name, systems in grids.items():
            per_point = AnalyticalCostModel()
            per_point.simulate(workload, _systems(base, [(80, 451, 51, 990)])[0])  # its first visit of the shape
            sample = systems[:: max(1, len(systems) // sample_size)][:sample_size]
            start = time.process_time()
            one_by_one = [per_point.simulate(workload, system) for system in sample]
            point_rate = len(sample) / (time.process_time() - start)
            forget()
            start = time.process_time()
            batch = AnalyticalCostModel().simulate_many(workload, systems)
            batch_rate = len(systems) / (time.process_time() - start)
            start = time.process_time()
            AnalyticalCostModel().simulate_many(workload, systems)
            kept_rate = len(systems) / (time.process_time() - start)
            by_system = dict(zip(map(id, systems), batch, strict=True))
            worst = max(
                max(abs(b.step_time_s / p.step_time_s - 1), abs(b.peak_memory_bytes / p.peak_memory_bytes - 1))
                for p, b in ((p, by_system[id(s)]) for p, s in zip(one_by_one, sample, strict=True))
            )
            steps = [result.step_time_s for result in batch]
            print(
                f"  {name}: per point {point_rate:.0f} points/CPU-s ({len(sample)} systems), "
                f"batch {batch_rate:.0f} points/CPU-s ({len(systems)} systems), {batch_rate / point_rate:.1f}x, "
                f"{kept_rate:.0f} with the structure kept; "
                f"step {min(steps):.2f}-{max(steps):.2f} s; largest difference {worst:.1e}"
            )


if __name__ == "__main__":
    main()
