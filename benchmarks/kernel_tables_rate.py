"""Points per second per core with measured kernel tables against the roofline (issue 31: at least 80%).

The study-like sample of `evaluate_rate.py` (Llama-3-70B on 1024 H100s, 18 parallel configurations on 12 systems,
216 points shuffled, none reused), once with `kernel_source: roofline` and once with `kernel_source: tables` (the
catalog H100's measured tables, its default), each in a fresh process so that both pay their first visits (the
tables' one read included), interleaved A B A B so that the machine's load falls on both alike. Then a hardware
sweep through the batch path (`price_many`): one workload on 36 accelerators (peak FLOP/s x HBM bandwidth), where
every distinct accelerator prices its GEMMs anew.
Run: .venv/bin/python benchmarks/kernel_tables_rate.py
"""

import statistics
import subprocess
import sys
import time

from evaluate_rate import study_sample

from dse import plugins
from dse.point.evaluate import evaluate
from dse.point.points import assign, build_point, expand
from dse.search.tuning import tune_process
from simulators.analytical.batch import price_many

ROUNDS = 3


def with_source(point, source: str):
    """The point priced by its catalog H100's kernel tables (the default) or by the roofline."""
    raw = point.model_dump(mode="json", exclude_none=True)
    assign(raw, "system.accelerator.kernel_source", source)
    return build_point(raw, "benchmark")


def sample_rate(source: str) -> float:
    """The study-like sample's rate in this (fresh) process."""
    tune_process()
    generator, cost_model = plugins.generator("symbolic"), plugins.cost_model("analytical")
    plugins.objectives()
    sample = [with_source(point, source) for point in study_sample()]
    start = time.process_time()
    for point in sample:
        evaluate(point, generator, cost_model)
    return len(sample) / (time.process_time() - start)


def sweep_rate(source: str) -> float:
    """Systems per second per core through the batch path, 36 distinct accelerators."""
    raw = expand(
        {
            "model": "llama3-70b",
            "workload": {"seq_len": 8192, "global_batch": 1024, "micro_batch": 1},
            "parallel": {"tp": 8, "pp": 8, "dp": 16, "sp": True, "pp_schedule": "1f1b", "recompute": "selective"},
            "system": {"base": "dgx-h100", "network": {1: {"npus": 128}}},
        }
    )
    point = with_source(build_point(raw, "benchmark"), source)
    workload = plugins.generator("symbolic").generate(point)
    systems = []
    for peak in (600, 800, 989.4, 1200, 1600, 2000):
        for bandwidth in (2000, 3350, 4800, 6000, 8000, 10000):
            accelerator = point.system.accelerator.model_copy(
                update={"peak_tflops": {"bf16": peak}, "hbm_bandwidth_GBps": bandwidth}
            )
            systems.append(point.system.model_copy(update={"accelerator": accelerator}))
    start = time.process_time()
    price_many(workload, systems)
    return len(systems) / (time.process_time() - start)


def main() -> None:
    rates: dict[str, list[float]] = {"roofline": [], "tables": []}
    for _ in range(ROUNDS):
        for source in rates:
            run = subprocess.run([sys.executable, __file__, source], capture_output=True, text=True, check=True)
            rates[source].append(float(run.stdout))
    sample = {source: statistics.median(values) for source, values in rates.items()}
    print("study-like sample (216 points of Llama-3-70B on 1024 H100s), points per second per core, fresh processes:")
    for source, values in rates.items():
        print(f"  {source:8s} {' '.join(f'{v:.1f}' for v in values)} (median {sample[source]:.1f})")
    print(f"  tables / roofline: {sample['tables'] / sample['roofline']:.0%} (target at least 80%)")
    sweeps: dict[str, list[float]] = {"roofline": [], "tables": []}
    for _ in range(ROUNDS):
        for source, values in sweeps.items():
            values.append(sweep_rate(source))
    sweep = {source: statistics.median(values) for source, values in sweeps.items()}
    print(f"batch sweep of one workload on 36 accelerators, systems per second per core (medians of {ROUNDS}):")
    print(
        f"  roofline {sweep['roofline']:.1f}, tables {sweep['tables']:.1f}: {sweep['tables'] / sweep['roofline']:.0%}"
    )


if __name__ == "__main__":
    print(sample_rate(sys.argv[1])) if sys.argv[1:] in (["roofline"], ["tables"]) else main()
