"""This machine's loopback as a network dimension: gloo measured the way nccl-tests measures NCCL.

`python -m simulators.emulator.linkbench [--ranks 4] [--large-mib 16] [--repeats 10]` times all-reduce and
all-gather of a large buffer (bus bandwidth: nccl-tests' algorithm bandwidth times 2(n-1)/n or (n-1)/n) and of
a tiny one (latency), and a send between two ranks, among local gloo processes. It prints the figures and the
SystemSpec network dimension (a ring: gloo's all-reduce and all-gather are rings) that makes dse's analytical
model price those collectives as measured, so the replay's results can be read beside the model's on that link.

Latency per hop is the tiny all-reduce's time over its 2(n-1) ring steps, the share the analytical formula
`2(n-1)/n S/B + 2(n-1) a` gives it; the bandwidth the large all-reduce's bus bandwidth with that fixed part taken
off. Loopback is a kernel memory copy and gloo reduces on the CPU, so the figures depend on what else the cores
run: measure on the machine, at the time, that the replay runs on.
"""

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from pydantic import BaseModel

from dse.system import NetworkDim
from simulators.emulator.replay import JOIN_TIMEOUT_S, start_local_ranks

TINY_BYTES = 32
"""Eight float32: the smallest buffer that splits evenly among up to 8 ranks."""
TINY_REPEATS = 31
"""Tiny collectives are cheap to repeat and their times, set by the scheduler on a loaded host, spread widely:
a median of many."""


class LinkFigures(BaseModel):
    """Measured gloo figures among `ranks` local processes (seconds, bytes/s)."""

    ranks: int
    large_bytes: int
    all_reduce_busbw: float
    all_gather_busbw: float
    p2p_bandwidth: float
    all_reduce_tiny_s: float
    all_gather_tiny_s: float
    p2p_tiny_s: float

    @property
    def hop_latency_s(self) -> float:
        return self.all_reduce_tiny_s / (2 * (self.ranks - 1))

    def network_dim(self) -> NetworkDim:
        """A ring of `ranks` NPUs that prices a large all-reduce as measured: its bandwidth term is the measured
        time less the 2(n-1) hop latencies."""
        n = self.ranks
        phases = 2 * (n - 1) / n
        measured = phases * self.large_bytes / self.all_reduce_busbw
        streamed = max(measured - 2 * (n - 1) * self.hop_latency_s, measured / 2)
        return NetworkDim(
            topology="ring",
            npus=n,
            bandwidth_GBps=round(phases * self.large_bytes / streamed / 1e9, 4),
            latency_ns=round(self.hop_latency_s * 1e9, 1),
        )


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _bench_rank(rank: int, world: int, init_method: str, large: int, repeats: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as the replay's ranks do (see simulators.emulator.rank.run_rank)
    join = timedelta(seconds=JOIN_TIMEOUT_S)  # also each benchmarked collective's bound
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=join)
    try:
        figures: dict[str, float] = {}
        for label, nbytes in (("large", large), ("tiny", TINY_BYTES)):
            whole = torch.ones(nbytes // 4)
            shard = torch.ones(nbytes // 4 // world)

            def all_reduce(whole: torch.Tensor = whole) -> None:
                dist.all_reduce(whole)

            def all_gather(whole: torch.Tensor = whole, shard: torch.Tensor = shard) -> None:
                dist.all_gather_single(whole, shard)

            def p2p(whole: torch.Tensor = whole) -> None:
                if rank == 0:
                    dist.send(whole, 1)
                elif rank == 1:
                    dist.recv(whole, 0)

            for name, fn in (("all_reduce", all_reduce), ("all_gather", all_gather), ("p2p", p2p)):
                fn()  # warm-up: connections and buffers
                dist.barrier()
                figures[f"{name}_{label}_s"] = _median_time(fn, repeats if label == "large" else TINY_REPEATS)
                dist.barrier()
        if rank == 0:
            out.put(figures)
    finally:
        dist.destroy_process_group()


def measure_loopback(ranks: int = 4, large_bytes: int = 16 << 20, repeats: int = 10) -> LinkFigures:
    """Run the benchmark among `ranks` local processes (rank 0's medians)."""
    if ranks < 2 or large_bytes % (4 * ranks):
        raise ValueError("need at least 2 ranks and a large size that splits into float32 shards")
    procs, out = start_local_ranks(_bench_rank, ranks, large_bytes, repeats)
    try:
        t = out.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    n = ranks
    return LinkFigures(
        ranks=n,
        large_bytes=large_bytes,
        all_reduce_busbw=large_bytes / t["all_reduce_large_s"] * 2 * (n - 1) / n,
        all_gather_busbw=large_bytes / t["all_gather_large_s"] * (n - 1) / n,
        p2p_bandwidth=large_bytes / t["p2p_large_s"],
        all_reduce_tiny_s=t["all_reduce_tiny_s"],
        all_gather_tiny_s=t["all_gather_tiny_s"],
        p2p_tiny_s=t["p2p_tiny_s"],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulators.emulator.linkbench", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--large-mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    figures = measure_loopback(args.ranks, args.large_mib << 20, args.repeats)
    f = figures
    print(f"gloo loopback, {f.ranks} processes, {f.large_bytes >> 20} MiB / {TINY_BYTES} B (medians):")
    print(f"  all-reduce  busbw {f.all_reduce_busbw / 1e9:7.3f} GB/s   tiny {f.all_reduce_tiny_s * 1e6:8.1f} us")
    print(f"  all-gather  busbw {f.all_gather_busbw / 1e9:7.3f} GB/s   tiny {f.all_gather_tiny_s * 1e6:8.1f} us")
    print(f"  send 0->1   bw    {f.p2p_bandwidth / 1e9:7.3f} GB/s   tiny {f.p2p_tiny_s * 1e6:8.1f} us")
    print(
        "network dimension:",
        json.dumps(figures.network_dim().model_dump(include={"topology", "npus", "bandwidth_GBps", "latency_ns"})),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
