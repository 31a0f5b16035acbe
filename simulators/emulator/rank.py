"""One rank of the replay: its trace's steps executed in dependency order on torch.distributed (gloo).

Compute is a sleep of the modelled duration on the rank's one compute stream, kept on a planned clock: a compute
step starts when its dependencies ended (a communication's measured end, a compute step's planned one) and ends
its duration later, so the loop's own overhead and sleep overshoot do not pile up over hundreds of microsecond
kernels. A communication step is issued asynchronously as soon as its dependencies are done, so it runs while
compute sleeps, as on a GPU's communication streams. Control dependencies keep each process group's collectives
in trace order on every member (gloo matches collectives by their order of issue). Completion times are taken in
the work's done-callback, on gloo's own thread (or a thread waiting on a send/recv), which also wake the loop.
"""

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from simulators.emulator.contract import RankMetrics
from simulators.emulator.plan import Plan, Step

WAIT_S = 1.0
"""Longest wait for a completion with no compute due (a bound, not a poll: completions wake the loop)."""
ELEMENT = torch.float32
"""Buffers hold the trace's bytes as float32: a CPU reduces float32 at vectorized speed, as a GPU reduces bf16
at HBM speed; the bytes on the wire are the trace's."""


@dataclass
class _Flight:
    work: dist.Work
    start: float
    buffers: tuple[torch.Tensor, ...]


def run_rank(
    rank: int, world: int, init_method: str, plan: Plan, timeout_s: float, join_timeout_s: float
) -> RankMetrics:
    """Join the job, create every group (collectively, in one order), run this rank's steps, leave the job.

    Joining waits for every rank to start and import torch, which on a busy host takes seconds (4 ranks on 2 loaded
    cores: over 4 s), so gloo's own timeout, for joining, creating the groups and leaving, is `join_timeout_s`. The
    run itself is held to `timeout_s` by the replay loop's own check, from the moment every rank has joined: the
    main thread never blocks in gloo while the steps run (their work is asynchronous), so a step stuck in gloo ends
    the rank at `timeout_s` whatever gloo's timeout. A rank that fails exits without waiting for its work still in
    gloo (`replay._local_rank`)."""
    # One intra-op thread: ranks share the host's cores, and each rank's own pool of spinning threads made a 726 KB
    # all-reduce between two ranks take 13-30 ms instead of 2 (4 ranks on 2 cores; replayed steps 2x longer).
    torch.set_num_threads(1)
    join = timedelta(seconds=join_timeout_s)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=join)
    groups = {pg: dist.new_group(members, timeout=join) for pg, members in plan.groups.items()}
    dist.barrier()
    metrics = _Replay(rank, plan, groups, timeout_s).run()
    # A rank that closed its connections early would fail its peers' work still in flight ("connection closed by
    # peer"), so all leave together; and only after a clean run (a failed rank's process exits anyway).
    dist.barrier()
    dist.destroy_process_group()
    return metrics


class _Replay:
    def __init__(self, rank: int, plan: Plan, groups: dict[int, object], timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.steps = plan.ranks[rank]
        self.sizes = {pg: len(members) for pg, members in plan.groups.items()}
        self.groups = groups
        self.ended: dict[int, float] = {}
        """Completion time of each communication step, written by gloo's thread."""
        self.errors: dict[int, Exception] = {}
        """A send's or recv's failure, kept by its waiter thread."""
        self.wake = threading.Event()
        """Set by a completion: the loop waits on it (not polling), so the cores are left to gloo's threads."""

    def run(self) -> RankMetrics:
        steps = self.steps
        waiting = [len(s.deps) for s in steps]
        users: list[list[int]] = [[] for _ in steps]
        for i, s in enumerate(steps):
            for d in s.deps:
                users[d].append(i)
        t0 = time.perf_counter()
        # When each step's last dependency ended: a compute step's planned end, a communication's measured one.
        ready_at = [t0] * len(steps)
        ready_compute = [i for i, s in enumerate(steps) if not s.deps and s.kind == "compute"]
        ready_comm = [i for i, s in enumerate(steps) if not s.deps and s.kind != "compute"]
        flights: dict[int, _Flight] = {}
        computing: tuple[int, float, float] | None = None  # (step, start, end)
        stream_free = t0
        compute_spans: list[tuple[float, float]] = []
        comm_spans: list[tuple[float, float]] = []
        last_end = t0
        done = 0

        def finish(i: int, end: float) -> None:
            nonlocal done, last_end
            done += 1
            last_end = max(last_end, end)
            for user in users[i]:
                ready_at[user] = max(ready_at[user], end)
                waiting[user] -= 1
                if waiting[user] == 0:
                    (ready_compute if steps[user].kind == "compute" else ready_comm).append(user)

        while done < len(steps):
            self.wake.clear()  # before looking at `ended`: a completion after the look wakes the wait below
            for i in sorted(ready_comm):  # trace order: a group's collectives are issued as the trace orders them
                flights[i] = self._issue(i)
            ready_comm.clear()
            if computing is None and ready_compute:
                i = min(ready_compute)
                ready_compute.remove(i)
                start = max(ready_at[i], stream_free)
                stream_free = start + steps[i].seconds
                computing = (i, start, stream_free)
            for i in [i for i in flights if i in self.ended]:
                flight = flights.pop(i)
                if i in self.errors:
                    raise self.errors[i]
                comm_spans.append((flight.start, self.ended[i]))
                finish(i, self.ended[i])
            now = time.perf_counter()
            if now - t0 > self.timeout_s:
                stuck = ", ".join(steps[i].name for i in sorted(flights)[:3])
                raise TimeoutError(
                    f"{len(flights)} communications still in flight after {self.timeout_s:g} s ({stuck}); "
                    "a peer never joined them (deadlock?)"
                )
            if computing is not None and now >= computing[2]:
                compute_spans.append(computing[1:])
                finish(computing[0], computing[2])
                computing = None
                continue
            if ready_comm or (computing is None and ready_compute):
                continue
            self.wake.wait(computing[2] - now if computing is not None else WAIT_S)
        compute = union(compute_spans)
        comm = union(comm_spans)
        return RankMetrics(
            rank=self.rank,
            end_s=last_end - t0,
            compute_s=length(compute),
            comm_s=length(comm),
            exposed_comm_s=length(comm) - length(intersection(comm, compute)),
        )

    def _issue(self, i: int) -> _Flight:
        step = self.steps[i]
        start = time.perf_counter()
        if step.kind == "collective":
            work, buffers = self._collective(step)
        else:
            buffer = torch.ones(_elements(step.nbytes, 1), dtype=ELEMENT)
            peer_op = dist.isend if step.kind == "send" else dist.irecv
            work, buffers = peer_op(buffer, step.peer, tag=step.tag), (buffer,)
        # A thread waits for the work: gloo gives send/recv work no future, nor the reduce-scatter and all-gather
        # it runs by composition ("Work::getFuture not implemented").
        threading.Thread(target=self._wait, args=(i, work), daemon=True).start()
        return _Flight(work, start, buffers)

    def _end(self, i: int) -> None:
        self.ended[i] = time.perf_counter()
        self.wake.set()

    def _wait(self, i: int, work: dist.Work) -> None:
        """A communication's waiter. Its error is raised by the loop, on the rank's main thread: a second wait()
        on gloo's send/recv work would block for good (it waits for the buffer's next transfer)."""
        try:
            work.wait()
        except Exception as error:
            self.errors[i] = error
        finally:
            self._end(i)

    def _collective(self, step: Step) -> tuple[dist.Work, tuple[torch.Tensor, ...]]:
        size = self.sizes[step.group]
        group = self.groups[step.group]
        n = _elements(step.nbytes, size)
        whole = torch.ones(n, dtype=ELEMENT)
        if step.collective == "all_reduce":
            return dist.all_reduce(whole, group=group, async_op=True), (whole,)
        if step.collective == "all_gather":
            shard = torch.ones(n // size, dtype=ELEMENT)
            return dist.all_gather_single(whole, shard, group=group, async_op=True), (whole, shard)
        if step.collective == "reduce_scatter":
            shard = torch.empty(n // size, dtype=ELEMENT)
            return dist.reduce_scatter_single(shard, whole, group=group, async_op=True), (whole, shard)
        if step.collective == "all_to_all":
            out = torch.empty(n, dtype=ELEMENT)
            return dist.all_to_all_single(out, whole, group=group, async_op=True), (whole, out)
        if step.collective == "broadcast":
            source = dist.get_global_rank(group, 0)
            return dist.broadcast(whole, source, group=group, async_op=True), (whole,)
        raise ValueError(f"step {step.name}: unknown collective {step.collective}")


def _elements(nbytes: int, multiple: int) -> int:
    """float32 elements holding nbytes, rounded up to a multiple of the group size (the shards must be equal)."""
    n = -(-nbytes // ELEMENT.itemsize)
    return max(multiple, -(-n // multiple) * multiple)


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlap of two unions of disjoint sorted spans."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)
