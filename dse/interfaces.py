"""The contracts between the core and its plugins: generators make Workloads, cost models price them."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from dse.errors import InfeasibleError
from dse.spec import DesignPoint
from dse.system import SystemSpec
from dse.workload import Collective, Workload


@dataclass(slots=True, frozen=True)
class TimelineEvent:
    """One op on one stream of one rank class, for Chrome/Perfetto traces."""

    rank_class: int
    stream: str
    name: str
    category: str
    start_s: float
    end_s: float
    source: str = ""
    """What priced the op (a cost model's own words, e.g. 'roofline', 'gemm_table' or, for a collective,
    'nccl_table'); '' if not said."""


@dataclass(slots=True)
class ClassResult:
    """What one rank class does during the step. Times are unions of busy intervals on the class's streams."""

    name: str
    ranks: int
    end_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    peak_memory_bytes: float
    memory_at_peak: dict[str, float]
    """Bytes by tensor kind at the moment of the peak (parameter, gradient, ..., temporary, reserve)."""
    time_by_category: dict[str, float]
    """Busy seconds per op category (gemm, attention, all_reduce, ...), summed over ops."""


@dataclass(slots=True)
class SimResult:
    step_time_s: float
    classes: list[ClassResult]
    timeline: list[TimelineEvent] = field(default_factory=list)

    def _rank_mean(self, attr: str) -> float:
        total = sum(c.ranks for c in self.classes)
        return sum(getattr(c, attr) * c.ranks for c in self.classes) / total

    @property
    def compute_time_s(self) -> float:
        """Mean over ranks of the time the compute stream is busy."""
        return self._rank_mean("compute_s")

    @property
    def comm_time_s(self) -> float:
        """Mean over ranks of the time any communication stream is busy."""
        return self._rank_mean("comm_s")

    @property
    def exposed_comm_time_s(self) -> float:
        """Mean over ranks of the communication time not hidden under compute."""
        return self._rank_mean("exposed_comm_s")

    @property
    def overlap_ratio(self) -> float:
        """Share of communication time hidden under compute (0 when there is no communication)."""
        comm = self.comm_time_s
        return 0.0 if comm == 0 else 1.0 - self.exposed_comm_time_s / comm

    @property
    def peak_memory_bytes(self) -> float:
        return max(c.peak_memory_bytes for c in self.classes)


class WorkloadGenerator(Protocol):
    """May also define `affinity(point) -> Hashable`: what of a point decides which of the generator's
    per-process caches it reuses. A study's executor sends points of one affinity to the same evaluator process
    when it can, so that each process warms its caches for its share of the space instead of for all of it.

    May also define, on the class the entry point names, `unread_fields: Mapping[str, str]`: the dotted point
    fields it never reads, each with what to do instead (`FieldReadingGenerator`)."""

    name: str

    def generate(self, point: DesignPoint) -> Workload: ...


class CostModel(Protocol):
    name: str

    def simulate(self, workload: Workload, system: SystemSpec) -> SimResult: ...


@runtime_checkable
class FieldReadingGenerator(WorkloadGenerator, Protocol):
    """A generator that names the point fields it never reads (on its class: they are checked when a point or a
    study loads, before the generator is built).

    An optional capability: a field that only some generators read (`model.fx_factory`, the fx generator's model
    code) would be silently ignored by the others, and the README's rule is that an ignored setting is an error.
    A point or a study that sets one of these fields to anything but its default is refused, naming the field,
    whatever generator it names; the core keeps no list of which generator reads what."""

    unread_fields: ClassVar[Mapping[str, str]]
    """Dotted point field (e.g. 'model.fx_factory') -> why it is not read and what to do instead."""


@dataclass(frozen=True)
class ModelDescription:
    """A model as its own code builds it: its ModelSpec fields (`fields`, `moe` a mapping) and its exact parameter
    counts (the module's sum of numel, a tied table once; active: a MoE layer's routed experts top_k of n)."""

    factory: str
    fields: dict[str, Any]
    parameters: int
    active: int
    unexpressed: str | None = None
    """Where ModelSpec's closed-form count (dse.modelstats) of these fields differs from the module's, in words."""


class ModelDescriber(Protocol):
    """`describe_model`, declared on a generator's entry point (as `unread_fields` is) by a generator whose model is
    code (fx): the point's model is then the code's, and its fields are optional (dse.point.described).

    Called with a point's model and workload data as the file gives them (fields may be missing), it describes
    the model the code builds, without importing anything heavy into the caller (fx builds it in a child
    process, unless the caller asks for it in this process: `dse.point.described.in_this_process`, a command about
    to generate the point here), or raises a SpecError naming the field and the fix."""

    def __call__(self, model: Mapping[str, Any], workload: Mapping[str, Any]) -> ModelDescription: ...


@runtime_checkable
class PreflightGenerator(WorkloadGenerator, Protocol):
    """A generator that can check, before anything is generated, what would otherwise fail every point it is given.

    An optional capability: `dse check`, `dse run` (before the first trial) and `dse evaluate` (before generating)
    call it, so that, e.g., a model factory that does not import is one line and exit code 2, not every trial of a
    study failed with the same reason."""

    def preflight(self, points: Sequence[DesignPoint]) -> None:
        """Raise a DseError whose one-line message names the field and the fix, for the first of the points
        (a study's first point and its one-parameter variants, or the one point evaluated) that could not run."""
        ...


@runtime_checkable
class PreflightCostModel(CostModel, Protocol):
    """A cost model that can check, before any point is priced, that it can run at all here: its binary exists
    and its shared libraries load, its command resolves, what it imports is installed.

    An optional capability, called where PreflightGenerator's is; what its options alone decide (a value, a path
    that is a file or a folder) is checked by its `Options` when the study or point loads."""

    def preflight(self) -> None:
        """Raise a DseError whose one-line message names the option (or setting) and the fix."""
        ...


@runtime_checkable
class CollectiveCostModel(CostModel, Protocol):
    """A cost model that also prices one collective or one send alone on a system's network, as nccl-tests
    measures them (nothing else in flight, sizes in the nccl-tests convention, NPU r holding rank r).

    An optional capability: `dse calibrate` checks it against nccl-tests' bus bandwidths, so a network model is
    checked where it can be measured in isolation, not only through whole steps; a cost model without it has
    its end-to-end cases checked and its collective rows left out."""

    def collective_time(self, kind: Collective, size: float, ranks: Sequence[int], system: SystemSpec) -> float:
        """Seconds of a collective of `size` bytes over the NPUs `ranks` of the system."""
        ...

    def p2p_time(self, size: float, src: int, dst: int, system: SystemSpec) -> float:
        """Seconds of a send of `size` bytes from NPU src to NPU dst."""
        ...


@runtime_checkable
class BatchCostModel(CostModel, Protocol):
    """A cost model that prices one workload on many systems in one call, much faster than one call per system.

    An optional capability for hardware-planning sweeps, where one parallel configuration is priced on a grid of
    systems (HBM size, FLOP/s, link bandwidths): the workload's structure is shared and only durations differ."""

    def simulate_many(self, workload: Workload, systems: Sequence[SystemSpec]) -> list[SimResult | InfeasibleError]:
        """Per system, what `simulate` would give (within the model's stated tolerance), or the InfeasibleError
        it would raise for that system."""
        ...


@runtime_checkable
class TimelineCostModel(CostModel, Protocol):
    """A cost model that can keep every op's interval and write them as a Chrome/Perfetto trace.

    An optional capability: `dse evaluate --trace` and `dse timeline` use it. Keeping a timeline is asked for per
    use (`with_timeline`), because it costs: the analytical model then runs every op by itself instead of pricing
    repeated runs of kernels once."""

    def with_timeline(self) -> CostModel:
        """A cost model of the same settings whose results carry their timeline."""
        ...

    def chrome_trace(self, result: SimResult) -> dict[str, Any]:
        """The result's timeline as Chrome trace JSON (`{"traceEvents": [...]}`)."""
        ...
