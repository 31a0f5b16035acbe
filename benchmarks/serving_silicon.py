"""dse's serving latencies against measured ones: aiconfigurator-core's silicon_sample.csv (TTFT and TPOT of real
aggregated deployments), row by row. The measurements are only compared with; nothing in dse is set from them.

Each aggregated row of a model the catalog has, on H100 or H200 SXM, becomes the serving point that copies what
was run: the model (Llama-3.1-70B is llama3-70b; Llama-3.1-8B llama3-8b; DeepSeek-R1 has DeepSeek-V3's architecture,
so both are deepseek-v3), the precision (fp8: model.dtype fp8; none given: bf16; int4/fp4 rows are skipped), one
worker of tp_size GPUs (tp_size x attention_dp_size with attention data parallelism) on one node, the benchmark's
concurrency (silicon_concurrency in silicon_data_source: the whole worker's, batch_size being per attention rank),
and the server and client settings of the harness that measured it (HARNESSES). It is priced at the steady state,
and a sample of rows also by the event simulation, as many requests as the benchmark sent (10 per client): once
with dse's warm-up left out, once measuring every request as the benchmark did (its first wave, every client's
first request sent at once, included).

Signed errors are (dse - measured) / measured. Rows that dse cannot express or price are counted by reason.
Run: .venv/bin/python benchmarks/serving_silicon.py [--events 10] [--rows N] [--out table.csv]
"""

import argparse
import copy
import csv
import math
import random
import re
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dse import plugins
from dse.errors import DseError
from dse.interfaces import CostModel, WorkloadGenerator
from dse.point.evaluate import evaluate
from dse.point.points import build_point, expand
from dse.serving import events
from dse.serving.deployment import deployment
from dse.serving.iteration import pricer
from dse.serving.requests import requests
from dse.spec import DesignPoint
from dse.tables.source import data_root

MODELS = {
    "meta-llama/Llama-3.1-70B": "llama3-70b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama3-8b",
    "nvidia/Llama-3.1-8B-Instruct-FP8": "llama3-8b",
    "deepseek-ai/DeepSeek-V3": "deepseek-v3",
    "deepseek-ai/DeepSeek-R1": "deepseek-v3",
}
SYSTEMS = {"h100_sxm": "dgx-h100", "h200_sxm": "dgx-h200"}
NODE_GPUS = 8
PRECISIONS = {"bf16": "bf16", "fp16": "bf16", "fp8": "fp8", "fp8_block": "fp8"}
"""The rows' precisions dse prices (as model.dtype; fp8_block, DeepSeek's block-scaled fp8, as fp8); int4, fp4 and
other rows are skipped and counted."""


@dataclass(frozen=True)
class Harness:
    """What a measurement's server and client ran with, as the serving point's scheduler, cache and requests."""

    max_batched_tokens: int | None
    """vLLM max_num_batched_tokens, TensorRT-LLM max_num_tokens, SGLang max_prefill_tokens; None: InferenceMAX's
    DeepSeek TensorRT-LLM rule, the concurrency + ISL + 64 rounded up to 64, at least 8192."""
    chunked_prefill: bool
    """False for SGLang, which runs prefill batches apart from decode batches."""
    max_num_seqs: int | None
    """None: the concurrency (InferenceMAX sets vLLM's max_num_seqs to it)."""
    kv_dtype: str
    """The cache's dtype: fp8 where the harness sets it; bf16 for each framework's 'auto' (the activations' dtype,
    whatever the weights')."""
    memory_fraction: float
    """vLLM gpu_memory_utilization, SGLang mem_fraction_static, TensorRT-LLM free_gpu_memory_fraction."""
    free_fraction: bool
    """TensorRT-LLM's free_gpu_memory_fraction: the cache gets that share of what the weights and activations
    leave, where vLLM's gpu_memory_utilization and SGLang's mem_fraction_static are shares of the whole HBM."""
    range_ratio: float | None
    """InferenceMAX's --random-range-ratio: lengths uniform over [int(ratio x L), L]; None: every request L."""


# InferenceMAX (its benchmarks/*.sh of the measurement dates: 70b_fp8_h{1,2}00_slurm.sh, 70b_fp8_h200_trt_slurm.sh,
# single_node/dsr1_fp8_h200{,_trt}.sh; client kimbochen/bench_serving, range ratio 0.8, 10 prompts per client).
# The aic-auto-gap-analysis rows (NVIDIA's) name no settings: each framework's defaults, fixed lengths.
HARNESSES: dict[tuple[str, str, str], Harness] = {
    # vllm serve --kv-cache-dtype fp8 --max-num-batched-tokens 8192 --max-num-seqs CONC --gpu-memory-utilization 0.9
    ("inferencemax", "vllm", "llama"): Harness(8192, True, None, "fp8", 0.9, False, 0.8),
    # trtllm-serve --max_num_tokens 16384, kv_cache_config.dtype fp8; no chunked prefill (the default), so whole
    # prompts (<= 8192 tokens, never split) share iterations with decodes: chunked_prefill with a 16384 budget.
    ("inferencemax", "trtllm", "llama"): Harness(16384, True, None, "fp8", 0.9, True, 0.8),
    # sglang --chunked-prefill-size 32768 --max-prefill-tokens 32768 --mem-fraction-static 0.82; KV auto (bf16)
    ("inferencemax", "sglang", "deepseek"): Harness(32768, False, None, "bf16", 0.82, False, 0.8),
    # trtllm-serve max_num_tokens max(8192, CONC + ISL + 64 rounded up to 64), free_gpu_memory_fraction 0.75, fp8 KV
    ("inferencemax", "trtllm", "deepseek"): Harness(None, True, None, "fp8", 0.75, True, 0.8),
    # trtllm-serve 1.0 defaults: max_num_tokens 8192, max_batch_size 2048, KV auto (bf16 checkpoint), 0.9 free
    ("nvidia", "trtllm", "llama"): Harness(8192, True, 2048, "bf16", 0.9, True, None),
    # SGLang 0.5.6 defaults: max_prefill_tokens 16384, prefill apart from decodes, KV auto: bf16
    ("nvidia", "sglang", "llama"): Harness(16384, False, None, "bf16", 0.9, False, None),
    # vLLM 0.12 defaults (>= 70 GiB GPUs, API server): 8192 tokens, 1024 sequences, 0.9; KV auto is the model's
    # bf16 (the checkpoint's kv_cache_quant_algo is honoured only from vllm-project/vllm#29980, after 0.12.0)
    ("nvidia", "vllm", "llama"): Harness(8192, True, 1024, "bf16", 0.9, False, None),
}


@dataclass(frozen=True)
class Case:
    """One measured row as a serving point to price."""

    row: dict[str, str]
    raw: dict[str, Any]
    """The point's data (before the TensorRT-LLM memory fraction, which needs the point's weights)."""
    harness: Harness
    concurrency: int
    layout: str
    cv: float
    """The coefficient of variation of the benchmark's lengths (0: fixed), for the event simulation."""


def source_of(row: dict[str, str]) -> str:
    text = row["silicon_data_source"]
    if "aic-auto-gap-analysis" in text:
        return "nvidia"
    return "inferencemax" if text.startswith(("db-dump/", "source_file=20")) else "unknown"


def mean_length(length: int, ratio: float | None) -> tuple[int, float]:
    """The mean of the benchmark's lengths around `length`, and their coefficient of variation (a uniform draw of
    whole tokens over [int(ratio x L), L] is, to a token, dse's uniform of that mean and cv)."""
    if ratio is None:
        return length, 0.0
    low = int(length * ratio)
    mean = (low + length) / 2
    return round(mean), (length - low) / (2 * math.sqrt(3) * mean)


def case_of(row: dict[str, str]) -> Case | str:
    """The serving point of a row, or why it has none."""
    precision = (row["precision"] or row["gemm_quant_mode"] or "bf16").lower()
    if precision not in PRECISIONS:
        return f"precision {precision}"
    model = MODELS[row["model_path"]]
    family = "deepseek" if model.startswith("deepseek") else "llama"
    harness = HARNESSES.get((source_of(row), row["backend"], family))
    if harness is None:
        return f"no known harness for {source_of(row)} {row['backend']}"
    found = re.search(r"silicon_concurrency=(\d+)", row["silicon_data_source"])
    if found is None:
        return "no silicon_concurrency"
    concurrency = int(found.group(1))
    tp, pp = int(float(row["tp_size"])), int(float(row["pp_size"]))
    adp = int(float(row["attention_dp_size"] or 1))
    ep = int(float(row["moe_ep_size"] or 1))
    if tp * pp * adp > NODE_GPUS:
        return "layout beyond one node (tp x pp x attention_dp > 8; the id names 8 GPUs)"
    if round(float(row["batch_size"])) * adp != concurrency:
        return "batch_size x attention_dp != silicon_concurrency"
    if adp > 1 and (tp > 1 or ep != adp):
        return "attention DP with TP or EP != DP"
    if adp == 1 and ep > 1:
        return "attention TP with MoE EP (dse carves EP from DP)"
    parallel = {"tp": tp, "pp": pp, "dp": adp} | ({"ep": ep} if ep > 1 else {})
    isl, isl_cv = mean_length(int(row["isl"]), harness.range_ratio)
    osl, osl_cv = mean_length(int(row["osl"]), harness.range_ratio)
    tokens = harness.max_batched_tokens or max(8192, -(-(concurrency + int(row["isl"]) + 64) // 64) * 64)
    serving: dict[str, Any] = {
        "isl": isl,
        "osl": osl,
        "concurrency": concurrency,
        "scheduler": {
            "max_num_seqs": harness.max_num_seqs or concurrency,
            "max_batched_tokens": tokens,
            "chunked_prefill": harness.chunked_prefill,
            # TensorRT-LLM's default capacity policy, GUARANTEED_NO_EVICT, reserves prompt + output per request
            "admission": "reserve" if row["backend"] == "trtllm" else "grow",
        },
        "kv_cache": {"memory_fraction": harness.memory_fraction, "dtype": harness.kv_dtype},
    }
    dtype = PRECISIONS[precision]
    world = tp * pp * adp
    raw = {
        "model": {"base": model, "dtype": dtype},
        "workload": {"mode": "serve", "serving": serving},
        "parallel": parallel,
        "system": {"base": SYSTEMS[row["system"]], "network": {0: {"npus": world}, 1: {"npus": 1}}},
    }
    layout = f"tp{tp}" + (f"pp{pp}" if pp > 1 else "") + (f"dp{adp}ep{ep}" if adp > 1 else "")
    return Case(row, raw, harness, concurrency, layout, min(isl_cv, osl_cv))


def with_depth(case: Case, events: bool) -> dict[str, Any]:
    """The point's data at the steady state, or in the event simulation with the benchmark's requests: 10 per
    client, lengths spread as its client drew them."""
    if not events:
        return case.raw
    serving = case.raw["workload"]["serving"] | {"depth": "events", "requests": 10 * case.concurrency}
    if case.cv:
        serving["lengths"] = {"distribution": "uniform", "cv": round(case.cv, 4)}
    return case.raw | {"workload": {"mode": "serve", "serving": serving}}


def point_of(case: Case, events: bool, generator: WorkloadGenerator, cost_model: CostModel) -> DesignPoint:
    """The case's point; under TensorRT-LLM's free-memory fraction f, the HBM share that leaves the cache f of what
    the weights and the largest iteration's working memory leave (dse's memory_fraction is of the whole HBM)."""
    raw = copy.deepcopy(with_depth(case, events))
    point = build_point(expand(raw), case.row["id"])
    if not case.harness.free_fraction:
        return point
    prices = pricer(point, generator, cost_model)
    serving = point.workload.serving
    assert serving is not None
    held = prices.weight_bytes() + prices.working_bytes(serving.scheduler.max_batched_tokens)
    f = case.harness.memory_fraction
    share = f + (1 - f) * held / point.system.accelerator.hbm_bytes
    cache = raw["workload"]["serving"]["kv_cache"] | {"memory_fraction": min(round(share, 6), 1.0)}
    raw["workload"]["serving"]["kv_cache"] = cache
    return build_point(expand(raw), case.row["id"])


def price(case: Case, generator: WorkloadGenerator, cost_model: CostModel) -> tuple[float, float] | str:
    """Steady-state (TTFT, TPOT) in seconds, or why the point cannot be priced."""
    try:
        metrics = evaluate(point_of(case, False, generator, cost_model), generator, cost_model).metrics
    except DseError as exc:
        return str(exc).split(";")[0][:90]
    return float(metrics["ttft_mean_s"]), float(metrics["tpot_mean_s"])


def simulate(case: Case, generator: WorkloadGenerator, cost_model: CostModel) -> list[tuple[float, float]] | str:
    """Event-simulated mean (TTFT, TPOT) in seconds: with dse's warm-up (the first tenth of the requests, which in a
    closed loop is the wave every client sends at once) left out, and with it measured, as the benchmark measured
    every request up to the one that sends the last (after it the clients run out); or why it cannot be simulated."""
    try:
        point = point_of(case, True, generator, cost_model)
        prices, engine, _, _ = deployment(point, generator, cost_model)
        serving = point.workload.serving
        assert serving is not None
        stream = requests(serving)
        found = []
        for warmup in (0.1, 0.0):
            stats = events.simulate(stream, engine, prices.time, serving.concurrency, warmup)
            metrics = events.metrics(stats, point.parallel.world)
            found.append((metrics["ttft_mean_s"], metrics["tpot_mean_s"]))
    except (DseError, ValueError) as exc:  # ValueError: a closed loop too short to measure
        return str(exc).split(";")[0][:90]
    return found


def short(row_id: str, width: int = 72) -> str:
    """A row id within `width`, keeping its end (where the ids differ)."""
    return row_id if len(row_id) <= width else "~" + row_id[-width + 1 :]


@dataclass(frozen=True)
class Priced:
    """A row's measured and steady-state latencies (seconds)."""

    case: Case
    ttft: float
    tpot: float
    dse_ttft: float
    dse_tpot: float

    @property
    def errors(self) -> tuple[float, float]:
        """Signed relative errors of TTFT and TPOT: (dse - measured) / measured."""
        return (self.dse_ttft - self.ttft) / self.ttft, (self.dse_tpot - self.tpot) / self.tpot

    @property
    def group(self) -> str:
        """The row's (model, dtype, system, backend)."""
        row, model = self.case.row, self.case.raw["model"]
        return f"{model['base']} {model['dtype']} {row['system']} {row['backend']}"

    @property
    def band(self) -> str:
        """The row's model and concurrency band."""
        c = self.case.concurrency
        return f"{self.case.raw['model']['base']} " + ("c<=8" if c <= 8 else "c16-64" if c <= 64 else "c>=128")


def summary(label: str, errors: list[tuple[float, float]]) -> str:
    """Rows, mean absolute and median signed error of TTFT and TPOT."""
    ttft, tpot = [e[0] for e in errors], [e[1] for e in errors]
    return (
        f"{label:36s} {len(errors):4d}  TTFT MAPE {100 * statistics.fmean(map(abs, ttft)):5.0f}%  median "
        f"{100 * statistics.median(ttft):+5.0f}%   TPOT MAPE {100 * statistics.fmean(map(abs, tpot)):5.0f}%  median "
        f"{100 * statistics.median(tpot):+5.0f}%"
    )


def rows_of(path: Path) -> tuple[list[dict[str, str]], int]:
    """The aggregated rows of a catalog model on H100/H200, each measurement once, and how many duplicates were
    dropped (the same measurement appears under several ids, and DeepSeek-R1's runs again as DeepSeek-V3's)."""
    with path.open(newline="") as handle:
        chosen = [
            r
            for r in csv.DictReader(handle)
            if r["mode"] == "agg" and r["model_path"] in MODELS and r["system"] in SYSTEMS
        ]
    seen: set[tuple[Any, ...]] = set()
    unique = []
    for r in chosen:
        shape = tuple(r[c] for c in ("backend", "system", "isl", "osl", "tp_size", "batch_size"))
        key = (
            MODELS[r["model_path"]],
            *shape,
            round(float(r["silicon_ttft_ms"]), 3),
            round(float(r["silicon_tpot_ms"]), 3),
        )
        if key not in seen:
            seen.add(key)
            unique.append(r)
    unique.sort(key=lambda r: (r["model_path"], r["system"], r["backend"], int(r["isl"]), int(r["osl"]), r["id"]))
    return unique, len(chosen) - len(unique)


def steady_table(
    rows: list[dict[str, str]], generator: WorkloadGenerator, cost_model: CostModel
) -> tuple[list[Priced], Counter[str]]:
    """Every row priced at the steady state and printed, and the rows skipped by reason."""
    skipped: Counter[str] = Counter()
    priced: list[Priced] = []
    print(
        f"{'row id':72s} {'backend':7s} {'isl/osl/conc':>15s} {'layout':>9s} {'TTFT ms':>8s} {'dse':>8s} {'err':>7s} "
        f"{'TPOT ms':>8s} {'dse':>7s} {'err':>7s}"
    )
    for row in rows:
        case = case_of(row)
        if isinstance(case, str):
            skipped[case] += 1
            continue
        found = price(case, generator, cost_model)
        if isinstance(found, str):
            skipped[f"dse: {found}"] += 1
            continue
        p = Priced(case, float(row["silicon_ttft_ms"]) / 1e3, float(row["silicon_tpot_ms"]) / 1e3, *found)
        priced.append(p)
        shape = f"{row['isl']}/{row['osl']}/{case.concurrency}"
        print(
            f"{short(row['id']):72s} {row['backend']:7s} {shape:>15s} {case.layout:>9s} {1e3 * p.ttft:8.1f} "
            f"{1e3 * p.dse_ttft:8.1f} {100 * p.errors[0]:+6.0f}% {1e3 * p.tpot:8.2f} {1e3 * p.dse_tpot:7.2f} "
            f"{100 * p.errors[1]:+6.0f}%"
        )
    return priced, skipped


def sample_of(priced: list[Priced], count: int) -> list[Priced]:
    """`count` rows drawn in turn from each (model, dtype, system, backend), so that every group is represented."""
    rng = random.Random(0)
    pools: dict[str, list[Priced]] = defaultdict(list)
    for p in priced:
        pools[p.group].append(p)
    for pool in pools.values():
        rng.shuffle(pool)
    sample: list[Priced] = []
    while len(sample) < min(count, len(priced)):
        for pool in pools.values():
            if pool and len(sample) < count:
                sample.append(pool.pop())
    return sample


def events_table(sample: list[Priced], generator: WorkloadGenerator, cost_model: CostModel) -> None:
    """The sample priced again by the event simulation, beside the measured and steady-state figures."""
    print(
        "\nEvent simulation on a sample: 10 requests per client, as the benchmark sent; 'events' leaves out the first"
    )
    print("tenth (dse's warm-up: the wave every client sends at once), 'all' measures it too, as the benchmark did")
    print(
        f"{'row id':72s} {'TTFT ms':>8s} {'steady':>8s} {'events':>8s} {'all':>8s} {'TPOT ms':>8s} {'steady':>7s} "
        f"{'events':>7s} {'all':>7s}"
    )
    began = time.perf_counter()
    for p in sample:
        found = simulate(p.case, generator, cost_model)
        if isinstance(found, str):
            print(f"{short(p.case.row['id']):72s} {1e3 * p.ttft:8.1f} {1e3 * p.dse_ttft:8.1f} {found}")
            continue
        (ttft, tpot), (ttft_all, tpot_all) = found
        print(
            f"{short(p.case.row['id']):72s} {1e3 * p.ttft:8.1f} {1e3 * p.dse_ttft:8.1f} {1e3 * ttft:8.1f} "
            f"{1e3 * ttft_all:8.1f} {1e3 * p.tpot:8.2f} {1e3 * p.dse_tpot:7.2f} {1e3 * tpot:7.2f} {1e3 * tpot_all:7.2f}"
        )
    print(f"({time.perf_counter() - began:.0f} s)")


def write_csv(path: Path, priced: list[Priced]) -> None:
    with path.open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(
            ["id", "group", "isl", "osl", "concurrency", "layout", "ttft_s", "tpot_s", "dse_ttft_s", "dse_tpot_s"]
        )
        for p in priced:
            r = p.case.row
            out.writerow(
                [
                    r["id"],
                    p.group,
                    r["isl"],
                    r["osl"],
                    p.case.concurrency,
                    p.case.layout,
                    p.ttft,
                    p.tpot,
                    p.dse_ttft,
                    p.dse_tpot,
                ]
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=data_root().parent / "silicon_sample.csv")
    parser.add_argument("--events", type=int, default=10, help="rows also priced by the event simulation")
    parser.add_argument("--rows", type=int, default=0, help="price only the first N rows (0: all)")
    parser.add_argument("--out", type=Path, help="write the per-row table as CSV here")
    args = parser.parse_args()
    rows, duplicates = rows_of(args.csv)
    generator = plugins.generator(plugins.DEFAULT_GENERATOR)
    cost_model = plugins.cost_model(plugins.DEFAULT_COST_MODEL)
    began = time.perf_counter()
    priced, skipped = steady_table(rows[: args.rows or None], generator, cost_model)
    spent = time.perf_counter() - began
    print(f"\n{len(priced)} rows priced at the steady state in {spent:.0f} s; {duplicates} duplicate measurements")
    print("dropped; skipped: " + ("; ".join(f"{n} {why}" for why, n in skipped.most_common()) or "none"))
    for title, key in (("(model, dtype, system, backend)", "group"), ("(model, concurrency band)", "band")):
        groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for p in priced:
            groups[getattr(p, key)].append(p.errors)
        print(f"\nPer {title}: rows, mean absolute and median signed error, (dse - measured) / measured")
        for label in sorted(groups):
            print(summary(label, groups[label]))
    if args.events and priced:
        events_table(sample_of(priced, args.events), generator, cost_model)
    if args.out:
        write_csv(args.out, priced)


if __name__ == "__main__":
    main()
