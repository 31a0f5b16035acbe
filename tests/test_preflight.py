"""Pre-flight: what a run would otherwise find trial by trial (an ASTRA-sim binary that cannot load its libraries,
an emulator command that does not run, a model factory that does not import or build, a storage that does not
answer) is one line and exit code 2 from `dse check`, `dse run` (before its first trial and its output folder)
and `dse evaluate` (before generating); and `dse evaluate --json` keeps stdout for its one JSON line."""

import json
import re
import socket
import sys
import time
from pathlib import Path

import pytest
from conftest import patience
from helpers import make_point, run_cli
from test_plugin_options import POINT, STUDY, refused, write

from dse.cli.main import main
from dse.errors import DseError, SpecError
from dse.search import preflight
from simulators.astrasim.runner import install_hint

SONAME = re.compile(rb"libprotobuf\.so\.(\d+)\x00")


def run_refused(tmp_path: Path, study: dict, *fragments: str) -> None:
    """`dse run` refuses the study before its first trial, and before it makes its output folder."""
    path = write(tmp_path, "study.yaml", study)
    refused(run_cli("run", str(path), "--inline", "--out", str(tmp_path / "out")), str(path), *fragments)
    assert not (tmp_path / "out").exists()


def soname(binary: Path) -> bytes:
    found = SONAME.search(binary.read_bytes())
    if found is None:
        pytest.skip(f"{binary} does not link libprotobuf.so.N")
    return found[0][:-1]


def without_library(binary: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the binary that needs a libprotobuf version no system has: its library is not found."""
    name = soname(binary)
    missing = name[: -len(name.rsplit(b".", 1)[1])] + b"9" * len(name.rsplit(b".", 1)[1])
    copy = tmp_path / "astrasim-copy"
    copy.write_bytes(binary.read_bytes().replace(name + b"\x00", missing + b"\x00"))
    copy.chmod(0o755)
    return copy, missing.decode()


def with_broken_library(binary: Path, tmp_path: Path) -> tuple[Path, str]:
    """A wrapper script that runs the real binary with its own libprotobuf soname shadowed by a broken file."""
    name = soname(binary).decode()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / name).write_text("not a library\n")
    wrapper = tmp_path / "astrasim-wrapper"
    wrapper.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH={tmp_path / "lib"} exec {binary} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, name


def test_an_astrasim_library_that_does_not_load_is_one_line_naming_it_and_its_package(binary, tmp_path):
    point = write(tmp_path, "point.yaml", POINT)
    for make, reason in ((without_library, "cannot open shared object file"), (with_broken_library, "file too short")):
        program, library = make(binary, tmp_path)
        says = [library, reason, "apt-get install lib" + library.removeprefix("lib").replace(".so.", "")]
        option = f"binary={program}"
        for command in ("check", "evaluate"):
            refused(
                run_cli(command, str(point), "--cost-model", "astrasim", "--cost-option", option),
                f"{point}: --cost-model astrasim: ASTRA-sim binary {program} cannot load its shared library",
                *says,
            )
        study = {**STUDY, "cost_model": "astrasim", "cost_model_options": {"binary": str(program)}}
        run_refused(tmp_path, study, "cost model 'astrasim'", *says)
    assert "apt-get install libprotobuf32" in install_hint("/usr/lib/x86_64-linux-gnu/libprotobuf.so.32")


def test_a_missing_or_unrunnable_astrasim_binary_is_refused_before_any_trial(binary, tmp_path, monkeypatch):
    monkeypatch.delenv("ASTRA_SIM_BIN", raising=False)
    run_refused(
        tmp_path, {**STUDY, "cost_model": "astrasim"}, "cost model 'astrasim'", "no ASTRA-sim binary configured"
    )
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    run_refused(
        tmp_path,
        {**STUDY, "cost_model": "astrasim", "cost_model_options": {"binary": str(plain)}},
        f"ASTRA-sim binary {plain} is not executable",
    )
    monkeypatch.setenv("ASTRA_SIM_BIN", str(binary))
    assert run_cli("check", str(write(tmp_path, "ok.yaml", {**STUDY, "cost_model": "astrasim"})))[0] == 0


def test_an_emulator_command_that_does_not_run_is_refused_before_any_trial(tmp_path):
    plain, folder, orphan = tmp_path / "plain.sh", tmp_path / "folder", tmp_path / "orphan.sh"
    plain.write_text("#!/bin/sh\n")
    folder.mkdir()
    orphan.write_text(f"#!{tmp_path / 'no-such-interpreter'}\n")
    orphan.chmod(0o755)
    cases = {
        str(tmp_path / "missing"): "does not exist",
        "no-such-emulator-on-path": "is not found on PATH",
        str(plain): "is not executable",
        str(folder): "is a folder, not a program",
        str(orphan): "is a script whose interpreter",
    }
    for command, reason in cases.items():
        study = {**STUDY, "cost_model": "emulator", "cost_model_options": {"command": [command]}}
        path = write(tmp_path, "study.yaml", study)
        refused(
            run_cli("check", str(path)),
            f"{path}: cost model 'emulator': field 'cost_model_options.command': emulator command '{command}'",
            reason,
        )
    run_refused(tmp_path, study, reason)
    good = tmp_path / "good.py"
    good.write_text(f"#!{sys.executable}\nprint('{{\"step_time_s\": 0.5}}')\n")
    good.chmod(0o755)
    study = {**STUDY, "cost_model": "emulator", "cost_model_options": {"command": [str(good)]}}
    assert run_cli("check", str(write(tmp_path, "good.yaml", study)))[0] == 0


FACTORIES = {
    "exits_on_import.py": "import sys\nsys.exit(3)\n",
    "hangs_on_import.py": "import time\ntime.sleep(600)\n",
    "not_a_module.py": "def build(model, workload):\n    return 3\n",
}


def factory_point(name: str):
    return make_point("tiny-llama", tp=2, dp=4, overrides={"model.fx_factory": name})


def test_a_model_factory_that_cannot_build_the_model_is_refused_by_the_preflight(tmp_path, monkeypatch):
    """Checked in a child process with this one's sys.path, each failure one line naming model.fx_factory."""
    pytest.importorskip("torch")
    from generators.fx.factories import check

    for name, source in FACTORIES.items():
        (tmp_path / name).write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "no_such_module:build": "cannot import 'no_such_module' (No module named 'no_such_module')",
        "exits_on_import:build": "ended with exit code 3",
        "not_a_module:build": "'not_a_module:build' returned int, not a torch.nn.Module",
        "os:system": "'os:system' failed when called as factory(model, workload) (TypeError",
        "nope": "no FX model factory 'nope' is registered",
    }
    for name, reason in cases.items():
        with pytest.raises(SpecError, match=r"^field 'model\.fx_factory': ") as caught:
            check([factory_point(name)])
        assert reason in str(caught.value) and "\n" not in str(caught.value), (name, caught.value)
    started = time.monotonic()
    with pytest.raises(SpecError, match="took over 1 s"):  # it hangs for good: any timeout proves it
        check([factory_point("hangs_on_import:build")], timeout_s=1)
    assert time.monotonic() - started < patience(30)
    check([factory_point("fx_tiny_llama:llama"), factory_point("llama")])  # importable, and builds its layers


def test_a_study_whose_model_factory_does_not_import_is_refused_before_any_trial(tmp_path):
    pytest.importorskip("torch")
    model = {"base": "tiny-llama", "fx_factory": "no_such_module:build"}
    study = {**STUDY, "generator": "fx", "base": {**POINT, "model": model}}
    refused(run_cli("check", str(write(tmp_path, "study.yaml", study))), "field 'model.fx_factory': cannot import")
    run_refused(tmp_path, study, "field 'model.fx_factory': cannot import 'no_such_module'")


NOISY_FACTORY = """\
import os
import sys

print("printed on import")
os.write(1, b"written to file descriptor 1 on import\\n")


def build(model, workload):
    print("printed while building")
    sys.stdout.flush()
    from fx_tiny_llama import llama

    return llama(model, workload)
"""


def test_json_output_is_the_one_line_even_when_a_factory_prints(tmp_path, monkeypatch, capfd):
    """`dse evaluate --json`: a factory module's prints, at import and when called, and what it writes to file
    descriptor 1, reach stderr; stdout holds the JSON line alone."""
    pytest.importorskip("torch")
    (tmp_path / "noisy_factory.py").write_text(NOISY_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    point = write(
        tmp_path, "point.yaml", {**POINT, "model": {"base": "tiny-llama", "fx_factory": "noisy_factory:build"}}
    )
    assert main(["evaluate", str(point), "--json", "--generator", "fx"]) == 0
    out, err = capfd.readouterr()
    assert len(out.splitlines()) == 1 and json.loads(out)["step_time_s"] > 0, out
    assert "printed on import" in err and "written to file descriptor 1 on import" in err
    assert "printed while building" in err


def silent_port() -> socket.socket:
    """A port that takes connections and never answers: a storage server that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    return server


def test_a_storage_that_does_not_answer_is_refused_within_its_timeout(tmp_path, monkeypatch):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    run_refused(tmp_path, {**STUDY, "storage": f"redis://127.0.0.1:{port}/0"}, "field 'storage'", "does not answer")
    monkeypatch.setattr(preflight, "STORAGE_TIMEOUT_S", 2)  # libpq's least
    with silent_port() as server:
        port = server.getsockname()[1]
        for url in (f"redis://127.0.0.1:{port}/0", f"postgresql://dse@127.0.0.1:{port}/optuna"):
            started = time.monotonic()
            with pytest.raises(DseError, match=r"field 'storage': .* does not answer .*waited up to 2 s"):
                preflight.check_storage(url, "study.yaml")
            assert 1 < time.monotonic() - started < patience(15), url


def test_a_storage_that_answers_passes(redis_url):
    preflight.check_storage(redis_url, "study.yaml")


def test_plugin_flags_given_for_a_study_are_refused_by_check(tmp_path):
    path = write(tmp_path, "study.yaml", STUDY)
    refused(run_cli("check", str(path), "--cost-model", "astrasim"), f"--cost-model: {path} is a study file")
    refused(run_cli("check", str(path), "--cost-option", "exact=true"), f"--cost-option: {path} is a study file")
    assert run_cli("check", str(path))[0] == 0


def test_good_plugins_pass_the_preflight(binary, tmp_path):
    point = write(tmp_path, "point.yaml", POINT)
    assert run_cli("check", str(point), "--cost-model", "astrasim", "--cost-option", f"binary={binary}")[0] == 0
    code, out, _ = run_cli(
        "evaluate", str(point), "--json", "--cost-model", "astrasim", "--cost-option", f"binary={binary}"
    )
    assert code == 0 and json.loads(out)["step_time_s"] > 0
