"""The fx generator on the dense LLaMA points it used to refuse, each against the symbolic generator with issue 22's
tolerances (generators/fx/compare.py): tensor parallelism beyond the key/value heads (replicated heads)."""

from collections import Counter

import pytest

pytest.importorskip("torch")

from helpers import make_point

from dse.spec import DesignPoint
from dse.workload import Block, Workload
from generators.fx.compare import Row, compare, figures
from generators.fx.generator import FxGenerator
from generators.symbolic import SymbolicGenerator

SEQ = 256


@pytest.fixture(scope="module")
def generator() -> FxGenerator:
    return FxGenerator()


def block(workload: Workload, name: str) -> Block:
    return next(b for b in workload.blocks if b.name == name)


def gemm_shapes(b: Block) -> Counter:
    """The GEMMs of a block by their batch and their sizes m, n, k in order (a weight gradient's m and n are the
    two generators' transposes of each other)."""
    return Counter((op.gemm[0], *sorted(op.gemm[1:])) for op in b.ops if op.gemm is not None)


def agreement(generator: FxGenerator, point: DesignPoint) -> tuple[dict[str, Row], Workload, Workload]:
    """The compare harness's rows for the point's one rank class (by figure), and the fx and symbolic workloads."""
    ours, theirs = generator.generate(point), SymbolicGenerator().generate(point)
    rows = compare(figures(ours, point), figures(theirs, point))
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
    return {r.figure: r for r in rows}, ours, theirs


@pytest.mark.parametrize(
    ("model", "parallel", "seq_len"),
    [
        ("tiny-llama", {"tp": 8}, SEQ),  # 4 kv heads, each on 2 ranks
        ("tiny-llama", {"tp": 8, "dp": 2, "sp": True}, SEQ),
        ("llama3-8b", {"tp": 16, "sp": True}, 1024),  # 8 kv heads, each on 2 ranks
    ],
)
def test_tp_beyond_the_kv_heads_replicates_them(generator, model, parallel, seq_len):
    """Each rank holds one key/value head (its wk and wv GEMMs h -> d_head, the symbolic generator's GEMMs shape
    for shape); the replicas' weight gradients are the ranks' own, no collective beyond the tp plan's, so the
    bytes per collective kind are the symbolic ones exactly; parameters per rank exact, peak memory within 5 %."""
    point = make_point(model, system="dgx-h100", seq_len=seq_len, **parallel)
    m = point.model
    assert parallel["tp"] > m.n_kv_heads
    rows, ours, theirs = agreement(generator, point)
    for name in ("layer.forward", "layer.backward"):
        assert gemm_shapes(block(ours, name)) == gemm_shapes(block(theirs, name))
    # forward GEMMs h -> d_head: wk and wv (and wq when a rank has one query head)
    forward = Counter(op.gemm[2:] for op in block(ours, "layer.forward").ops if op.gemm is not None)
    assert forward[(m.d_head, m.hidden)] == 2 + (m.heads // parallel["tp"] == 1)
    assert rows["GEMM FLOPs"].difference == pytest.approx(0, abs=1e-12)
    comm = [r for r in rows.values() if r.figure.endswith(" bytes") and r.figure != "peak memory bytes"]
    assert comm and all(r.a == r.b for r in comm)
