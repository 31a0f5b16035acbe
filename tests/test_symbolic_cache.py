"""The generator's workload cache (a system-only change reuses the workload, and the price is the fresh one) and
the point keys it and a study's reuse go by."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_point

from dse import plugins
from dse.point.evaluate import evaluate
from dse.search.executor import PluginEvaluation
from dse.spec import DesignPoint
from generators.symbolic.generator import SymbolicGenerator

DGX = {"base": "dgx-h100", "network": {1: {"npus": 2}}}
FAST_LINKS = {"base": "dgx-h100", "network": {0: {"bandwidth_GBps": 900}, 1: {"npus": 2}}}


def test_a_system_only_change_reuses_the_workload_and_prices_it_like_a_fresh_one():
    base = make_point("llama3-8b", DGX, seq_len=2048, global_batch=32, tp=4, pp=2, dp=2, sp=True, zero=1)
    faster = make_point("llama3-8b", FAST_LINKS, seq_len=2048, global_batch=32, tp=4, pp=2, dp=2, sp=True, zero=1)
    other = make_point("llama3-8b", DGX, seq_len=2048, global_batch=32, tp=4, pp=2, dp=2, sp=True, zero=2)
    assert base.key != faster.key and base.workload_key == faster.workload_key != other.workload_key

    generator, cost_model = SymbolicGenerator(), plugins.cost_model("analytical")
    first = evaluate(base, generator, cost_model)
    reused = evaluate(faster, generator, cost_model)
    assert reused.workload.blocks is first.workload.blocks, "the system-only change did not regenerate"
    assert (first.workload.point_key, reused.workload.point_key) == (base.key, faster.key)
    assert evaluate(other, generator, cost_model).workload.blocks is not first.workload.blocks

    fresh = evaluate(faster, SymbolicGenerator(), cost_model)
    assert reused.metrics == fresh.metrics
    assert reused.metrics["step_time_s"] < first.metrics["step_time_s"], "faster NVLink must show in the price"


def test_points_of_one_affinity_share_their_stages_schedule_skeletons():
    """The affinity a study's executor routes by names exactly what the skeleton cache keys on: points equal in
    it reuse one call shape per stage of the programs the cost model prices (another tp, another recompute,
    more micro-batches of the same steady form), and a point that differs does not."""
    shape = dict(seq_len=2048, global_batch=32, pp=2, dp=2, sp=True, zero=1)
    tp4 = make_point("llama3-8b", DGX, tp=4, recompute="none", **shape)
    tp2 = make_point("llama3-8b", DGX, tp=2, recompute="full", **shape)
    # 28 micro-batches instead of 16: the same steady form, 6 micro-batches (2p + 2)
    more_micro_batches = make_point("llama3-8b", DGX, tp=4, **{**shape, "global_batch": 56})
    synced_each_micro_batch = make_point(
        "llama3-8b", DGX, tp=4, **{**shape, "zero": 2, "grad_reduce": "per_microbatch"}
    )
    evaluation = PluginEvaluation("symbolic", "analytical")
    assert evaluation.affinity(tp4) == evaluation.affinity(tp2) == evaluation.affinity(more_micro_batches)
    assert evaluation.affinity(tp4) != evaluation.affinity(synced_each_micro_batch)

    generator = SymbolicGenerator()
    points = (tp4, tp2, more_micro_batches, synced_each_micro_batch)
    workloads = [generator.generate(point) for point in points]
    assert [w.steady.microbatches for w in workloads] == [6] * 4
    assert [len(w.steady.programs[0].calls) for w in workloads[:3]] == [len(workloads[0].steady.programs[0].calls)] * 3
    shapes = [[p.shape for p in w.steady.programs] for w in workloads]
    for alike in shapes[1:3]:
        assert all(a is b for a, b in zip(shapes[0], alike, strict=True))
    assert not any(a is b for a, b in zip(shapes[0], shapes[3], strict=True))


CATALOG = Path(__file__).resolve().parent.parent / "dse" / "catalog"


@pytest.mark.parametrize("system", sorted(path.stem for path in (CATALOG / "systems").glob("*.yaml")))
def test_a_points_keys_hash_the_sorted_json_of_its_fields(system):
    """The keys, built field by field from cached canonical texts, against json.dumps of the whole dump: the
    same hash for every catalog model (the format is what stored studies were keyed by, so it must not drift)."""
    for model in sorted(path.stem for path in (CATALOG / "models").glob("*.yaml")):
        point = make_point(model, system, zero=1, recompute="selective")
        for key, dump in (
            (point.key, point.model_dump(mode="json")),
            (point.workload_key, point.model_dump(mode="json", exclude={"system"})),
        ):
            canonical = json.dumps(dump, sort_keys=True, separators=(",", ":"))
            assert key == hashlib.sha256(canonical.encode()).hexdigest()[:16], (model, system)


def test_a_points_key_is_its_content_whatever_the_order_its_tables_were_written_in_and_in_any_process():
    point = make_point("llama3-8b", DGX, seq_len=2048, global_batch=32, tp=4, pp=2, dp=2)
    raw = point.model_dump()
    accelerator = raw["system"]["accelerator"]
    for table in ("peak_tflops", "compute_efficiency"):
        accelerator[table] = dict(reversed(accelerator[table].items()))
    reordered = DesignPoint.model_validate(raw)
    assert list(reordered.system.accelerator.compute_efficiency) != list(point.system.accelerator.compute_efficiency)
    assert (reordered.key, reordered.workload_key) == (point.key, point.workload_key)
    accelerator["compute_efficiency"]["gemm"] *= 0.99
    assert DesignPoint.model_validate(raw).key != point.key

    script = (
        f"from dse.spec import DesignPoint; print(DesignPoint.model_validate_json({point.model_dump_json()!r}).key)"
    )
    for seed in ("1", "2"):
        other = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert other.stdout.strip() == point.key
