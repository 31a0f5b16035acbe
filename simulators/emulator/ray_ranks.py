"""The replay's ranks as Ray actors spread over a cluster's nodes (`replay --ray ADDRESS`).

Rank 0's actor names the rendezvous (its node's IP and a port free there); every actor then joins the gloo job
over the cluster's network, so the traffic between ranks on different nodes crosses the real links. The actors'
nodes must be able to import dse (installed there, as for a study's evaluators); on one machine the driver's
source root is put on their PYTHONPATH. `--ray local` starts a private Ray on this machine instead, for a try.
"""

import os
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from simulators.emulator.contract import RankMetrics
from simulators.emulator.plan import Plan
from simulators.emulator.replay import GRACE_S, ReplayError, free_port

ACTOR_CPUS = 0.5
"""A rank mostly waits (compute is a sleep, communication is the network), so two ranks share a core."""
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])


@ray.remote(num_cpus=ACTOR_CPUS, max_restarts=0)
class RankActor:
    """One rank: reports where it runs, then runs its trace."""

    def node(self) -> tuple[str, str, int]:
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), free_port()

    def run(
        self, rank: int, world: int, init_method: str, plan: Plan, timeout_s: float, join_timeout_s: float
    ) -> dict[str, Any]:
        from simulators.emulator.rank import run_rank

        metrics = run_rank(rank, world, init_method, plan, timeout_s, join_timeout_s)
        return metrics.model_copy(update={"node": ray.get_runtime_context().get_node_id()}).model_dump()


def _placement(world: int) -> list[str]:
    """Node ids for ranks 0..world-1: consecutive ranks on one node, as a job fills its nodes' GPUs, spread
    evenly over the alive nodes (a node's share of ranks in proportion to the nodes' count)."""
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    return [nodes[rank * len(nodes) // world] for rank in range(world)]


def replay_ray(plan: Plan, timeout_s: float, join_timeout_s: float, address: str) -> list[RankMetrics]:
    """Run every rank as an actor on the cluster at `address` ('local': a private one on this machine). A rank
    that fails raises in its actor, which is killed with the others (its work still pending in gloo goes too)."""
    world = len(plan.ranks)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (SOURCE_ROOT, os.environ.get("PYTHONPATH", "")) if p)}
    if "GLOO_SOCKET_IFNAME" in os.environ:
        env["GLOO_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"]
    if address == "local":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ray.init(num_cpus=world, include_dashboard=False, runtime_env={"env_vars": env})
    else:
        ray.init(address=address, runtime_env={"env_vars": env})
    actors = []
    try:
        actors = [
            RankActor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            for node in _placement(world)
        ]
        _, ip, port = ray.get(actors[0].node.remote(), timeout=join_timeout_s + GRACE_S)
        init_method = f"tcp://{ip}:{port}"
        args = (world, init_method, plan, timeout_s, join_timeout_s)
        refs = [actor.run.remote(rank, *args) for rank, actor in enumerate(actors)]
        deadline = join_timeout_s + timeout_s + GRACE_S
        return [RankMetrics.model_validate(value) for value in ray.get(refs, timeout=deadline)]
    except GetTimeoutError:
        raise ReplayError(
            f"the ranks did not join within {join_timeout_s:g} s and finish within {timeout_s:g} s more on the Ray "
            "cluster (deadlock?)"
        ) from None
    except RayError as error:
        message = " ".join(str(error).split())
        raise ReplayError(f"a rank failed on the Ray cluster: {message[-400:]}") from None
    finally:
        for actor in actors:
            ray.kill(actor)
        ray.shutdown()
