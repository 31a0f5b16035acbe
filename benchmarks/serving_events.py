"""Seconds of the serving event simulation (`dse.serving.events.simulate`) on 10,000 requests, per deployment.

The issue's budget is 5 s for 10,000 requests. The iteration time is the real pricer's (`dse.serving.iteration`):
Llama-3-8B in bf16 on one catalog H100, its steps generated and priced once (shown apart) and read from its grid
after. Requests: ISL
and OSL lognormal around 1000 tokens (sigma 0.5, at most 8192). Deployments: one engine of 256 sequences (8192 tokens
per iteration, 2048-token chunks, 450k KV tokens: what the H100 holds beside the weights); the same with speculative
decoding (3 drafts, 70% acceptance), without chunked prefill, and with a KV cache of 100k tokens (preemptions); one
engine of 64 sequences; eight engines of 32 sequences (eight replicas, each with its own GPU). Each runs in a closed
loop at its full concurrency, then in an open loop at 90% of the request rate that loop reached; the first also at
30% of it (small batches, so many more iterations: the cost is per iteration and per 16 tokens a sequence grows).
Prints per run the CPU seconds, the engine iterations in the measurement window and the CPU microseconds per such
iteration (an over-estimate: the run's iterations outside the window are not counted), and the headline metrics,
so the figures can be checked for sense as well as speed.
Run: .venv/bin/python benchmarks/serving_events.py [--requests 10000]
"""

import argparse
import time
from dataclasses import replace

import numpy as np

from dse import plugins
from dse.point.points import build_point, expand
from dse.serving.events import metrics, simulate
from dse.serving.iteration import pricer
from dse.serving.shapes import Engine, IterationTime, Requests

POINT = {
    "model": "llama3-8b",
    "workload": {"mode": "serve", "serving": {"isl": 1000, "osl": 1000, "concurrency": 256}},
    "parallel": {"dp": 8},
    "system": {"base": "dgx-h100", "network": {1: {"npus": 1}}},
}
"""Llama-3-8B on one catalog H100: its iterations priced as a serving point's are (measured GEMM tables)."""


def iteration_time():
    """The real pricer's `time` (`dse.serving.iteration`) for POINT, its steps generated and priced on first use."""
    point = build_point(expand(POINT), "benchmark")
    return pricer(point, plugins.generator("symbolic"), plugins.cost_model("analytical")).time


def requests(n: int, rate: float, seed: int = 0) -> Requests:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(1000) - 0.125, 0.5, (2, n)).round(), 1, 8192).astype(int)
    arrival = np.cumsum(rng.exponential(1.0 / rate, n)) if rate > 0 else np.zeros(n)
    return Requests(arrival, lengths[0], lengths[1])


def run(
    name: str, engine: Engine, n: int, price: IterationTime, clients: int | None = None, rate: float = 0.0
) -> dict[str, float]:
    stream = requests(n, rate)
    began = time.process_time()
    stats = simulate(stream, engine, price, clients=clients)
    spent = time.process_time() - began
    found = metrics(stats, gpus=1)
    load = f"closed {clients}" if clients else f"open {rate:.2f}/s"
    print(
        f"{name:22s} {load:12s} {spent:6.2f} s {stats.iterations:8d} iterations "
        f"{1e6 * spent / stats.iterations:5.1f} us | "
        f"TTFT p99 {found['ttft_p99_s']:7.3f} s  TPOT p50 {1e3 * found['tpot_p50_s']:5.1f} ms  "
        f"{found['tokens_per_s']:6.0f} tok/s  running {found['concurrency_mean']:5.1f}  "
        f"preemptions {stats.preemptions}"
    )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    n = parser.parse_args().requests
    one = Engine(
        engines=1,
        max_seqs=256,
        max_batched_tokens=8192,
        chunked_prefill=True,
        prefill_chunk=2048,
        kv_capacity_tokens=450_000,
        kv_block_tokens=16,
    )
    deployments = {
        "1 x 256": one,
        "1 x 256 MTP 3 @ 0.7": replace(one, draft_tokens=3, acceptance=0.7),
        "1 x 256 unchunked": replace(one, chunked_prefill=False),
        "1 x 256 KV 100k": replace(one, kv_capacity_tokens=100_000),
        "1 x 64": replace(one, max_seqs=64),
        "8 x 32": replace(one, engines=8, max_seqs=32),
    }
    price = iteration_time()
    began = time.process_time()
    simulate(requests(2000, 0.0), one, price, clients=256)  # prices the steps the runs read
    print(f"pricing the steps on first use (2,000 requests): {time.process_time() - began:.2f} s")
    print(f"{n} requests, ISL/OSL lognormal around 1000 tokens; iterations in the measurement window (90%)")
    for name, engine in deployments.items():
        saturated = run(name, engine, n, price, clients=engine.engines * engine.max_seqs)["requests_per_s"]
        for share in (0.9, 0.3) if engine is one else (0.9,):
            run(name, engine, n, price, rate=share * saturated)


if __name__ == "__main__":
    main()
