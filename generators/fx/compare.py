"""Agreement of two workloads of the same design point (the FX generator's and the symbolic generator's): the
figures issue 35's acceptance names, per rank class and for the step, side by side, each with its bound.

    parameters on a rank        equal      (parameter tensors held, in the model's dtype)
    GEMM FLOPs                  equal      (ops of category gemm over the class's program)
    bytes per collective kind   equal      (all_reduce, all_gather, ..., send, recv; summed over axes)
    peak memory                 3 %        (the analytical cost model's, on the point's system)
    step time                   3 %        (the same model's, for the whole step)
    ops per category            -          (shown, not checked: a captured graph has other kernel boundaries)

Equal is to a relative 1e-9: the figures are float sums, added in another order by each generator. The two
generators model the same framework (Megatron's layouts, torchtitan's module code), so counted figures have no
reason to differ; peak memory and step time depend on kernel boundaries and fusion, which a captured graph draws
differently, hence their 3 %.

`python -m generators.fx.compare POINT.yaml [--a fx] [--b symbolic]` prints the table for one point and exits 1
when a checked figure is off; `compare` and `render` are the same for tests and notes.
"""

import argparse
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from dse import plugins
from dse.interfaces import CostModel
from dse.spec import DesignPoint
from dse.workload import OpKind, TensorKind, Workload, expand

EQUAL = 1e-9
"""The relative bound of figures that must be equal (float sums added in another order)."""
MEMORY_TOLERANCE = 0.03
TIME_TOLERANCE = 0.03
STEP = "step"
"""The rank-class column of the step's own rows (step time)."""


@dataclass
class ClassFigures:
    """What one rank class's program holds and does in one step."""

    name: str
    ranks: int
    parameters: float = 0.0
    gemm_flops: float = 0.0
    comm_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Bytes by collective (or send / recv) kind, nccl-tests buffer convention, over every axis."""
    ops: Counter = field(default_factory=Counter)
    """Op count by category."""
    peak_memory_bytes: float = 0.0


@dataclass
class StepFigures:
    """A workload's figures: per rank class, and the step time."""

    classes: list[ClassFigures]
    step_time_s: float


def figures(workload: Workload, point: DesignPoint, cost_model: CostModel | None = None) -> StepFigures:
    """The figures of every rank class, in rank-class order, and the step time; peak memory and step time from
    `cost_model` (default: the analytical model, found through its entry point) on the point's system."""
    if cost_model is None:
        cost_model = plugins.cost_model(plugins.DEFAULT_COST_MODEL)
    result = cost_model.simulate(workload, point.system)
    out = []
    for program, priced in zip(workload.programs, result.classes, strict=True):
        f = ClassFigures(program.name, len(workload.ranks_of(program.rank_class)))
        for flat in expand(workload, program):
            op = flat.op
            f.ops[op.category] += 1
            if op.category == "gemm":
                f.gemm_flops += op.flops
            if op.kind is not OpKind.COMPUTE:
                f.comm_bytes[op.category] += op.comm_bytes
        parameter_bytes = sum(
            t.bytes
            for t in program.tensors
            if t.kind is TensorKind.PARAMETER and t.producer is None and t.consumer is None
        )
        f.parameters = parameter_bytes / point.model.dtype_bytes
        f.peak_memory_bytes = priced.peak_memory_bytes
        out.append(f)
    return StepFigures(out, result.step_time_s)


@dataclass(frozen=True)
class Row:
    """One figure of one rank class in both workloads; tolerance None: shown, not checked."""

    rank_class: str
    figure: str
    a: float
    b: float
    tolerance: float | None

    @property
    def difference(self) -> float:
        """(a - b) / b; 0 when both are 0, infinite when only b is."""
        if self.b == 0:
            return 0.0 if self.a == 0 else float("inf")
        return (self.a - self.b) / self.b

    @property
    def ok(self) -> bool:
        return self.tolerance is None or abs(self.difference) <= self.tolerance


def compare(a: StepFigures, b: StepFigures) -> list[Row]:
    """Rows for every figure of every rank class, the classes matched by their place (stage order), then the step
    time; a figure one side lacks counts as 0 there."""
    if len(a.classes) != len(b.classes):
        raise ValueError(
            f"the workloads have {len(a.classes)} and {len(b.classes)} rank classes; they are not of the same point"
        )
    rows = []
    for fa, fb in zip(a.classes, b.classes, strict=True):
        name = fa.name if fa.name == fb.name else f"{fa.name}/{fb.name}"
        rows.append(Row(name, "ranks", fa.ranks, fb.ranks, 0.0))
        rows.append(Row(name, "parameters on a rank", fa.parameters, fb.parameters, EQUAL))
        rows.append(Row(name, "GEMM FLOPs", fa.gemm_flops, fb.gemm_flops, EQUAL))
        for kind in sorted(fa.comm_bytes.keys() | fb.comm_bytes.keys()):
            rows.append(Row(name, f"{kind} bytes", fa.comm_bytes.get(kind, 0.0), fb.comm_bytes.get(kind, 0.0), EQUAL))
        rows.append(Row(name, "peak memory bytes", fa.peak_memory_bytes, fb.peak_memory_bytes, MEMORY_TOLERANCE))
        for category in sorted(fa.ops.keys() | fb.ops.keys()):
            rows.append(Row(name, f"ops: {category}", fa.ops.get(category, 0), fb.ops.get(category, 0), None))
    rows.append(Row(STEP, "step time s", a.step_time_s, b.step_time_s, TIME_TOLERANCE))
    return rows


def render(rows: Sequence[Row], a: str = "a", b: str = "b") -> str:
    """The rows as a Markdown table (readable in a terminal, pasted as is into a note)."""
    lines = [
        f"| rank class | figure | {a} | {b} | difference | tolerance | ok |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        tolerance = "-" if r.tolerance is None else "equal" if r.tolerance <= EQUAL else f"{100 * r.tolerance:g} %"
        verdict = "-" if r.tolerance is None else ("yes" if r.ok else "NO")
        lines.append(
            f"| {r.rank_class} | {r.figure} | {r.a:,.6g} | {r.b:,.6g} | {100 * r.difference:+.2f} % | {tolerance} | "
            f"{verdict} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from dse.errors import DseError
    from dse.point.feasibility import check_feasible
    from dse.point.points import load_point

    parser = argparse.ArgumentParser(prog="python -m generators.fx.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("point", help="a design point file")
    parser.add_argument("--a", default="fx", help="the first generator (default: fx)")
    parser.add_argument("--b", default="symbolic", help="the second generator (default: symbolic)")
    args = parser.parse_args(argv)
    try:
        point = load_point(args.point)
        check_feasible(point)
        workloads = [plugins.generator(name).generate(point) for name in (args.a, args.b)]
    except DseError as exc:
        print(exc, file=sys.stderr)
        return 2
    rows = compare(*(figures(w, point) for w in workloads))
    print(render(rows, args.a, args.b))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
