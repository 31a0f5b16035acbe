"""The prefill and decode steps a serving point's engines run, as design points the generators build: one instance
on its own GPUs.

An instance shares nothing with the others while it serves (inference has no gradients to reduce across replicas),
so its steps are priced on the first `tp x pp` NPUs of the system, innermost network dimensions first: the same
GPUs and links it would hold in the whole deployment. Deployments of any size that repeat an instance then share
its priced steps. With expert parallelism the priced unit is the `ep` data-parallel ranks that share their experts
(attention data-parallel, experts spread over them), which step in lock step through their all-to-alls: each rank
is an engine of its own, and the group's step is every engine's iteration.
"""

from dse.errors import InfeasibleError
from dse.parallel import ParallelSpec
from dse.serving.spec import SchedulerSpec
from dse.spec import DesignPoint, WorkloadSpec
from dse.system import NetworkDim, SystemSpec


def instance_system(system: SystemSpec, npus: int) -> SystemSpec:
    """The system's first `npus` NPUs as a system of their own: whole inner dimensions, then part of the dimension
    the instance ends in (a torus slice takes its default shape). An instance that would take part of a
    dimension and span the next (12 GPUs on nodes of 8) is an InfeasibleError naming the degrees."""
    dims: list[NetworkDim] = []
    left = npus
    for dim in system.network:
        if left == 1:
            break
        if left >= dim.npus and left % dim.npus == 0:
            dims.append(dim)
            left //= dim.npus
        elif dim.npus % left == 0:
            dims.append(NetworkDim.model_validate({**dim.model_dump(), "npus": left, "shape": None}))
            left = 1
        else:
            sizes = " x ".join(str(d.npus) for d in system.network)
            raise InfeasibleError(
                f"an instance of parallel.tp*pp (times ep, the expert-parallel group priced together) = {npus} GPUs "
                f"does not fill whole dimensions of system "
                f"'{system.name}' ({sizes}); use degrees whose product divides or is a multiple of each"
            )
    if not dims:  # one GPU: the innermost dimension's link, unused
        dims = [NetworkDim.model_validate({**system.network[0].model_dump(), "npus": 1, "shape": None})]
    return SystemSpec.model_construct(name=system.name, accelerator=system.accelerator, network=dims)


def step_point(point: DesignPoint, mode: str, batch: int, seq_len: int) -> DesignPoint:
    """The serving point's step of `batch` sequences on each rank of one instance (its expert-parallel group), one
    micro-batch through its pipeline stages (decode: at a context of seq_len tokens; prefill: prompts of seq_len)."""
    workload = WorkloadSpec(
        mode=mode,  # type: ignore[arg-type]
        seq_len=seq_len,
        global_batch=batch * point.parallel.ep,
        micro_batch=batch,
        kernels=point.workload.kernels,
        attention_kernel=point.workload.attention_kernel,
        routing=point.workload.routing,
    )
    parallel = point.parallel.model_copy(update={"dp": point.parallel.ep})
    system = instance_system(point.system, parallel.world)
    return DesignPoint.model_construct(model=point.model, workload=workload, parallel=parallel, system=system)


def decode_point(point: DesignPoint) -> DesignPoint:
    """The decode pool as an aggregated point of its own: its layout, and a scheduler of its limits."""
    serving = point.workload.serving
    assert serving is not None and serving.decode is not None
    pool = serving.decode
    draft = serving.speculative.draft_tokens if serving.speculative else 0
    scheduler = SchedulerSpec(
        max_num_seqs=pool.max_num_seqs, max_batched_tokens=pool.max_num_seqs * (1 + draft), admission=pool.admission
    )
    spec = serving.model_copy(update={"kind": "aggregated", "decode": None, "scheduler": scheduler})
    workload = point.workload.model_copy(update={"serving": spec})
    parallel = ParallelSpec(dp=pool.dp, tp=pool.tp, pp=pool.pp, ep=pool.ep)
    return DesignPoint.model_construct(model=point.model, workload=workload, parallel=parallel, system=point.system)
