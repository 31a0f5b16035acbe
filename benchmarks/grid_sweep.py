"""A million-point hardware-planning sweep on this machine: Llama-2-13B on 64 H100s (8 DGX nodes), every point priced.

The space (SPACE below): 96 parallel configurations (tp 1-8 x pp 1-8 x micro-batch 1-2 x recompute none, selective
or full, dp = 64 / (tp x pp), ZeRO-1, sequence parallelism, 1F1B, seq 4096, global batch 512) times 10,800 systems
(NVLink bandwidth 6 x InfiniBand bandwidth 6 x peak bf16 FLOP/s 5 x HBM bandwidth 5 x HBM size 12): 1,036,800 points,
every one a row of the trials table with its metrics, feasibility and Pareto membership.

What is simulated and what is derived, honestly: HBM size changes no duration, so the 12 HBM sizes of a configuration
and timing share one schedule (the batch pricer evaluates systems that differ only in it once, and peak memory is
the same step's): 96 x 900 = 86,400 distinct timings are priced, 1 in 12 of the points; the other 11 are that
timing's figures with HBM capacity, the memory excess and fits_memory computed for their size. Each of those is the
analytical model's reference schedule (`exact`), evaluated for all systems of a configuration at once
(`simulate_many`): the figures `dse evaluate --cost-option exact=true` gives point by point (checked on a sample
below), which the default path matches to rounding.

It runs `dse run` on the study with --sweep --ray --workers 2 (a local Ray, two actors) and prints the command's
wall time (Ray's start, the sweep, the tables, plots and MLflow run), points per second, configurations generated,
distinct timings priced, feasible points and the front's size, then evaluates a sample of rows point by point.
Run: .venv/bin/python benchmarks/grid_sweep.py [--out DIR] [--sample 24]
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

from dse.search.decoding import decode
from dse.search.executor import PluginEvaluation
from dse.search.space import load_study
from dse.search.sweep_grid import SweepGrid

STUDY = {
    "name": "grid-sweep-llama2-13b",
    "objectives": {"step_time": "minimize", "peak_memory": "minimize"},
    "constraints": ["fits_memory"],
    "sampler": "grid",
    "sweep": True,
    "cost_model_options": {"exact": True},
    "tracking": {"child_runs": "none"},
    "base": {
        "model": "llama2-13b",
        "workload": {"seq_len": 4096, "global_batch": 512},
        "parallel": {"sp": True, "zero": 1, "pp_schedule": "1f1b"},
        "system": {"base": "dgx-h100", "network": {1: {"npus": 8}}},
    },
    "space": {
        "parallel.tp": {"choices": [1, 2, 4, 8]},
        "parallel.pp": {"choices": [1, 2, 4, 8]},
        "workload.micro_batch": {"choices": [1, 2]},
        "parallel.recompute": {"choices": ["none", "selective", "full"]},
        "system.network.0.bandwidth_GBps": {"choices": [300, 450, 600, 900, 1200, 1800]},
        "system.network.1.bandwidth_GBps": {"choices": [25, 50, 100, 200, 400, 800]},
        "system.accelerator.peak_tflops.bf16": {"choices": [600, 989.4, 1500, 2000, 2500]},
        "system.accelerator.hbm_bandwidth_GBps": {"choices": [2000, 3350, 4800, 6000, 8000]},
        "system.accelerator.hbm_GiB": {
            "choices": [16, 24, 32, 40, 48, 64, 80, 96, 128, 141, 192, 256],
            "feasibility_only": True,
        },
    },
    "derived": {"parallel.dp": "world / (parallel.tp * parallel.pp)"},
}
TIMELESS = ("system.accelerator.hbm_GiB",)
"""The field no duration reads: points that differ only in it share a priced timing."""
LIMIT_S = 15 * 60


def run_sweep(spec: dict, out: Path) -> tuple[Path, float]:
    """Write the study next to `out`, run it with `dse run --ray --workers 2` and return its file and the command's
    wall time in seconds."""
    study = out.parent / f"{spec['name']}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    study.write_text(yaml.safe_dump(spec, sort_keys=False))
    command = [sys.executable, "-m", "dse.cli", "run", str(study), "--out", str(out), "--ray", "--workers", "2"]
    print("$ " + " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return study, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output folder (default: a fresh temporary one)")
    parser.add_argument("--sample", type=int, default=24, help="rows checked point by point")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="grid-sweep-")) / "out"
    study, wall = run_sweep(STUDY, out)

    spec = load_study(study)
    grid = SweepGrid(spec)
    frame = pd.read_parquet(out / "trials.parquet")
    evaluated = frame[frame["state"] != "PRUNED"]
    structures = evaluated[grid.structure_names].drop_duplicates()
    timing = [name for name in grid.names if name not in TIMELESS]
    feasible = frame[(frame["state"] == "COMPLETE") & (frame["feasible"] == True)]  # noqa: E712
    print(f"points                 {len(frame):,} ({grid.size:,} in the grid)")
    print(f"wall time              {wall:.1f} s for the whole command ({'under' if wall < LIMIT_S else 'OVER'} 15 min)")
    print(f"points per second      {len(frame) / wall:,.0f}")
    print(f"configurations         {len(structures):,} generated (of {grid.structures:,})")
    print(f"distinct timings       {len(evaluated[timing].drop_duplicates()):,} priced for {len(evaluated):,} points")
    states = frame["state"].value_counts()
    print(f"pruned before pricing  {states.get('PRUNED', 0):,}; failed {states.get('FAIL', 0):,}")
    print(f"feasible points        {len(feasible):,}")
    print(f"Pareto front           {int(frame['pareto'].sum()):,} points")

    sample = frame[frame["state"] == "COMPLETE"].sample(min(args.sample, len(frame)), random_state=0)
    evaluate = PluginEvaluation(spec.generator, spec.cost_model, {"exact": True})
    worst = 0.0
    for _, row in sample.iterrows():
        point = decode(spec, grid.params_of(int(row["number"])))
        assert not isinstance(point, str), point
        metrics = evaluate(point)["metrics"]
        for name in ("step_time_s", "peak_memory_bytes", "mfu", "memory_excess_bytes"):
            worst = max(worst, abs(row[name] - metrics[name]) / max(abs(metrics[name]), 1e-30))
    print(
        f"point-by-point check   {len(sample)} rows against dse evaluate (exact): worst relative difference {worst:.1e}"
    )


if __name__ == "__main__":
    main()
