"""The token embedding's gradient under vocabulary-parallel tp (issue 35): each rank writes the gradient of its own
rows of the table, as Megatron's VocabParallelEmbedding's backward does (generators/fx/ends.py), not the whole
table's, which DTensor's RowwiseParallel wrote; and the symbolic generator charges the same bytes."""

import pytest

pytest.importorskip("torch")

from helpers import make_point

from dse.workload import OpKind
from generators.fx.generator import FxGenerator
from generators.symbolic import SymbolicGenerator

TP = 2
VOCAB, HIDDEN = 1024, 256  # tiny-llama's
SHARD = VOCAB // TP * HIDDEN * 2
"""Bytes of a rank's bf16 rows of the table: 512 x 256 x 2 = 262,144 (the whole table's half)."""


def embedding_ops(generator, sp: bool) -> dict[str, list]:
    point = make_point(seq_len=128, global_batch=4, overrides={"model.fx_factory": "fx_tiny_llama:llama"}, tp=TP,
                       dp=2, sp=sp)  # fmt: skip
    assert (point.model.vocab, point.model.hidden) == (VOCAB, HIDDEN)
    blocks = generator.generate(point).blocks
    return {b.name: [op for op in b.ops if op.category == "embedding"] for b in blocks if b.name.startswith("embed")}


@pytest.mark.parametrize("sp", [True, False])
def test_the_embedding_backward_writes_the_ranks_rows(sp) -> None:
    """One embedding backward kernel, writing 262,144 bytes (the whole table's 524,288 before), reading the output
    gradient (128 x 256 bf16) and the token ids (128 int64); the symbolic generator writes the same shard."""
    fx = embedding_ops(FxGenerator(), sp)
    (backward,) = fx["embed.backward"]
    assert backward.kind is OpKind.COMPUTE and backward.flops == 0
    assert backward.out_bytes == SHARD
    assert backward.bytes == SHARD + 128 * HIDDEN * 2 + 128 * 8
    (symbolic,) = embedding_ops(SymbolicGenerator(), sp)["embed.backward"]
    assert symbolic.out_bytes == SHARD
