"""Running evaluations: a pool of Ray actors, or inline in the driver; both behind one small interface.

The driver submits (tag, point) pairs and waits for outcomes; a tag is the caller's handle (the trial
number). The Ray pool keeps its own {ObjectRef: call} map and a `ray.wait` loop, because ray.util.ActorPool
does not say which item was lost when an actor dies. Actors restart after a crash (max_restarts=-1) but never
retry a call themselves (max_task_retries=0): the pool runs a lost call's points again, one per call, on the
restarted actor, and a point that kills its worker twice fails instead of taking the actor down for good.
"""

import logging
import math
import os
import pickle
import socket
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from dse import plugins
from dse.errors import DseError
from dse.point.evaluate import evaluate
from dse.search.tuning import tune_process
from dse.spec import DesignPoint

Result = dict[str, Any]
"""{"metrics": {name: value}, "violations": {constraint: amount}, "timings": {"generate_s", ...}, "node": id}"""
NODE = "node"
"""The Ray node that evaluated a point (absent inline): where a study's work went on a cluster."""
EvaluateFn = Callable[[DesignPoint], Result]


class PluginEvaluation:
    """Evaluates points with the generator and cost model registered under two names, and refines them (a
    multi-fidelity study's second look, `refine`) with a second cost model.

    Only the names and options travel (it pickles small, as plain data); each process resolves the plugins
    through dse.plugins on first use, so an actor restarted after a crash resolves them again.
    """

    def __init__(
        self,
        generator: str,
        cost_model: str,
        cost_model_options: Mapping[str, Any] | None = None,
        refiner: str | None = None,
        refiner_options: Mapping[str, Any] | None = None,
        refine_depth: str | None = None,
    ) -> None:
        self.generator = generator
        self.cost_model = cost_model
        self.cost_model_options = dict(cost_model_options or {})
        self.refiner = refiner
        self.refiner_options = dict(refiner_options or {})
        self.refine_depth = refine_depth
        """A serving point's refinement runs at this serving depth (`refine.serving_depth`); None: its own."""

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in PLAIN_STATE}

    @cached_property
    def _plugins(self) -> tuple[Any, Any]:
        generator = plugins.generator(self.generator)
        return generator, plugins.cost_model(self.cost_model, self.cost_model_options)

    @cached_property
    def _refiner(self) -> Any:
        if self.refiner is None:
            raise DseError("this study has no refine section, so no point is refined")
        return plugins.cost_model(self.refiner, self.refiner_options, field="refine.cost_model_options")

    def affinity(self, point: DesignPoint) -> Hashable:
        """The generator's affinity of the point (see WorkloadGenerator), or None if it declares none."""
        affinity = getattr(self._plugins[0], "affinity", None)
        return None if affinity is None else affinity(point)

    def __call__(self, point: DesignPoint) -> Result:
        return self._evaluate(point, self._plugins[1])

    def refine(self, point: DesignPoint) -> Result:
        """The point priced by the refining cost model (the same workload, the same metrics and violations), a
        serving point at the refining depth."""
        serving = point.workload.serving
        if self.refine_depth is not None and serving is not None:
            deeper = point.workload.model_copy(
                update={"serving": serving.model_copy(update={"depth": self.refine_depth})}
            )
            point = DesignPoint.model_construct(
                model=point.model,
                workload=deeper,
                parallel=point.parallel,
                system=point.system,
                economics=point.economics,
            )
        return self._evaluate(point, self._refiner)

    def _evaluate(self, point: DesignPoint, cost_model: Any) -> Result:
        t0 = time.perf_counter()
        evaluation = evaluate(point, self._plugins[0], cost_model)
        metrics = {k: v if isinstance(v, bool) else float(v) for k, v in evaluation.metrics.items()}
        return {
            "metrics": metrics,
            "violations": {k: float(v) for k, v in evaluation.violations.items()},
            "timings": {
                "generate_s": evaluation.generate_s,
                "simulate_s": evaluation.simulate_s,
                "evaluate_s": time.perf_counter() - t0,
            },
        }


def evaluation_seconds(results: list[Result | str], elapsed: float) -> float:
    """The evaluation time of a call's results: the sum of their own `timings.evaluate_s` when every one reports
    it (PluginEvaluation measures it around generating and pricing each point), else the call's `elapsed` wall
    time. Calls aim at CALL_S of evaluation, and this leaves out the call's own work around it (unpickling the
    points, building the result dicts)."""
    reported = [r.get("timings", {}).get("evaluate_s") if isinstance(r, dict) else None for r in results]
    if not results or not all(isinstance(s, int | float) and math.isfinite(s) and s >= 0 for s in reported):
        return elapsed
    return float(sum(reported))  # type: ignore[arg-type]


PLAIN_STATE = ("generator", "cost_model", "cost_model_options", "refiner", "refiner_options", "refine_depth")
"""What of a PluginEvaluation goes to the Ray actors: names and options, never a resolved plugin."""


def run_one(fn: EvaluateFn, point: DesignPoint, refine: bool) -> Result:
    """fn's result for the point: its screening evaluation, or with `refine` its refinement (`fn.refine`, which
    PluginEvaluation has; an evaluation function without it cannot be asked to refine)."""
    return fn.refine(point) if refine else fn(point)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Outcome:
    """What became of one submitted point: a result, or the error that stopped it (one line)."""

    tag: int
    result: Result | None = None
    error: str | None = None


class Executor(Protocol):
    workers: int
    capacity: int
    """How many submitted points the executor takes at once: the running ones and those queued behind them."""

    def submit(self, tag: int, point: DesignPoint, refine: bool = False) -> None:
        """Start evaluating (with `refine`, refining: `run_one`), or queue for the next free worker; only call
        while fewer than `capacity` points are in flight."""

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """The outcome of an in-flight point once one is done, or None if none is within `timeout` seconds."""

    def drain(self) -> None:
        """No more points will be submitted: what is queued is shared out so that the workers finish together."""

    def expect(self, count: int) -> None:
        """`count` more points of another kind come after all (a study's refinements, after its search drained
        the executor): plan for them afresh, as their evaluations may cost far more than the search's."""

    def close(self) -> None: ...


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


class InlineExecutor:
    """Evaluates in the calling process, one point at a time: for debugging and tests of pure logic."""

    def __init__(self, fn: EvaluateFn) -> None:
        self.workers = self.capacity = 1
        self._fn = fn
        self._queue: list[tuple[int, DesignPoint, bool]] = []

    def submit(self, tag: int, point: DesignPoint, refine: bool = False) -> None:
        self._queue.append((tag, point, refine))

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """Evaluates the oldest submitted point now; a timeout cannot interrupt it."""
        tag, point, refine = self._queue.pop(0)
        try:
            return Outcome(tag, result=run_one(self._fn, point, refine))
        except Exception as exc:
            return Outcome(tag, error=_describe(exc))

    def drain(self) -> None:
        pass

    def expect(self, count: int) -> None:
        pass

    def close(self) -> None:
        self._queue.clear()


RESTART_POLL_S = 0.05
RESTART_LIMIT_S = 120.0
"""How long a restarting actor may stay unreachable before its point fails."""


@dataclass
class _Job:
    tag: int
    point: DesignPoint
    affinity: Hashable
    refine: bool = False
    attempt: int = 1
    """2 once a call that held the point was lost with its actor: it then runs alone, and fails if that is lost."""


@dataclass
class _Call:
    """One actor call: its points, and while the actor restarts after losing it, since when."""

    jobs: list[_Job]
    actor: int
    restarting_since: float | None = None


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address` (auto, host:port, ray://host:10001; None: RAY_ADDRESS or a new local
    Ray) unless this process is already connected; returns whether it connected (and so should shut down).

    The evaluators import dse and the plugins by name, so every node needs the package installed (the cluster
    launcher's setup_commands, or the container image) for its entry points to resolve.
    """
    import ray

    check_address(address)
    if ray.is_initialized():
        return False
    # The token-auth notice comes with every local start; it is advice, not a problem with the study.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    address = address or os.environ.get("RAY_ADDRESS") or None
    try:
        if address and address.startswith("ray://"):
            _client_init(address)
        elif address:
            _check_reachable(address)
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        else:
            _start_local()
    except (ConnectionError, TimeoutError) as exc:
        raise DseError(
            f"cannot join the Ray cluster at --address {address} ({_describe(exc)}); check the address or leave "
            f"--address out to start a local Ray"
        ) from None
    return True


def check_address(address: str | None) -> None:
    """A Ray address as `--address` takes it: auto, local, HOST:PORT or ray://HOST:PORT; else a one-line DseError,
    where Ray's own is a ValueError from deep inside ray.init. (RAY_ADDRESS is Ray's to read: job submission sets
    it in forms of its own.)"""
    if not address or address in ("auto", "local"):
        return
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not (colon and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536) or any(c.isspace() for c in host):
        raise DseError(
            f"--address {address}: not a Ray address; give auto (the cluster of this machine), HOST:PORT (a cluster's "
            "head, e.g. 10.0.0.1:6379) or ray://HOST:PORT (its Ray Client server, e.g. ray://head:10001)"
        )


REACH_TIMEOUT_S = 5.0


def _check_reachable(address: str) -> None:
    """Fail in seconds when nothing listens at host:port: Ray itself retries an unreachable GCS forever, printing a
    warning every few seconds. ("auto" and names without a port are left to Ray, which fails fast on them.)"""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise DseError(
            f"--address {address}: no Ray cluster answers there ({exc.strerror or type(exc).__name__}); start one "
            f"with `ray start --head`, give the address `ray start` printed, or leave --address out to start a "
            f"local Ray"
        ) from None


LOCAL_START_ATTEMPTS = 3
LOCAL_START_TIMEOUT_TEXT = "timed out during startup"
"""Ray gives up on its own raylet after 30 s (`The current node timed out during startup`): seen in 2 of 11 local
starts on this 2-core machine at a load of 8. Such a start is tried again from scratch before the study gives up."""


def _start_local() -> None:
    import ray

    for _ in range(LOCAL_START_ATTEMPTS):
        try:
            ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
            return
        except Exception as exc:
            if LOCAL_START_TIMEOUT_TEXT not in str(exc):
                raise
            ray.shutdown()
    raise DseError(
        f"a local Ray did not start: its processes timed out {LOCAL_START_ATTEMPTS} times (the machine is too busy); "
        "run again when the load is lower, use --inline to evaluate in this process, or join a running cluster "
        "with --address"
    )


CLIENT_INIT_ATTEMPTS = 3
CLIENT_INIT_BACKOFF_S = 2.0


def _client_init(address: str) -> None:
    """Ray Client: the head starts a server per client and aborts the connection when that server is slow to
    come up (a busy head); such an abort is transient, so it is tried again before giving up."""
    import ray

    for attempt in range(1, CLIENT_INIT_ATTEMPTS + 1):
        try:
            ray.init(address=address, logging_level=logging.WARNING)  # Ray Client takes no local-node options
            return
        except ConnectionAbortedError:
            if attempt == CLIENT_INIT_ATTEMPTS:
                raise
            time.sleep(CLIENT_INIT_BACKOFF_S * attempt)


CALL_S = 0.1
"""The evaluation time a call of several points aims at. Ray's cost per call in the driver (submit, wait, get,
its threads) is about as large as Optuna's bookkeeping per trial, and the driver's CPU per trial doubles when it
wakes every few points: each wake finds its caches cold from the evaluators that ran on its core meanwhile (the
driver alone, in a loop: 0.26 ms per quickstart trial; waking every 4 evaluations beside two busy evaluators,
0.55 ms; every 8, 0.41; every 16, 0.31). On a small machine that CPU is what the workers lack: with 2 workers,
calls of up to 16 points (and the drain at the end) gave a median 1.72x the trials/s of 1 worker on the
quickstart and 1.79x on planning-70b, where calls of 4 gave 1.63x and 1.72x (eight runs of each, interleaved in
the same minutes: this VM's speed drifts). Slow evaluations (ASTRA-sim's seconds) go one per call, so that no
worker waits behind another's batch."""
MAX_BATCH = 16
FIRST_BATCH = 4
"""Points per call before any call has been timed."""
QUEUED_BATCHES = 2
"""Batches queued in the executor per worker beside those it runs: a freed actor starts the next at once, and has
a choice of points to take those of its own affinity (with one point queued per worker, a fifth of the
quickstart's points went to an actor cold for them). The sampler proposes that much further ahead (TPE with its
constant liar, NSGA-II within a generation of 50): about CALL_S x QUEUED_BATCHES of evaluation per worker."""
POINT_S_WEIGHT = 0.5
"""Weight of the last call in the running mean of the evaluation time per point. An actor's first call is left
out (it imports the plugins and fills empty caches: 50 ms for a quickstart point that then takes 4), and the mean
follows a study that moves to costlier points within a few calls."""


class RayExecutor:
    """A fixed pool of `workers` Evaluator actors, one call of up to `batch` points in flight per actor (two when a
    whole batch of its affinity waits, see _dispatch), and a queue in front of them.

    Joins the Ray cluster at `address` (or RAY_ADDRESS), or starts an embedded one; reuses a Ray already
    initialised in this process. Only what it started is shut down on close. Without `workers`, one actor per
    CPU of the cluster as it is when the study starts.

    A freed actor takes the oldest queued points of an affinity it ran first (`fn.affinity`, see
    WorkloadGenerator), else of an affinity no actor has run yet, else the oldest point: each process then warms
    its caches for its share of the space, and no actor idles while a point waits. On this machine's quickstart
    that makes a point 15% cheaper with two workers than handing them out in turn (fewer cold schedule walks).
    Queued points stay in the driver, not in Ray's queues: an actor that dies loses only the call it runs and a
    follow-up call. Their points run again one per call, so that a point that kills its worker again is known, and
    fails.
    """

    def __init__(self, fn: EvaluateFn, workers: int | None = None, address: str | None = None) -> None:
        import ray  # here, not at the top: `dse evaluate` and `dse report` should not pay for importing Ray

        self._ray = ray
        self._started_ray = connect(address)
        cluster_cpus = ray.cluster_resources().get("CPU", 1.0)
        self.workers = workers = workers or max(1, int(cluster_cpus))
        # One CPU per actor, or a fair share when there are more workers than CPUs: an actor Ray cannot place
        # would hold its point forever and stall the study.
        cpus = min(1.0, cluster_cpus / workers)
        evaluator = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=cpus)(Evaluator)
        self._affinity: Callable[[DesignPoint], Hashable] = getattr(fn, "affinity", lambda point: None)
        self._actors = [evaluator.remote(fn) for _ in range(workers)]
        self._idle = list(range(workers))
        self._load = [0] * workers
        """Calls in flight per actor: one, or two when a follow-up call waits behind the first (see _dispatch)."""
        self._queued: deque[_Job] = deque()
        self._owner: dict[Hashable, int] = {}
        """The actor that ran each affinity first."""
        self._calls: dict[Any, _Call] = {}
        self._done: deque[Outcome] = deque()
        self._point_s: float | None = None
        """Running mean of the actors' evaluation time per point."""
        self._answered = [False] * workers
        """Whether each actor has finished a call (its first is not timed)."""
        self._draining = False

    @property
    def batch(self) -> int:
        """Points per call: as many as take about CALL_S to evaluate, from 1 to MAX_BATCH; once draining, at most
        a worker's share of the queue, so that the last calls shrink instead of one worker finishing alone."""
        size = FIRST_BATCH if self._point_s is None else int(CALL_S / max(self._point_s, 1e-9))
        if self._draining:
            size = min(size, -(-len(self._queued) // self.workers))
        return max(1, min(MAX_BATCH, size))

    @property
    def capacity(self) -> int:
        return self.workers * (1 + QUEUED_BATCHES * self.batch)

    def submit(self, tag: int, point: DesignPoint, refine: bool = False) -> None:
        self._queued.append(_Job(tag, point, self._affinity(point), refine))
        self._dispatch()

    def _dispatch(self) -> None:
        while self._idle and self._queued:
            actor = self._idle.pop()
            self._send(_Call(self._take(actor), actor))
        # A busy actor with a whole batch of its own affinity queued gets it as a follow-up call, which it starts
        # the moment its call ends instead of idling until the driver hears of the end and answers.
        if self._queued and 1 in self._load:
            for actor, own in self._own_batches().items():
                if len(own) == self.batch:
                    for job in own:
                        self._queued.remove(job)
                    self._send(_Call(own, actor))

    def _own_batches(self) -> dict[int, list[_Job]]:
        """Per actor with one call in flight, up to `batch` of the oldest queued first attempts of the affinities it
        ran first: one pass over the queue, however many actors (a large cluster queues hundreds of points)."""
        batches: dict[int, list[_Job]] = {}
        size = self.batch
        for job in self._queued:
            if job.attempt > 1 or job.affinity is None:
                continue
            owner = self._owner.get(job.affinity)
            if owner is not None and self._load[owner] == 1:
                batch = batches.setdefault(owner, [])
                if len(batch) < size:
                    batch.append(job)
        return batches

    def _send(self, call: _Call) -> None:
        points = pickle.dumps([(job.point, job.refine) for job in call.jobs], protocol=pickle.HIGHEST_PROTOCOL)
        self._calls[self._actors[call.actor].evaluate.remote(points)] = call
        self._load[call.actor] += 1

    def _free(self, actor: int) -> None:
        """A call of the actor is done with; the actor takes new points once none is left in flight."""
        if not self._load[actor]:
            self._idle.append(actor)

    def _take(self, actor: int) -> list[_Job]:
        """The queued jobs `actor` runs next (see the class docstring): a retry alone, else up to `batch`."""
        if self._queued[0].attempt > 1:
            return [self._queued.popleft()]
        jobs: list[_Job] = []
        size = self.batch
        while len(jobs) < size:
            position = self._choose(actor, any_affinity=not jobs)
            if position is None:
                break
            job = self._queued[position]
            del self._queued[position]
            if job.affinity is not None:
                self._owner.setdefault(job.affinity, actor)
            jobs.append(job)
        return jobs

    def _choose(self, actor: int, any_affinity: bool) -> int | None:
        """The queue position of the oldest first attempt of the actor's affinity, else of one no actor ran yet,
        else (if `any_affinity`) the oldest first attempt: a batch is not filled with another actor's points."""
        fresh = oldest = None
        for position, job in enumerate(self._queued):
            if job.attempt > 1:
                continue
            owner = self._owner.get(job.affinity)
            if owner == actor:
                return position
            if owner is None and fresh is None:
                fresh = position
            if oldest is None:
                oldest = position
        return fresh if fresh is not None or not any_affinity else oldest

    def drain(self) -> None:
        self._draining = True

    def expect(self, count: int) -> None:
        """Calls are sized anew (FIRST_BATCH, then by the new points' measured time) and shared out again."""
        self._draining = False
        self._point_s = None

    def wait(self, timeout: float | None = None) -> Outcome | None:
        while not self._done:
            ready, _ = self._ray.wait(list(self._calls), num_returns=1, timeout=timeout)
            if not ready:
                return None
            self._collect(ready[0])
            self._dispatch()
        return self._done.popleft()

    def _collect(self, ref: Any) -> None:
        """Outcomes of a finished call into `_done`; a lost call's points wait for the restarted actor."""
        from ray.exceptions import RayActorError, RayTaskError

        call = self._calls.pop(ref)
        self._load[call.actor] -= 1
        try:
            results = self._ray.get(ref)
        except RayTaskError as exc:  # the points did not reach the evaluation (one failed to unpickle)
            self._free(call.actor)
            self._done.extend(Outcome(job.tag, error=_describe(exc.cause or exc)) for job in call.jobs)
            return
        except RayActorError as exc:
            self._lost(call, exc)
            return
        self._free(call.actor)
        if call.restarting_since is not None:  # the restarted actor answered: its points go first, one by one
            self._queued.extendleft(reversed(call.jobs))
            return
        results, seconds = results
        if self._answered[call.actor]:
            point_s = seconds / len(results)
            mean = self._point_s
            self._point_s = point_s if mean is None else mean + POINT_S_WEIGHT * (point_s - mean)
        self._answered[call.actor] = True
        for job, result in zip(call.jobs, results, strict=True):
            self._done.append(Outcome(job.tag, error=result) if isinstance(result, str) else Outcome(job.tag, result))

    def _lost(self, call: _Call, exc: Exception) -> None:
        """The actor died during the call. Its points run again once it answers a ping (a call sent while it
        restarts fails without running, and must not count as a crash); a point that was alone in its call on
        its second attempt killed the actor twice and fails. The actor takes new points only once it answers,
        also when no point of the call is left to run: a point sent to it while it restarts would fail unrun,
        and count as its own first crash (seen in this module's fault test on a busy machine)."""
        if call.restarting_since is not None:
            if time.monotonic() - call.restarting_since > RESTART_LIMIT_S:
                self._free(call.actor)
                error = f"the evaluator did not come back after a crash ({_describe(exc)})"
                self._done.extend(Outcome(job.tag, error=error) for job in call.jobs)
                return
            time.sleep(RESTART_POLL_S)
        else:
            twice = [job for job in call.jobs if job.attempt > 1]
            error = f"the evaluator process died twice on this point ({_describe(exc)})"
            self._done.extend(Outcome(job.tag, error=error) for job in twice)
            call.jobs = [job for job in call.jobs if job.attempt == 1]
            for job in call.jobs:
                job.attempt = 2
            call.restarting_since = time.monotonic()
        self._calls[self._actors[call.actor].ping.remote()] = call
        self._load[call.actor] += 1

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)
        self._actors.clear()
        self._idle.clear()
        self._queued.clear()
        self._calls.clear()
        self._done.clear()
        if self._started_ray:
            self._ray.shutdown()


class Evaluator:
    """The actor: holds an evaluation function (and, through it, the resolved plugins and whatever they cache
    across points) for its lifetime, and tags each result with its node."""

    def __init__(self, fn: EvaluateFn) -> None:
        import ray

        tune_process()
        self._fn = fn
        self._node = ray.get_runtime_context().get_node_id()

    def evaluate(self, points: bytes) -> tuple[list[Result | str], float]:
        """Each (point, refine) pair's result (`run_one`), or the one-line error its evaluation raised (one point's
        error does not cost the others their results), and the seconds of evaluation the call held: the pool sizes
        its calls by it (`evaluation_seconds`).

        The points come pickled by the driver: Ray would pickle them with cloudpickle, whose dispatch table is a
        Python ChainMap looked up for every object of every point (4% of the driver's instructions per trial)."""
        start = time.perf_counter()
        results: list[Result | str] = []
        for point, refine in pickle.loads(points):
            try:
                results.append({**run_one(self._fn, point, refine), NODE: self._node})
            except Exception as exc:
                results.append(_describe(exc))
        return results, evaluation_seconds(results, time.perf_counter() - start)

    def ping(self) -> None:
        """Answers once the actor is up (again)."""
