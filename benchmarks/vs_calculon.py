"""dse against Calculon (NVIDIA's analytical LLM training model) on the same work, alternating the two in one run.

The work (issue 36): GPT-3 175B with unfused attention and dropout (Calculon's models/gpt3-175B.json; dse's catalog
gpt3-175b with `flash_attention: false, dropout: true`), sequence 2048, global batch 1536, on 1,024 H100s (Calculon's
systems/h100_80g_nvl8.json; dse's dgx-h100 scaled to 128 nodes), over 96 configurations: tp {4, 8} x pp {8, 16} x
micro-batch {1, 2} x recompute {none, selective, full} x sp {on, off} x ZeRO {0, 1}, 1F1B, dp = 1024 / (tp x pp).
Calculon's names for these: recompute selective is its attn_only, sp its rs_ag tensor-parallel communication (ar
without), ZeRO-1 its optimizer sharding; data-parallel overlap is on, as dse's overlap_grad_reduce default.

Two measurements, in CPU time (time.process_time, each tool's own process, so the other's work and the machine's
other load do not count; the load averages are printed because a busy core still slows both):
- One point at a time, as a study prices its trials: dse through a trial's entry point (`PluginEvaluation`:
  generate the workload, price it with the analytical model, every objective; the DesignPoint is built before the
  clock starts, as a study's driver builds it), Calculon through its Python API (Application, Execution and System
  built from their JSON's dicts, Llm compiled and run, all timed) in a subprocess of its own venv, fed one
  configuration at a time, so the two alternate point by point. Both processes are warmed first with points of
  other global batches (`WARM_BATCHES`). Round 0 is each configuration's first visit in this process; the later
  rounds visit them again on another system (InfiniBand 1 GB/s slower each round, for both tools), so no result is
  reused but what dse keeps per schedule shape may be. Each round goes through the configurations in a shuffled
  (seeded) order, as a study does. Printed per round: points per CPU-second, median and max CPU time per point,
  and the ratio; then every configuration's cost and step time in both tools, the configurations over 5x the median
  marked. A configuration's cost is the median of its revisits, three by default (`--rounds 4`): with two, the
  median is their mean, and one collector pause or burst of page faults landing on one revisit (up to 15-20 ms,
  at whichever point the process's allocations reach it: a change anywhere in the process moved it off GPT-3
  tp4 pp16 mb1 zero0's second revisit, where it sat in 5 of 7 runs at 2026-11-30's code) flagged a configuration
  whose other visits cost 2-4 ms. The rates count every point, those pauses included.
- A hardware grid of 1,000 systems per configuration (NVLink 10 x InfiniBand 10 x peak FLOP/s 10), for every
  `--grid-every`-th configuration: dse's batch path (`AnalyticalCostModel.simulate_many`, as a sweep calls it) on its
  first batch (the workload generated and its structure recorded) and again with the structure kept, and Calculon
  pricing the same 1,000 systems one by one; alternated configuration by configuration.
`--profile K` then prints cProfile's top functions (by cumulative time) for the K costliest configurations.

Without `--calculon`, only dse's figures are printed. Calculon is never fetched; to make one:
  git clone https://github.com/calculon-ai/calculon && python -m venv calculon/.venv &&
  calculon/.venv/bin/pip install -e calculon numpy pandas psutil
Run: nice .venv/bin/python benchmarks/vs_calculon.py [--calculon PATH] [--rounds 4] [--grid-every 5] [--profile 2]
PATH is a Calculon checkout with a venv in .venv (or venv), or the python of an environment that imports calculon.
"""

import argparse
import cProfile
import itertools
import json
import os
import pstats
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dse import lru, plugins
from dse.point.points import build_point, expand
from dse.search.executor import PluginEvaluation
from dse.search.tuning import tune_process
from dse.spec import DesignPoint
from dse.system import SystemSpec
from simulators.analytical import AnalyticalCostModel
from simulators.analytical.batch_structure import forget

GPUS = 1024
SEQ = 2048
GLOBAL_BATCH = 1536
"""GPT-3 175B's 3.2M tokens per step at sequence 2048 (Brown et al. 2020, table 2.1)."""
SLOW = 5.0
"""Issue 36's bound: no configuration over this many times the median per-point cost."""
GRID = list(
    itertools.product(
        [200, 300, 450, 600, 750, 900, 1200, 1500, 1800, 3600],  # NVLink GB/s
        [12.5, 25, 50, 75, 100, 150, 200, 300, 400, 800],  # InfiniBand GB/s
        [400, 600, 800, 1000, 1200, 1500, 2000, 2500, 3000, 4000],  # peak 16-bit TFLOP/s
    )
)
"""benchmarks/batch_pricing.py's grid of 1,000 systems that all time differently."""


WARM_BATCHES = (GLOBAL_BATCH // 3, 2 * GLOBAL_BATCH // 3)
"""The global batches of the points each tool prices before the clock starts, none a structure measured: imports and
plugins, and (the second, whose micro-batches make a steady form where the first's make none) every compiled kernel
dse's default path calls, which a process loads from numba's disk cache on its first call (about 5 ms each, a study's
worker pays them once), where a first visit would otherwise pay for whichever configuration came first."""


@dataclass(frozen=True)
class Configuration:
    tp: int
    pp: int
    micro_batch: int
    recompute: str
    sp: bool
    zero: int

    @property
    def dp(self) -> int:
        return GPUS // (self.tp * self.pp)

    def __str__(self) -> str:
        micro_batches = GLOBAL_BATCH // self.dp // self.micro_batch
        return (
            f"tp{self.tp} pp{self.pp:<2} mb{self.micro_batch} {self.recompute:<9} sp {'on ' if self.sp else 'off'} "
            f"zero{self.zero} ({micro_batches:>3} micro-batches)"
        )


CONFIGURATIONS = [
    Configuration(*values)
    for values in itertools.product((4, 8), (8, 16), (1, 2), ("none", "selective", "full"), (True, False), (0, 1))
]


@dataclass(frozen=True)
class Hardware:
    """What a point changes of the catalog's DGX H100 and Calculon's H100 NVL8; peak None: each file's own (dse
    989.4 dense bf16 TFLOP/s, Calculon 1,000 float16)."""

    nvlink_GBps: float = 450
    ib_GBps: float = 50
    peak_tflops: float | None = None


def dse_point(config: Configuration, hardware: Hardware, global_batch: int = GLOBAL_BATCH) -> DesignPoint:
    system: dict = {
        "base": "dgx-h100",
        "network": {
            0: {"bandwidth_GBps": hardware.nvlink_GBps},
            1: {"npus": GPUS // 8, "bandwidth_GBps": hardware.ib_GBps},
        },
    }
    if hardware.peak_tflops is not None:
        system["accelerator"] = {"peak_tflops": {"bf16": hardware.peak_tflops}}
    raw = {
        "model": {"base": "gpt3-175b", "flash_attention": False, "dropout": True},
        "workload": {"seq_len": SEQ, "global_batch": global_batch, "micro_batch": config.micro_batch},
        "parallel": {
            "tp": config.tp,
            "pp": config.pp,
            "dp": config.dp,
            "sp": config.sp,
            "zero": config.zero,
            "recompute": config.recompute,
            "pp_schedule": "1f1b",
        },
        "system": system,
    }
    return build_point(expand(raw), "vs_calculon")


def calculon_job(config: Configuration, hardware: Hardware, global_batch: int = GLOBAL_BATCH) -> list[dict]:
    execution = {
        "num_procs": GPUS,
        "tensor_par": config.tp,
        "pipeline_par": config.pp,
        "data_par": config.dp,
        "tensor_par_net": 0,
        "pipeline_par_net": 1,
        "data_par_net": 1,
        "batch_size": global_batch,
        "microbatch_size": config.micro_batch,
        "datatype": "float16",
        "fused_activation": True,
        "attention_type": "multihead",
        "activation_recompute": {"selective": "attn_only"}.get(config.recompute, config.recompute),
        "pipeline_interleaving": 1,
        "optimizer_sharding": config.zero == 1,
        "tensor_par_comm_type": "rs_ag" if config.sp else "ar",
        "tensor_par_overlap": "none",
        "seq_par_ag_redo": False,
        "data_par_overlap": True,
        "weight_offload": False,
        "activations_offload": False,
        "optimizer_offload": False,
        "training": True,
    }
    return [execution, {"nvlink": hardware.nvlink_GBps, "ib": hardware.ib_GBps, "tflops": hardware.peak_tflops}]


DRIVER = """
import copy, json, logging, sys, time
from pathlib import Path
import calculon
from calculon.llm import Llm
from calculon.system import System
root = Path(sys.argv[1]) if sys.argv[1:] else Path(calculon.__file__).resolve().parents[1]
files = root / "models" / "gpt3-175B.json", root / "systems" / "h100_80g_nvl8.json"
if not all(f.exists() for f in files):
    sys.exit(f"{files[0]} or {files[1]} is missing: give --calculon a Calculon checkout")
application, machine = (json.loads(f.read_text()) for f in files)
log = logging.getLogger("calculon")
def price(execution, hardware):
    spec = copy.deepcopy(machine)
    spec["networks"][0]["bandwidth"], spec["networks"][1]["bandwidth"] = hardware["nvlink"], hardware["ib"]
    if hardware["tflops"] is not None:
        spec["matrix"]["float16"]["tflops"] = hardware["tflops"]
    began = time.process_time()
    model, system, error = Llm(Llm.Application(application), log), System(spec), None
    try:
        model.compile(system, Llm.Execution.from_json(execution))
        model.run(system)
    except Llm.Error as exc:
        error = str(exc)
    try:
        step = model.get_total_time()
    except Exception:
        step = None
    return [time.process_time() - began, step, error]
for line in sys.stdin:
    print(json.dumps([price(*job) for job in json.loads(line)]), flush=True)
"""
"""Calculon's side, run by the python of its venv (`python -c DRIVER [checkout]`): one line of jobs in, one line
of [CPU seconds, step seconds, error] out. A point Calculon refuses for memory is priced in full before its check."""


class Calculon:
    """A Calculon process that prices jobs as they come, so that its points alternate with dse's."""

    def __init__(self, path: Path) -> None:
        if path.is_dir():
            pythons = [path / venv / "bin" / "python" for venv in (".venv", "venv")]
            python = next((p for p in pythons if p.exists()), None)
            if python is None:
                _refuse(
                    f"--calculon {path}: no {pythons[0]}; make it with `python -m venv {path}/.venv && "
                    f"{path}/.venv/bin/pip install -e {path} numpy pandas psutil`"
                )
            command = [str(python), "-c", DRIVER, str(path)]
        elif path.is_file():
            command = [str(path), "-c", DRIVER]
        else:
            _refuse(f"--calculon {path}: no such checkout or python; give a Calculon checkout or its python")
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def price(self, jobs: list[list[dict]]) -> list[tuple[float, float | None, str | None]]:
        assert self._process.stdin is not None and self._process.stdout is not None
        try:
            self._process.stdin.write(json.dumps(jobs) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass
        line = self._process.stdout.readline()
        if not line:
            assert self._process.stderr is not None
            last = (self._process.stderr.read().strip().splitlines() or ["(nothing on stderr)"])[-1]
            _refuse(f"--calculon: the Calculon process stopped ({last}); give a checkout with its venv, or its python")
        return [tuple(row) for row in json.loads(line)]

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait()


def _refuse(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


@dataclass
class Costs:
    """One tool's CPU seconds per configuration in each round, and its last step time per configuration."""

    seconds: list[dict[Configuration, float]]
    step_s: dict[Configuration, float | None]
    refused: dict[Configuration, str | None]


def per_point(evaluation: PluginEvaluation, calculon: Calculon | None, rounds: int) -> tuple[Costs, Costs | None]:
    dse = Costs([], {}, {})
    other = None if calculon is None else Costs([], {}, {})
    for round_ in range(rounds):
        hardware = Hardware(ib_GBps=50 - round_)
        order = list(CONFIGURATIONS)
        random.Random(round_).shuffle(order)
        points = {config: dse_point(config, hardware) for config in order}
        dse.seconds.append({})
        if other is not None:
            other.seconds.append({})
        for config in order:
            began = time.process_time()
            metrics = evaluation(points[config])["metrics"]
            dse.seconds[-1][config] = time.process_time() - began
            dse.step_s[config] = float(metrics["step_time_s"])
            dse.refused[config] = None if metrics["fits_memory"] else "over HBM"
            if other is not None and calculon is not None:
                ((seconds, step, error),) = calculon.price([calculon_job(config, hardware)])
                other.seconds[-1][config], other.step_s[config], other.refused[config] = seconds, step, error
    return dse, other


def _summary(name: str, seconds: dict[Configuration, float]) -> tuple[float, str]:
    values = list(seconds.values())
    rate = len(values) / sum(values)
    median, worst = statistics.median(values), max(values)
    return rate, f"{name} {rate:7.1f} points/CPU-s, median {1e3 * median:6.1f} ms, max {1e3 * worst:6.1f} ms"


def report_per_point(dse: Costs, other: Costs | None) -> dict[Configuration, float]:
    """Prints the rounds and every configuration; returns dse's cost per configuration (revisits' median)."""
    ratios = []
    for round_, seconds in enumerate(dse.seconds):
        rate, line = _summary("dse", seconds)
        label = "first visit" if round_ == 0 else f"revisit {round_}"
        if other is not None:
            other_rate, other_line = _summary("Calculon", other.seconds[round_])
            ratios.append(rate / other_rate)
            line += f" | {other_line} | dse/Calculon {rate / other_rate:.3f}"
        print(f"  {label:<12} {line}")
    if len(ratios) > 1:
        print(f"  dse/Calculon: first visit {ratios[0]:.3f}, revisits' median {statistics.median(ratios[1:]):.3f}")
    revisits = dse.seconds[1:] or dse.seconds
    cost = {config: statistics.median(r[config] for r in revisits) for config in CONFIGURATIONS}
    median = statistics.median(cost.values())
    slow = [config for config in CONFIGURATIONS if cost[config] > SLOW * median]
    print("per configuration, CPU ms (dse: first visit, revisits' median; Calculon: median) and step time (s):")
    for config in CONFIGURATIONS:
        line = f"  {config}  dse {1e3 * dse.seconds[0][config]:6.1f} {1e3 * cost[config]:6.1f}"
        if other is not None:
            calculon_ms = 1e3 * statistics.median(r[config] for r in other.seconds)
            line += f"  Calculon {calculon_ms:5.2f}"
        line += f"  step dse {dse.step_s[config]:6.2f}{' (over HBM)' if dse.refused[config] else ''}"
        if other is not None:
            step = other.step_s[config]
            line += (
                f" Calculon {'-' if step is None else f'{step:6.2f}'}{' (refused)' if other.refused[config] else ''}"
            )
        print(line + ("  SLOW" if config in slow else ""))
    print(f"  {len(slow)} of {len(CONFIGURATIONS)} configurations over {SLOW:g}x the median ({1e3 * median:.1f} ms)")
    return cost


def grid(every: int, calculon: Calculon | None) -> None:
    hardware = [Hardware(*values) for values in GRID]
    systems: list[SystemSpec] = [dse_point(CONFIGURATIONS[0], h).system for h in hardware]
    generator, cost_model = plugins.generator("symbolic"), AnalyticalCostModel()
    rates: dict[str, list[float]] = {"first": [], "kept": [], "calculon": []}
    for config in CONFIGURATIONS[::every]:
        point = dse_point(config, Hardware())
        forget()
        began = time.process_time()
        workload = generator.generate(point)
        cost_model.simulate_many(workload, systems)
        first = time.process_time() - began
        began = time.process_time()
        cost_model.simulate_many(workload, systems)
        kept = time.process_time() - began
        rates["first"].append(len(systems) / first)
        rates["kept"].append(len(systems) / kept)
        line = f"  {config}  dse first batch {rates['first'][-1]:6.0f}, structure kept {rates['kept'][-1]:6.0f}"
        if calculon is not None:
            priced = calculon.price([calculon_job(config, h) for h in hardware])
            rates["calculon"].append(len(priced) / sum(row[0] for row in priced))
            line += f"  Calculon {rates['calculon'][-1]:6.0f}"
        print(line + " points/CPU-s")
    first, kept = statistics.median(rates["first"]), statistics.median(rates["kept"])
    line = f"  median: dse first batch {first:.0f}, structure kept {kept:.0f} points/CPU-s"
    if rates["calculon"]:
        other = statistics.median(rates["calculon"])
        line += f", Calculon {other:.0f}; dse/Calculon {first / other:.2f} first batch, {kept / other:.2f} kept"
    print(line)


def profile(evaluation: PluginEvaluation, cost: dict[Configuration, float], count: int, rounds: int) -> None:
    for config in sorted(cost, key=cost.__getitem__, reverse=True)[:count]:
        point = dse_point(config, Hardware(ib_GBps=50 - rounds))
        profiler = cProfile.Profile()
        profiler.runcall(evaluation, point)
        print(f"cProfile of {config} (revisit median {1e3 * cost[config]:.0f} ms), by cumulative time:")
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(18)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calculon", type=Path, help="a Calculon checkout with a venv, or a python importing it")
    parser.add_argument("--rounds", type=int, default=4, help="per-point rounds (the first is the first visit)")
    parser.add_argument("--grid-every", type=int, default=5, help="the grid for every n-th configuration; 0: none")
    parser.add_argument("--profile", type=int, default=0, help="cProfile the K costliest configurations")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: at least 1 (the first visit)")
    tune_process()  # as in a study's evaluator actors
    loads = [os.getloadavg()]
    evaluation = PluginEvaluation("symbolic", "analytical")
    calculon = None if args.calculon is None else Calculon(args.calculon)
    for warm_batch in WARM_BATCHES:
        evaluation(dse_point(CONFIGURATIONS[0], Hardware(), global_batch=warm_batch))
        if calculon is not None:
            calculon.price([calculon_job(CONFIGURATIONS[0], Hardware(), warm_batch)])
    print(
        f"GPT-3 175B (unfused attention), seq {SEQ}, global batch {GLOBAL_BATCH}, {GPUS} H100, "
        f"{len(CONFIGURATIONS)} configurations; one point at a time, warm:"
    )
    dse, other = per_point(evaluation, calculon, args.rounds)
    cost = report_per_point(dse, other)
    loads.append(os.getloadavg())
    if args.grid_every > 0:
        print(
            f"a grid of {len(GRID)} systems (NVLink x InfiniBand x peak FLOP/s) per configuration, "
            f"every {args.grid_every}th configuration, points per CPU-second:"
        )
        grid(args.grid_every, calculon)
        loads.append(os.getloadavg())
    if calculon is not None:
        calculon.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(
        f"peak RSS of this process {rss:.0f} MiB; load averages (1, 5, 15 min) at start, after the per-point "
        f"rounds{', after the grid' if args.grid_every > 0 else ''}: "
        + "; ".join(" ".join(f"{x:.2f}" for x in load) for load in loads)
        + f" on {os.cpu_count()} CPUs"
    )
    print(lru.summary())
    if args.profile:
        profile(evaluation, cost, args.profile, args.rounds)


if __name__ == "__main__":
    main()
