"""The ASTRA-sim cost model: a workload's Chakra traces and our system's network run through the real simulator."""

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dse.errors import InfeasibleError
from dse.interfaces import ClassResult, SimResult, TimelineEvent
from dse.point import chakra
from dse.system import SystemSpec
from dse.workload import Collective, Workload
from simulators.analytical.cost_model import AnalyticalCostModel
from simulators.analytical.trace import to_chrome_trace
from simulators.astrasim.config import expanded_sizes, write_configs
from simulators.astrasim.isolated import collective_workload, operation_time, send_workload
from simulators.astrasim.options import AstraSimOptions
from simulators.astrasim.parse import RankStats, parse_log
from simulators.astrasim.runner import AstraSimError, check_loads, resolve_binary, run
from simulators.astrasim.scaling import scaled_world
from simulators.astrasim.timeline import time_by_category, timeline_events
from simulators.external import run_folder
from simulators.result_cache import ResultCache

_RESULTS = ResultCache()
TRACE_PREFIX = "trace"


class AstraSimCostModel:
    """Prices a step with ASTRA-sim's analytical backends, fed the workload's Chakra traces (dse.point.chakra).

    Each evaluation writes a private run folder (traces, communicator groups, network.yml, system.json, the
    remote-memory file, ASTRA-sim's log folder), runs the binary with a timeout and reads every rank's finish time,
    exposed communication and compute and communication times from its log. A rank class's end is the latest of
    its ranks' finishes, its times the mean over its ranks. With options.max_npus, a larger world is simulated on
    fewer data-parallel replicas whose collectives keep their time (scaling.py).

    Peak memory comes from the analytical memory model over the same workload (with the runtime reserve and
    fragmentation): ASTRA-sim's own tracker (`track-local-mem`) reads per-node `inputs`/`outputs` attributes of
    tensor names and sizes that the Chakra export does not write (it fills the protobuf's IOInfo instead), and it
    knows nothing of parameters, optimizer states or activations kept between micro-batches.
    """

    name = "astrasim"
    Options = AstraSimOptions

    def __init__(self, options: AstraSimOptions | None = None, timeline: bool = False) -> None:
        self.options = options or AstraSimOptions()
        self.timeline = timeline

    def preflight(self) -> None:
        """The binary the options name exists, is executable and loads its shared libraries
        (dse.interfaces.PreflightCostModel): each would otherwise fail every evaluation with the same reason."""
        check_loads(resolve_binary(self.options))

    def with_timeline(self) -> "AstraSimCostModel":
        """The same settings, keeping each rank class's schedule as ASTRA-sim ran it (dse.interfaces.
        TimelineCostModel): ASTRA-sim then logs every node, so it is asked for per use."""
        return AstraSimCostModel(self.options, timeline=True)

    def chrome_trace(self, result: SimResult) -> dict[str, Any]:
        return to_chrome_trace(result)

    def simulate(self, workload: Workload, system: SystemSpec) -> SimResult:
        """The step's result; a point priced before in this process with the same settings is read back."""
        if self.timeline:  # a timeline is large and wanted once
            return self._simulate(workload, system)
        key = (workload.point_key, system.model_dump_json(), self.options.model_dump_json())
        return _RESULTS.priced(key, workload, lambda: self._simulate(workload, system))

    def collective_time(self, kind: Collective, size: float, ranks: Sequence[int], system: SystemSpec) -> float:
        """ASTRA-sim's time of one collective alone (dse.interfaces.CollectiveCostModel); `ranks` evenly spaced
        from 0, as every parallel axis's first group is."""
        return operation_time(self.simulate(collective_workload(Collective(kind), size, ranks, system.npus), system))

    def p2p_time(self, size: float, src: int, dst: int, system: SystemSpec) -> float:
        """ASTRA-sim's time of one send alone (dse.interfaces.CollectiveCostModel)."""
        return operation_time(self.simulate(send_workload(size, src, dst, system.npus), system))

    def _simulate(self, workload: Workload, system: SystemSpec) -> SimResult:
        binary = resolve_binary(self.options)
        if workload.layout.world != system.npus:
            raise InfeasibleError(
                f"the workload has {workload.layout.world} ranks but system '{system.name}' has {system.npus} NPUs; "
                "ASTRA-sim simulates every NPU, so choose parallel degrees whose product is the system's NPUs"
            )
        full_workload, full_system = workload, system
        if self.options.max_npus is not None:
            workload, system = scaled_world(workload, system, self.options.max_npus)
        sizes = expanded_sizes(system)
        if self.options.backend == "congestion_aware" and len(sizes) > 1:
            raise AstraSimError(
                f"ASTRA-sim's congestion-aware backend simulates 1-D networks only; system '{system.name}' has "
                f"{len(sizes)} dimensions (a torus counts one per side): use backend congestion_unaware"
            )
        folder = run_folder(self.options.keep_runs, workload.point_key, "astrasim")
        try:
            stats, events = self._run(binary, folder, workload, system, sizes)
        except AstraSimError as error:
            if self.options.keep_runs is None:
                raise
            raise AstraSimError(f"{error}; run folder {folder}") from None
        finally:
            if self.options.keep_runs is None:
                shutil.rmtree(folder, ignore_errors=True)
        return _result(full_workload, full_system, workload.class_of, stats, events)

    def _run(
        self, binary: Path, folder: Path, workload: Workload, system: SystemSpec, sizes: list[int]
    ) -> tuple[list[RankStats], list[TimelineEvent]]:
        """Every rank's figures and, with a timeline, its representative ranks' events."""
        traces = folder / "traces"
        chakra.export(workload, traces, sizes, prefix=TRACE_PREFIX, accelerator=system.accelerator)
        write_configs(folder, system, workload.dtype, self.options, trace=self.timeline)
        logs = folder / "log"
        logs.mkdir()
        command = [
            str(binary),
            f"--workload-configuration={traces / TRACE_PREFIX}",
            f"--comm-group-configuration={traces / TRACE_PREFIX}.comm_groups.json",
            f"--system-configuration={folder / 'system.json'}",
            f"--network-configuration={folder / 'network.yml'}",
            f"--remote-memory-configuration={folder / 'remote_memory.json'}",
            f"--logging-folder={logs}",
        ]
        exit_code, output = run(command, folder, self.options.timeout_s)
        (folder / "output.txt").write_text(output)
        errors = logs / "err.log"
        if errors.exists():
            output += errors.read_text(errors="replace")
        stats = parse_log(output, workload.layout.world, exit_code)
        log = logs / "log.log"
        events = timeline_events(log.read_text(errors="replace"), workload) if self.timeline and log.exists() else []
        return stats, events


def _result(
    workload: Workload,
    system: SystemSpec,
    simulated: np.ndarray,
    stats: list[RankStats],
    events: list[TimelineEvent],
) -> SimResult:
    """One ClassResult per rank class: the latest finish of its simulated ranks (`simulated`: their classes), the
    mean of their times, its rank count in the full world and the analytical memory model's peak (see
    AstraSimCostModel). A class no rank runs (a workload may define one) is all zeros. Busy time per category is
    known only with a timeline."""
    memory = AnalyticalCostModel().simulate(workload, system)
    classes = []
    for index, priced in enumerate(memory.classes):
        ranks = [stats[int(rank)] for rank in np.flatnonzero(simulated == index)] or [RankStats(0.0, 0.0)]
        classes.append(
            ClassResult(
                name=priced.name,
                ranks=priced.ranks,
                end_s=max(r.finish_s for r in ranks),
                compute_s=float(np.mean([r.compute_s for r in ranks])),
                comm_s=float(np.mean([r.comm_s for r in ranks])),
                exposed_comm_s=float(np.mean([r.exposed_comm_s for r in ranks])),
                peak_memory_bytes=priced.peak_memory_bytes,
                memory_at_peak=priced.memory_at_peak,
                time_by_category=time_by_category(events, index),
            )
        )
    return SimResult(step_time_s=max(c.end_s for c in classes), classes=classes, timeline=events)
