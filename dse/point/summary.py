"""What a generated workload holds, per rank class: the figures `dse generate --summary` prints."""

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from dse.workload import OpKind, TensorKind, Workload, expand


@dataclass
class ClassSummary:
    rank_class: int
    name: str
    ranks: int
    ops: Counter = field(default_factory=Counter)
    """Op count by category (compute categories and collective / send / recv kinds)."""
    flops: float = 0.0
    comm_bytes: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    """Bytes by (collective or p2p kind, axis), nccl-tests buffer convention."""
    static_bytes: dict[str, float] = field(default_factory=dict)
    """Parameters, gradients, optimizer states (training) or KV caches (inference) held for the whole step."""
    peak_activation_bytes: float = 0.0
    """Most activation bytes alive at once over the program's calls."""

    @property
    def parameters(self) -> float:
        return self.static_bytes.get(TensorKind.PARAMETER.value, 0.0)


def peak_activations(workload: Workload, rank_class: int) -> float:
    """Peak over call indices of the activations alive (producer <= call <= consumer)."""
    program = workload.programs[rank_class]
    delta = [0.0] * (len(program.calls) + 1)
    for t in program.tensors:
        if t.kind is not TensorKind.ACTIVATION:
            continue
        start = 0 if t.producer is None else t.producer
        end = len(program.calls) - 1 if t.consumer is None else t.consumer
        delta[start] += t.bytes
        delta[end + 1] -= t.bytes
    peak = alive = 0.0
    for d in delta:
        alive += d
        peak = max(peak, alive)
    return peak


def summarize(workload: Workload) -> list[ClassSummary]:
    out = []
    for program in workload.programs:
        s = ClassSummary(program.rank_class, program.name, len(workload.ranks_of(program.rank_class)))
        for flat in expand(workload, program):
            op = flat.op
            s.ops[op.category] += 1
            s.flops += op.flops
            if op.kind is not OpKind.COMPUTE:
                s.comm_bytes[(op.category, op.axis)] += op.comm_bytes
        for t in program.tensors:
            if t.producer is None and t.consumer is None and t.kind is not TensorKind.ACTIVATION:
                s.static_bytes[t.kind.value] = s.static_bytes.get(t.kind.value, 0.0) + t.bytes
        s.peak_activation_bytes = peak_activations(workload, program.rank_class)
        out.append(s)
    return out
