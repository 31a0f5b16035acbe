"""The gloo replay, dse's own emulator: `python -m simulators.emulator.replay FOLDER [--scale S] [--timeout-s T]
[--ray ADDRESS]`.

It reads the folder of the emulator contract (Chakra traces and communicator groups), starts one process per
rank that joins a torch.distributed gloo job, and runs every rank's trace for real: each collective and
send/recv with its true size (times --scale) in dependency order, compute as sleeps of the modelled duration
(`rank.py`). It prints the measured metrics JSON (the contract's) as its last stdout line. Local ranks talk over
loopback; with --ray they are Ray actors spread over a cluster's nodes (`ray_ranks.py`), so a cluster of CPU
machines becomes a test bench for a workload's network traffic.

A rank that fails or deadlocks ends the run: a step still in flight --timeout-s after every rank joined raises in
the rank (joining may take up to --join-timeout-s: on a busy host the ranks start and import torch slowly), and
the parent stops every rank at a deadline beyond both, so no rank hangs and the exit code is 1 with the reason on
stderr.
"""

import argparse
import math
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
from collections.abc import Callable, Sequence
from importlib.util import find_spec

from dse.errors import DseError
from simulators.emulator.contract import Metrics, RankMetrics
from simulators.emulator.plan import Plan, load_plan

GRACE_S = 30.0
"""Time the parent allows beyond the ranks' own timeouts (joining, then running) before it stops them."""
JOIN_TIMEOUT_S = 120.0
"""Default time a rank waits for every rank to start, import torch and join: far beyond what a busy host needs,
and not the run's timeout (a 3 s deadlock test's 4 ranks took over 4 s to join on 2 loaded cores)."""


CAUSE_WAIT_S = 2.0
"""After a rank fails, how long the others' failures are awaited to find the cause among them."""
CLOSED_BY_PEER = "Connection closed by peer"


class ReplayError(DseError):
    """A rank failed, or the ranks did not finish in time."""


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def aggregate(ranks: Sequence[RankMetrics]) -> Metrics:
    """The step is the last rank's end; the other figures are means over ranks (SimResult's convention)."""
    n = len(ranks)
    return Metrics(
        step_time_s=max(r.end_s for r in ranks),
        comm_time_s=sum(r.comm_s for r in ranks) / n,
        exposed_comm_time_s=sum(r.exposed_comm_s for r in ranks) / n,
        compute_time_s=sum(r.compute_s for r in ranks) / n,
        ranks=sorted(ranks, key=lambda r: r.rank),
    )


def _local_rank(
    rank: int, world: int, init_method: str, plan: Plan, timeout_s: float, join_timeout_s: float, out: mp.Queue
) -> None:
    from simulators.emulator.rank import run_rank  # torch is imported in the ranks only

    try:
        metrics = run_rank(rank, world, init_method, plan, timeout_s, join_timeout_s)
        out.put((rank, metrics.model_copy(update={"node": socket.gethostname()}).model_dump()))
    except Exception as error:
        message = " ".join(f"{type(error).__name__}: {error}".split())
        out.put((rank, message[:400]))
        # Its reason sent, a failed rank leaves at once: its work still pending in gloo (a recv nobody sends) would
        # make a normal exit's teardown abort with "terminate called without an active exception" on stderr.
        out.close()
        out.join_thread()
        sys.stderr.flush()
        os._exit(1)


def start_local_ranks(target: Callable[..., None], world: int, *args: object) -> tuple[list, mp.Queue]:
    """`world` processes running target(rank, world, init_method, *args, queue), joined in one gloo job on
    loopback at a free port; the queue is what they report through.

    They are forked from a fork server that has imported torch and the target's module once: spawned, each rank
    imported them itself, 5 s of CPU per rank, so 4 ranks took 10-20 s to start on 2 cores. A fork of a process
    that has only imported torch (no thread pool yet) is safe; the server is started by this process's first call
    and keeps the environment of that moment, with GLOO_SOCKET_IFNAME set."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["simulators.emulator.rank", target.__module__])
    out: mp.Queue = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        context.Process(target=target, args=(rank, world, init_method, *args, out), daemon=True)
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    return procs, out


def replay_local(plan: Plan, timeout_s: float, join_timeout_s: float = JOIN_TIMEOUT_S) -> list[RankMetrics]:
    """Every rank as a local process on loopback; the first failure or the deadline stops them all."""
    world = len(plan.ranks)
    procs, results = start_local_ranks(_local_rank, world, plan, timeout_s, join_timeout_s)
    deadline = time.monotonic() + join_timeout_s + timeout_s + GRACE_S
    done: dict[int, RankMetrics] = {}
    try:
        while len(done) < world:
            try:
                rank, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                if dead:
                    # A failed rank's reason is in the pipe before it exits: it may have arrived since the wait
                    # above gave up, and is the cause to report, not the exit code.
                    try:
                        rank, value = results.get_nowait()
                    except queue.Empty:
                        raise ReplayError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(done))
                    raise ReplayError(
                        f"ranks {missing} did not join within {join_timeout_s:g} s and finish within {timeout_s:g} s "
                        "more (deadlock?)"
                    ) from None
                else:
                    continue
            if isinstance(value, str):
                raise ReplayError(_first_cause(rank, value, results, world - len(done)))
            done[rank] = RankMetrics.model_validate(value)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    return list(done.values())


def _first_cause(rank: int, message: str, results: mp.Queue, pending: int) -> str:
    """The failure to report: one rank's failure closes its connections and fails its peers' work with 'closed by
    peer', which may arrive first, so the others' messages of the next moments are read too (until each of the
    `pending` ranks not done has reported) and a cause that is not a closed connection wins."""
    failures = [(rank, message)]
    deadline = time.monotonic() + CAUSE_WAIT_S
    for _ in range(pending - 1):
        try:
            other, value = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if isinstance(value, str):
            failures.append((other, value))
    rank, message = min(failures, key=lambda failure: CLOSED_BY_PEER in failure[1])
    return f"rank {rank} failed: {message}" + (f" ({len(failures)} ranks failed)" if len(failures) > 1 else "")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m simulators.emulator.replay", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="the emulator contract's folder (Chakra traces and comm groups)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every message size (default 1)")
    parser.add_argument(
        "--timeout-s", type=float, default=300.0, help="longest run once every rank has joined (default 300)"
    )
    parser.add_argument(
        "--join-timeout-s",
        type=float,
        default=JOIN_TIMEOUT_S,
        help=f"longest wait for every rank to start and join (default {JOIN_TIMEOUT_S:g})",
    )
    parser.add_argument("--ray", metavar="ADDRESS", help="run the ranks as Ray actors on this cluster ('auto', ...)")
    args = parser.parse_args(argv)
    if not all(0 < value < math.inf for value in (args.scale, args.timeout_s, args.join_timeout_s)):
        parser.error("--scale, --timeout-s and --join-timeout-s must be positive and finite")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if find_spec("torch") is None:  # looked up, not imported: only the ranks need it (5 s of CPU to import)
            raise ReplayError("the gloo replay needs torch: pip install 'dse-orchestrator[fx]' (make test installs it)")
        plan = load_plan(args.folder, args.scale)
        if args.ray:
            from simulators.emulator.ray_ranks import replay_ray

            ranks = replay_ray(plan, args.timeout_s, args.join_timeout_s, args.ray)
        else:
            ranks = replay_local(plan, args.timeout_s, args.join_timeout_s)
    except DseError as error:
        print(f"replay: {error}", file=sys.stderr)
        return 1
    print(aggregate(ranks).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
