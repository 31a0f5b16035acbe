"""The fx generator's disk cache of captures (`generators.fx.disk_cache`), its errors naming the model's code, and the
model outputs it takes logits from. Speed itself is benchmarks/fx_first_evaluate.py's: no timing is asserted here.

Every capture here goes to a temporary cache directory ($DSE_FX_CACHE), never the user's."""

import contextlib
import json
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import ROOT
from fx_faulty_models import BUG_LINE
from helpers import make_point

from dse.cli.main import main
from dse.errors import SpecError
from dse.point.described import in_this_process
from dse.spec import DesignPoint
from dse.workload import Block, Workload
from generators.fx import disk_cache, factories
from generators.fx import generator as fx_generator
from generators.fx.generator import FxGenerator
from generators.fx.pieces import EPILOGUE, CaptureError

SEQ = 64
MODEL = '''"""A model factory of its own file, which a test edits: its source is part of every capture's key."""

from fx_tiny_llama import DTYPES, Transformer


def factory(model, workload):
    return Transformer(model, workload).to(DTYPES[model.dtype])
'''


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The cache directory, and the model's module (`fx_cache_model`) on the path."""
    root = tmp_path_factory.mktemp("fx_speed")
    (root / "fx_cache_model.py").write_text(MODEL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(disk_cache.ENV, str(root / "cache"))
        patch.syspath_prepend(str(root))
        yield root / "cache"


def point(factory: str = "fx_cache_model:factory", **parallel: object) -> DesignPoint:
    return make_point(seq_len=SEQ, overrides={"model.fx_factory": factory}, **parallel)


def figures(blocks: list[Block]) -> list[tuple]:
    """Each op's figures, block by block (not its name: a graph's node names count the nodes traced, the pruned
    ones too)."""
    return [
        (b.name, [(op.kind, op.category, op.flops, op.bytes, op.comm_bytes, op.deps) for op in b.ops]) for b in blocks
    ]


def same(a: Workload, b: Workload) -> bool:
    """The same step: its blocks op for op, its rank classes and its model FLOPs."""
    return (a.blocks, a.model_flops, a.class_of.tolist()) == (b.blocks, b.model_flops, b.class_of.tolist())


def generated(p: DesignPoint) -> tuple[Workload, float]:
    """The point's workload from a generator of its own (nothing in memory) and the time it spent capturing."""
    generator = FxGenerator()
    return generator.generate(p), generator.last_capture_s


@pytest.fixture(scope="module")
def first(cache: Path) -> Workload:
    """The point captured once (tp 2 with sp: the pieces hold collectives), into the empty cache; torch's warnings
    recorded, none of which may be the AOTAutograd 'boxed arguments' one it printed on every capture."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        workload, captured_s = generated(point(tp=2, sp=True))
    assert captured_s > 0
    assert not [w for w in caught if "boxed" in str(w.message)]
    return workload


def test_a_fresh_generator_reuses_the_disk_entries(cache, first):
    assert len(list(cache.glob("*.pkl"))) >= 3  # the layer, the prologue and the epilogue (and the built marker)
    workload, captured_s = generated(point(tp=2, sp=True))
    assert captured_s == 0
    assert same(workload, first)


def test_a_fresh_process_reuses_them_without_importing_torch(cache, first):
    """What a second `dse evaluate` or a Ray worker does: the same workload, no capture, and torch never imported
    (its import is most of a warm run's time)."""
    script = (
        "import pickle, sys\n"
        "from helpers import make_point\n"
        "from generators.fx.generator import FxGenerator\n"
        f"p = make_point(seq_len={SEQ}, overrides={{'model.fx_factory': 'fx_cache_model:factory'}}, tp=2, sp=True)\n"
        "g = FxGenerator()\n"
        "w = g.generate(p)\n"
        "sys.stdout.buffer.write(pickle.dumps((w, g.last_capture_s, 'torch' in sys.modules)))\n"
    )
    path = os.pathsep.join([str(cache.parent), str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, disk_cache.ENV: str(cache)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    workload, captured_s, imported_torch = pickle.loads(done.stdout)
    assert (captured_s, imported_torch) == (0, False)
    assert same(workload, first)


def test_a_corrupt_entry_is_captured_again(cache, first):
    largest = max(cache.glob("*.pkl"), key=lambda entry: entry.stat().st_size)  # the layer's
    largest.write_bytes(largest.read_bytes()[:100])  # truncated
    workload, captured_s = generated(point(tp=2, sp=True))
    assert captured_s > 0 and same(workload, first)
    workload, captured_s = generated(point(tp=2, sp=True))  # rewritten whole
    assert captured_s == 0 and same(workload, first)


def test_an_edited_model_source_is_captured_again(cache, first):
    """Last of the cache's tests: it edits the model's file, which every entry records with its hash (the epilogue's
    stands for them all: one capture)."""
    model = cache.parent / "fx_cache_model.py"
    model.write_text(MODEL + "# edited\n")
    generator = FxGenerator()
    generator._captured(point(tp=2, sp=True), 1, EPILOGUE)
    assert generator.last_capture_s > 0


def test_the_cache_is_bounded_and_can_be_turned_off(cache, monkeypatch):
    """Least recently used entries go first past MAX_BYTES; `off` stores and finds nothing; a directory that
    cannot be written leaves the run without entries, not failed."""
    monkeypatch.setenv(disk_cache.ENV, str(cache.parent / "bounded"))
    monkeypatch.setattr(disk_cache, "MAX_BYTES", 3500)
    for i in range(4):
        disk_cache.store(("key", i), b"x" * 1000, [])
        os.utime(disk_cache._entry(("key", i)), (i, i))  # ages told apart on coarse clocks
    assert [disk_cache.load(("key", i)) is not None for i in range(4)] == [False, True, True, True]
    monkeypatch.setenv(disk_cache.ENV, "off")
    disk_cache.store(("key", 9), b"x", [])
    assert disk_cache.directory() is None and disk_cache.load(("key", 9)) is None
    blocked = cache.parent / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(disk_cache.ENV, str(blocked / "cache"))
    disk_cache.store(("key", 9), b"x", [])
    assert disk_cache.load(("key", 9)) is None


def test_an_error_in_the_model_names_its_file_and_line(cache):
    with pytest.raises(CaptureError) as caught:
        generated(point("fx_faulty_models:misshaped"))
    message = str(caught.value)
    assert "\n" not in message and "eval_with_key" not in message
    assert f"in module 'feed_forward' (tests/fx_faulty_models.py:{BUG_LINE}, in forward)" in message
    assert message.startswith("model factory 'fx_faulty_models:misshaped': Attempting to broadcast")


def test_logits_are_taken_from_a_tuple_or_a_mapping(cache):
    """A model returning (logits, loss) or {'logits': ...} has the same head (the epilogue: norm, output, loss) as
    one returning its logits (its own loss is unread and pruned); one returning no logits is refused in one line
    saying what it returned."""

    def head(factory: str) -> list[tuple]:
        lowered = FxGenerator()._captured(point(factory), 1, EPILOGUE)
        assert lowered.backward is not None
        return figures([lowered.forward.block, lowered.backward.block])

    plain = head("fx_tiny_llama:llama")
    assert head("fx_faulty_models:with_loss") == plain and head("fx_faulty_models:as_mapping") == plain
    with pytest.raises(CaptureError, match=r"^HiddenOnly\.forward\(tokens\) returned a dict with keys \['hidden'\]; "):
        head("fx_faulty_models:hidden_only")


@pytest.fixture
def children(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[factories.Request]]:
    """The requests each describing child process was started with, in an empty cache (disk and memory)."""
    monkeypatch.setenv(disk_cache.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(factories, "_DESCRIBED", {})
    started: list[list[factories.Request]] = []
    child = factories._child

    def recorded(requests, timeout_s):
        started.append(list(requests))
        return child(requests, timeout_s)

    monkeypatch.setattr(factories, "_child", recorded)
    return started


def test_evaluate_describes_its_model_in_this_process_and_check_in_a_child(children, tmp_path, capsys):
    """`dse evaluate` captures its model in this process next: it describes it here too (a child would import
    torch a second time); `dse check`, which only checks, keeps the child's isolation."""
    point = {
        "model": {"name": "own", "fx_factory": "fx_cache_model:factory", "base": "tiny-llama"},
        "workload": {"seq_len": SEQ, "global_batch": 8, "micro_batch": 1},
        "parallel": {"dp": 8},
        "system": {"base": "dgx-h100", "network": {1: {"npus": 1}}},
    }
    path = tmp_path / "point.yaml"
    path.write_text(json.dumps(point))
    assert main(["evaluate", str(path), "--generator", "fx", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0
    assert children == []
    factories._DESCRIBED.clear()
    for entry in (tmp_path / "cache").glob("*.pkl"):
        entry.unlink()
    assert main(["check", str(path), "--generator", "fx"]) == 0
    assert [[name for name, _, _ in requests] for requests in children] == [["fx_cache_model:factory"]]


def test_a_factory_module_that_exits_is_refused_here_as_in_a_child(children, tmp_path, monkeypatch):
    """sys.exit in a factory's module described in this process is the child's one line with its exit code, not
    this process's exit."""
    (tmp_path / "exits_here.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = {"name": "own", "fx_factory": "exits_here:build"}
    refusals = []
    for where in (in_this_process(), contextlib.nullcontext()):
        with where, pytest.raises(SpecError) as caught:
            factories.describe_model(model, {"seq_len": SEQ})
        refusals.append(str(caught.value))
    assert refusals == 2 * [
        "field 'model.fx_factory': the check of model factory exits_here:build ended with exit code 3; a factory's "
        "module must import without exiting"
    ]
    assert len(children) == 1  # the second


def test_a_training_capture_records_the_sources_its_description_found(cache, monkeypatch):
    """The source files a capture's disk entry records are, for a training step, those the model's description in
    this process found (no second build); without one, the model's own build on meta finds the same files."""
    p = point()
    name = factories.factory_name(p.model)
    monkeypatch.setenv(disk_cache.ENV, disk_cache.OFF)
    for memory in ((factories, "_DESCRIBED"), (factories, "_SOURCES"), (fx_generator, "_SOURCES")):
        monkeypatch.setattr(*memory, {})
    built = fx_generator._model_sources(name, p.model, p.workload)
    assert str(cache.parent / "fx_cache_model.py") in built
    factories.describe_models(
        [(name, p.model.model_dump(mode="json"), factories.described_workload(p.workload))], here=True
    )
    fx_generator._SOURCES.clear()

    def no_build(name: str) -> None:
        raise AssertionError(f"{name} built again")

    monkeypatch.setattr(fx_generator, "resolve", no_build)
    assert fx_generator._model_sources(name, p.model, p.workload) == built
