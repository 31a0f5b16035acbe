"""Every command and every plugin option, fuzzed: refused up front in one line, or run to a sane end.

tests/test_bad_input.py fuzzes the point and study files through `dse evaluate` and `dse check`; this file reaches
the rest of what a user types or leaves lying around, through `dse.cli.main.main` in this process as a user would
run it, over 1,000 generated cases per run (each test's count is a constant below):

- the command line of evaluate, run, check, generate, report, compare, timeline, sync, nightly and ui, walked from
  the parser (a flag added later must get a slot here): each case sets at least one argument to a value that is
  wrong (a missing, unwritable or NUL-byte path, a port beyond 65535, a nan threshold, ...) and must be refused;
- a finished study's folder with one file damaged (trials.parquet, study.yaml, optuna-journal.log, mlflow.db:
  emptied, cut short, random bytes, a foreign table, a garbage line) under every command that reads it;
- the point files of test_bad_input's mutations under `generate` and the ASTRA-sim cost model, and its study-file
  mutations under `run` and `nightly`;
- option dicts drawn from each installed cost model's `Options` schema (found through entry points), given as
  `--cost-option KEY=VALUE`, as a study's `cost_model_options` and as its `refine` options.

Each case must end with exit 0 or 2 (2, exactly, where the input is wrong), print no traceback, and end within
its (load-scaled) time; exit 2 is one `error:` line naming what to fix (argparse's own usage errors keep their
form). Nothing starts a server: `dse ui` reaching its server, or anything starting a local Ray, is recorded or
stopped (both are real and costly, and bad input must be refused before either).
"""

import contextlib
import shutil
import socket
import sqlite3
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import ray
import yaml
from fuzzing import (
    NUL,
    POINT_PATHS,
    POINT_SEEDS,
    PROFILE,
    STUDY_PATHS,
    STUDY_SEEDS,
    UNWRITABLE,
    World,
    WouldStartRay,
    bounded,
    judge,
    mutated,
    option_models,
    option_sets,
    option_values,
    run_command,
    scalar,
    tiny_points,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dse import plugins
from dse.cli import procgroup
from dse.cli.main import _parser

CASE_SECONDS = 20.0
"""Wall time a case may take on an idle machine: bad input is refused in milliseconds; the slowest good input
here (a generation on 1,024 ranks, an ASTRA-sim run) takes a few seconds."""
WORK_SECONDS = 60.0
"""A case that does a study's work (a resumed run, a sync: MLflow's import and writer process, ~10 s)."""
ARGV_CASES = 200
FOLDER_CASES = {"report": 30, "compare": 20, "timeline": 20, "ui": 15, "sync": 4, "run": 3}
POINT_CASES = {"summary": 30, "chakra": 20, "astrasim": 12}
STUDY_CASES = {"run": 30, "nightly": 16}
OPTION_CASES = {"cli": 45, "study": 40, "refine": 40}
COMMANDS = ("evaluate", "run", "check", "generate", "report", "compare", "timeline", "sync", "nightly", "ui")
OTHER_COMMANDS = {"calibrate"}
"""Commands this file leaves out: `dse calibrate` reads no input but its --json flag."""
FUZZ = settings(
    PROFILE,
    suppress_health_check=[*PROFILE.suppress_health_check, HealthCheck.filter_too_much],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
"""test_bad_input's profile, without shrinking: a case is already small (one or two wrong arguments, one damaged
file, one mutated file), its failure shows it whole, and shrinking a case that ran a study would take minutes."""
FLAG = "<flag>"
"""A value slot meaning: the bare flag, without a value."""


# ---- the world a case runs in: files, folders, a finished study --------------------------------------------------

TINY_STUDY = """\
name: fuzz-tiny
seed: 1
objectives: {step_time: minimize, peak_memory: minimize}
constraints: [fits_memory]
sampler: grid
trials: 4
workers: 1
tracking: {child_runs: pareto}
base:
  model: tiny-llama
  workload: {mode: train, seq_len: 128, global_batch: 16}
  system: tiny-ring
space:
  parallel.tp: {choices: [1, 2]}
  parallel.pp: {choices: [1, 2]}
derived:
  parallel.dp: world / (parallel.tp * parallel.pp)
"""
TINY_POINT = """\
model: tiny-llama
workload: {seq_len: 128, global_batch: 16}
parallel: {dp: 2, tp: 2, pp: 2}
system: tiny-ring
"""
EMULATOR = f"""\
#!{sys.executable}
print('{{"step_time_s": 0.01, "comm_time_s": 0.002}}')
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "cases").mkdir()
    point, study = root / "point.yaml", root / "study.yaml"
    point.write_text(TINY_POINT)
    study.write_text(TINY_STUDY)
    done = root / "done"
    assert run_command(["run", str(study), "--inline", "--out", str(done)], WORK_SECONDS).code == 0
    with contextlib.closing(sqlite3.connect(done / "mlflow.db")) as db:  # one file, for damaging and copying
        db.execute("PRAGMA journal_mode=DELETE")
    for name in ("pareto.html", "mlartifacts"):  # 10 MB no command reads back: copies stay cheap
        shutil.rmtree(done / name) if (done / name).is_dir() else (done / name).unlink()
    suite, bad_suite, empty, traces = root / "suite", root / "bad-suite", root / "empty", root / "traces"
    for folder in (suite, bad_suite, empty, traces):
        folder.mkdir()
    (suite / "tiny.yaml").write_text(TINY_STUDY)
    (bad_suite / "tiny.yaml").write_text(TINY_STUDY)
    (bad_suite / "broken.yaml").write_text(TINY_STUDY.replace("parallel.pp", "parallel.ppp"))
    assert run_command(["generate", str(point), "--chakra", str(traces)], CASE_SECONDS).code == 0
    emulator = root / "emulator.py"
    emulator.write_text(EMULATOR)
    emulator.chmod(0o755)
    (root / "file.txt").write_text("not a folder\n")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 4)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield World(
            root, point, study, done, suite, bad_suite, root / "file.txt", root / "binary.bin", empty, traces,
            emulator, busy.getsockname()[1],
        )  # fmt: skip


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """No server is left running, and relative defaults (runs/...) land in a scratch folder: `dse ui` reaching its
    server records the command instead (returned), and a local Ray start is stopped with WouldStartRay."""
    served: list[list[str]] = []
    monkeypatch.setattr(procgroup, "serve", lambda command, env: served.append(command) or 0)
    real_init = ray.init

    def init(*args: Any, address: str | None = None, **kwargs: Any) -> Any:
        if not address:
            raise WouldStartRay("a case started a local Ray (bad input must be refused before)")
        return real_init(*args, address=address, **kwargs)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.chdir(tmp_path)
    return served


# ---- command lines ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One argument of a command: `flag` ("" for a positional), values that are fine (None: left out; FLAG: the
    bare flag) and values that are wrong and must be refused. Values may hold {fresh} (a new path), {done} (a
    copy of the finished study), {port} (a free port) and {busy} (a port in use), filled in when the case runs."""

    flag: str
    good: tuple[str | None, ...]
    bad: tuple[str, ...] = ()


def slots(w: World) -> dict[str, list[Slot]]:
    """Every command's arguments, the right and wrong values of each."""
    paths = (str(w.missing), f"{w.file}/sub", UNWRITABLE, NUL)
    outs = (*paths, str(w.file), str(w.point), str(w.empty), "/dev/null")
    counts = ("0", "-1", "x", "1.5", "nan", str(10**30))
    plugin_slots = [  # evaluate's, and check's but --json
        Slot("--json", (None, FLAG)),
        Slot("--cost-model", (None, "analytical"), ("nope", "", "os:system", "Analytical")),
        Slot("--cost-option", (None, "exact=true"), ("exact", "=1", "exact=2", "exact=.inf", "nope=1", "exact=[1]")),
        Slot("--generator", (None, "symbolic"), ("nope", "", "os:system")),
    ]
    uri = ("garbage://x", NUL)  # not an unwritable store: a study goes on without MLflow by design, and says so
    return {
        "evaluate": [
            Slot("", (str(w.point),), (*paths, str(w.empty), str(w.study), str(w.binary_file), "/dev/null")),
            *plugin_slots,
            Slot("--trace", (None, "{fresh}"), (str(w.empty), f"{w.file}/t.json", f"{UNWRITABLE}/t.json", NUL)),
        ],
        "run": [
            Slot("", (str(w.study),), (*paths, str(w.empty), str(w.point), str(w.binary_file), "/dev/null")),
            Slot("--inline", (FLAG,)),
            Slot("--trials", (None, "4"), ("-1", "x", "1.5", "nan", str(10**30))),
            Slot("--workers", (None, "1"), counts),
            Slot("--out", ("{fresh}",), (*paths[1:], str(w.file))),
            Slot("--storage", (None,), ("garbage://x", "redis://127.0.0.1:1/0", f"{w.file}/j.log", NUL)),
            Slot("--tracking-uri", (None,), uri),
            Slot("--sweep", (None,), (FLAG,)),  # the tiny study sets trials, which a sweep refuses
            Slot("--address", (None,), ("nonsense:::", "auto")),  # --inline is given: an alternative
            Slot("--ray", (None,), (FLAG,)),
            Slot("--force", (None, FLAG)),
        ],
        "check": [
            Slot(
                "", (str(w.point), str(w.study)), (*paths, str(w.empty), str(w.binary_file), str(w.file), "/dev/null")
            ),
            *plugin_slots[1:],
        ],
        "generate": [
            Slot("", (str(w.point),), (*paths, str(w.empty), str(w.study), str(w.binary_file))),
            Slot("--chakra", ("{fresh}",), (*paths[1:], str(w.file), str(w.traces))),
            Slot("--prefix", (None, "trace"), ("sub/dir/name", "..", "", NUL, "/abs", ".", "x/")),  # traces: "trace"
            Slot("--summary", (None, FLAG)),
            Slot("--generator", (None, "symbolic"), ("nope", "os:system")),
            Slot("--max-bytes", (None, str(10**9)), ("-1", "x", "nan", "1e400")),
            Slot("--force", (None,)),
        ],
        "report": [Slot("", (str(w.done),), outs)],
        "compare": [Slot("", (str(w.done),), outs), Slot("", (str(w.done),), outs)],
        "timeline": [
            Slot("", ("{done}",), outs),
            Slot("--trial", (None, "0"), ("-1", "999", str(10**30), "x", "1.5")),
            Slot("--tracking-uri", (None, "garbage://x")),  # MLflow failing: the traces are on disk, it warns
        ],
        "sync": [Slot("", ("{done}",), outs), Slot("--tracking-uri", (None,), (NUL,))],  # cheap to refuse
        "nightly": [
            Slot("", (str(w.suite),), (*paths, str(w.file), str(w.empty), str(w.bad_suite))),
            Slot("--root", ("{fresh}",), (*paths[1:], str(w.file))),
            Slot("--night", (None, "n1"), ("a/b", "..", "", NUL, "/abs", ".")),
            Slot("--threshold", (None, "0.01"), ("nan", "inf", "-1", "2", "x", "-inf")),
            Slot("--workers", (None, "1"), counts),
            Slot("--address", (None,), ("nonsense:::",)),
            Slot("--tracking-uri", (None,), uri),
            Slot("--force", (None, FLAG)),
        ],
        "ui": [
            Slot("", (str(w.done),), (*paths, str(w.file), str(w.empty))),
            Slot("--port", ("{port}",), ("-1", "0", "70000", "65536", "x", "{busy}")),
            Slot("--host", (None, "127.0.0.1"), ("nonsense host", "999.1.1.1", NUL, "")),
        ],
    }


def parser_flags() -> dict[str, set[str]]:
    """Each command's flags, read from the parser (so a flag added later is seen)."""
    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    return {
        name: {flag for action in sub._actions for flag in action.option_strings if flag.startswith("--")} - {"--help"}
        for name, sub in commands.items()
    }


@st.composite
def command_lines(draw: st.DrawFn, table: dict[str, list[Slot]], known: dict[str, set[str]]) -> tuple[str, list]:
    """A command with at least one argument wrong: (command, [(slot, value, wrong)])."""
    command = draw(st.sampled_from(COMMANDS))
    chosen = [slot for slot in table[command] if not slot.flag or slot.flag in known[command]]
    wrong = draw(st.sets(st.sampled_from([i for i, slot in enumerate(chosen) if slot.bad]), min_size=1, max_size=2))
    return command, [
        (slot, draw(st.sampled_from(slot.bad if i in wrong else slot.good)), i in wrong)
        for i, slot in enumerate(chosen)
    ]


def fill(value: str, w: World) -> str:
    if "{port}" in value:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return str(probe.getsockname()[1])
    replacements = {"{fresh}": lambda: str(w.fresh()), "{done}": lambda: str(w.copy_of_done())}
    replacements |= {
        "{busy}": lambda: str(w.busy_port),
        "{point}": lambda: str(w.point),
        "{study}": lambda: str(w.study),
    }
    for key, make in replacements.items():
        if key in value:
            value = value.replace(key, make())
    return value


def test_every_command_refuses_a_wrong_argument_in_one_line(world, guarded):
    """Each command with one or two of its arguments wrong and the rest right: refused in one line naming one of
    the wrong ones (by flag, by the flag's name in words, or by value), before any work (a `dse ui` that reaches
    its server exits 0 here, and so fails; a local Ray start is stopped and fails)."""
    table, known = slots(world), parser_flags()
    drawn: dict[str, int] = dict.fromkeys(COMMANDS, 0)

    @settings(FUZZ, max_examples=ARGV_CASES)
    @given(case=command_lines(table, known))
    def case(case: tuple[str, list]) -> None:
        command, values = case
        argv, names, quotable = [command], [], True
        for slot, value, wrong in values:
            if value is None:
                continue
            value = value if value == FLAG else fill(value, world)
            argv += [slot.flag] if value == FLAG else [slot.flag, value] if slot.flag else [value]
            if wrong and slot.flag:  # the flag, its name in words ('--cost-model': 'cost model'), or the value
                names += [slot.flag, slot.flag.strip("-").replace("-", " "), value]
            elif wrong:
                names.append(value)
            quotable = quotable and (not wrong or (bool(value) and "\x00" not in value))  # else it may be the one named
        judge(run_command(argv, CASE_SECONDS), refused=True, names=names if quotable else [])
        drawn[command] += 1

    with bounded():
        case()
    print(f"command lines: {drawn}")
    assert all(drawn.values()), drawn


def test_every_flag_of_every_command_is_fuzzed(world):
    """The table above covers the parser: a flag or command added later fails here until it has its slot."""
    table, known = slots(world), parser_flags()
    assert set(known) == set(COMMANDS) | OTHER_COMMANDS, set(known) ^ set(COMMANDS)
    for command in COMMANDS:
        assert known[command] <= {slot.flag for slot in table[command]}, (command, known[command])


# ---- damaged output folders -------------------------------------------------------------------------------------

PARQUET, SPEC, JOURNAL, STORE = "trials.parquet", "study.yaml", "optuna-journal.log", "mlflow.db"
READS = {
    "report": [PARQUET],
    "compare": [PARQUET, SPEC],
    "timeline": [SPEC, PARQUET, JOURNAL, STORE],
    "sync": [SPEC, JOURNAL, STORE],
    "ui": [STORE],
    "run": [JOURNAL, SPEC, STORE],
}
"""The files of a study's folder each command reads."""
TOLERATED = {("compare", SPEC), ("timeline", STORE), ("run", SPEC)}
"""A damaged file the command may go on without: compare only warns from the study files, timeline's traces are on
disk when MLflow fails (it warns), and a resumed run writes its study file anew."""
DAMAGES = ("empty", "cut", "random", "garbage line", "foreign table", "folder", "mutated")


@st.composite
def damaged_folders(draw: st.DrawFn, command: str) -> tuple[str, str, int, bytes]:
    """(file, damage, where, bytes): one file of a finished study's folder damaged, as a disk, a crash or a hand
    edit leaves it."""
    name = draw(st.sampled_from(READS[command]))
    kinds = [k for k in DAMAGES if (k != "foreign table" or name == PARQUET) and (k != "mutated" or name == SPEC)]
    kinds = [k for k in kinds if k != "garbage line" or name in (JOURNAL, SPEC)]
    damage = draw(st.sampled_from(kinds))
    data = b""
    if damage == "random":
        data = draw(st.binary(min_size=1, max_size=4096))
    elif damage == "mutated":
        data = draw(mutated([yaml.safe_load(TINY_STUDY)], STUDY_PATHS))
    return name, damage, draw(st.integers(0, 10**9)), data


def damage_file(path: Path, damage: str, where: int, data: bytes) -> bool:
    """Damage `path` in place; whether the command reading it must refuse (False: either end is sane)."""
    original = path.read_bytes()
    if damage == "folder":
        path.unlink()
        path.mkdir()
        return True
    if damage == "foreign table":
        pd.DataFrame({"a": [1, 2]}).to_parquet(path)
        return True
    if damage == "garbage line":
        lines = original.splitlines(keepends=True)
        at = where % (len(lines) + 1)
        path.write_bytes(b"".join([*lines[:at], b"}{ not a record\n", *lines[at:]]))
        return path.name == JOURNAL
    contents = {"empty": b"", "cut": original[: where % max(len(original), 1)], "random": data, "mutated": data}
    path.write_bytes(contents[damage])
    # An emptied or cut journal is what a crash before its first or mid-way through its last write leaves (a
    # resume reruns those trials); an empty sqlite file is an empty store; a cut study file may still parse.
    return (
        damage == "random"
        or (damage == "empty" and path.name in (PARQUET, SPEC))
        or (damage == "cut" and path.name == PARQUET)
    )


@pytest.mark.parametrize("command", list(FOLDER_CASES))
def test_a_damaged_study_folder_is_named_or_read_as_far_as_it_goes(world, guarded, command):
    """Every command over a copy of a finished study's folder with one file it reads damaged: refused in one line
    naming the damaged file, or (where the damage leaves something readable) run to its end."""
    outcomes: Counter[int] = Counter()

    @settings(FUZZ, max_examples=FOLDER_CASES[command])
    @given(damaged=damaged_folders(command))
    def case(damaged: tuple[str, str, int, bytes]) -> None:
        name, damage, where, data = damaged
        folder = world.copy_of_done()
        must_refuse = damage_file(folder / name, damage, where, data) and (command, name) not in TOLERATED
        argv = {
            "report": ["report", str(folder)],
            "compare": ["compare", *([str(folder), str(world.done)][:: 1 if where % 2 else -1])],
            "timeline": ["timeline", str(folder)],
            "sync": ["sync", str(folder)],
            "ui": ["ui", str(folder), "--port", fill("{port}", world)],
            "run": ["run", str(world.study), "--inline", "--out", str(folder)],
        }[command]
        outcome = run_command(argv, WORK_SECONDS if command in ("sync", "run") else CASE_SECONDS)
        outcome.note = f"({name}: {damage})"
        judge(outcome, refused=must_refuse, names=[str(folder / name)] if must_refuse else [])
        outcomes[outcome.code] += 1
        shutil.rmtree(folder)

    with bounded():
        case()
    print(f"{command} over damaged folders: {outcomes}")


# ---- mutated point and study files under the other commands ----------------------------------------------------

TINY_SEEDS = tiny_points()


@pytest.fixture
def astra_sim(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether ASTRA-sim's binary runs here (found as conftest's `binary` fixture finds it, then set as
    ASTRA_SIM_BIN for the cost model and the option values)."""
    try:
        monkeypatch.setenv("ASTRA_SIM_BIN", str(request.getfixturevalue("binary")))
    except pytest.skip.Exception:
        return False
    return True


@pytest.mark.parametrize("use", list(POINT_CASES))
def test_mutated_point_files_generate_and_price_or_are_refused(world, guarded, astra_sim, use):
    """test_bad_input's point-file mutations under `dse generate` (a summary of any seed; Chakra traces and the
    ASTRA-sim cost model of the tiny ones, whose worlds stay small): exit 0, or one line naming the file."""
    if use == "astrasim" and not astra_sim:
        pytest.skip("no ASTRA-sim binary: set ASTRA_SIM_BIN to ASTRA-sim's analytical binary")
    path = world.fresh().with_suffix(".yaml")

    @settings(FUZZ, max_examples=POINT_CASES[use])
    @given(data=mutated(POINT_SEEDS if use == "summary" else TINY_SEEDS, POINT_PATHS))
    def case(data: bytes) -> None:
        path.write_bytes(data)
        traces = world.fresh()
        argv = {
            "summary": ["generate", str(path), "--summary"],
            "chakra": ["generate", str(path), "--chakra", str(traces)],
            "astrasim": ["evaluate", str(path), "--cost-model", "astrasim", "--json"],
        }[use]
        judge(run_command(argv, CASE_SECONDS), refused=None, names=[str(path)])
        shutil.rmtree(traces, ignore_errors=True)

    with bounded():
        case()


@pytest.mark.parametrize("command", list(STUDY_CASES))
def test_a_study_file_check_refuses_is_refused_by_run_and_nightly(world, guarded, command):
    """test_bad_input's study-file mutations that `dse check` refuses are refused by `dse run` (nothing run, nothing
    written) and by `dse nightly` (beside a good study in its suite, before any study runs), naming the file."""
    refused = [0]

    @settings(FUZZ, max_examples=STUDY_CASES[command])
    @given(data=mutated(STUDY_SEEDS, STUDY_PATHS))
    def case(data: bytes) -> None:
        suite = world.fresh()
        suite.mkdir(parents=True)
        path = suite / "mutated.yaml"
        path.write_bytes(data)
        checked = run_command(["check", str(path)], CASE_SECONDS)
        judge(checked, refused=None, names=[str(path)])
        if checked.code == 0:
            return  # a valid study: running it is a study's work, which the good-input test does once
        if command == "run":
            argv = ["run", str(path), "--inline", "--out", str(world.fresh())]
        else:
            shutil.copy(world.study, suite / "tiny.yaml")
            argv = ["nightly", str(suite), "--root", str(world.fresh())]
        judge(run_command(argv, CASE_SECONDS), refused=True, names=[str(path)])
        refused[0] += 1

    with bounded():
        case()
    assert refused[0] >= STUDY_CASES[command] // 3, refused


# ---- every plugin option model ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", list(OPTION_CASES))
def test_every_option_of_every_cost_model_is_checked_where_it_is_given(world, guarded, astra_sim, where):
    """Options drawn from each cost model's schema, as `--cost-option KEY=VALUE` (the tiny point is then priced
    when they are right), as a study's cost_model_options and as its refine options (checked): a wrong one is
    refused in one line that names it; right ones end in exit 0 or a one-line reason (a pre-flight finding)."""
    models = option_models()
    path = world.fresh().with_suffix(".yaml")

    @settings(FUZZ, max_examples=OPTION_CASES[where])
    @given(drawn=option_sets(models, world))
    def case(drawn: tuple[str, dict, bool]) -> None:
        name, options, wrong = drawn
        if where == "cli":
            if name == "emulator":  # never the default gloo replay: a program of our own, or a wrong option
                options.setdefault("command", [str(world.emulator)])
            given_options = [f"{key}={scalar(value)}" for key, value in options.items() if value is not None]
            argv = ["evaluate", str(world.point), "--json", "--cost-model", name]
            argv += [arg for option in given_options for arg in ("--cost-option", option)]
            names = ["--cost-option", "cost_model_options", str(world.point)]
        else:
            study = yaml.safe_load(TINY_STUDY)
            if where == "study":
                study |= {"cost_model": name, "cost_model_options": options}
            else:
                study["refine"] = {"cost_model": name, "cost_model_options": options}
                wrong |= name == study.get("cost_model", plugins.DEFAULT_COST_MODEL) and options == {"exact": False}
            path.write_text(yaml.safe_dump(study, sort_keys=False, allow_unicode=True))
            argv, names = ["check", str(path)], [str(path)]
        judge(run_command(argv, CASE_SECONDS), refused=wrong, names=names)

    with bounded():
        case()


def test_every_cost_model_option_has_wrong_values_to_try(world):
    """The option table reaches every installed cost model and every option of each (a model or option added
    later is fuzzed too, with values that must be refused)."""
    models = option_models()
    assert {"analytical", "astrasim", "emulator"} <= set(models), models
    for name, schema in models.items():
        for key, info in schema.model_fields.items():
            right, wrong = option_values(info, world)
            assert right and len(wrong) > 2, (name, key)


# ---- right input ------------------------------------------------------------------------------------------------


def test_right_input_to_every_command_ends_with_exit_0(world, guarded, astra_sim):
    """The few cases that do real work, once each: the same commands with nothing wrong run to their end (the
    fixture's run of the tiny study is `dse run`'s; `dse nightly` would start a local Ray: tests/test_nightly.py
    runs it). `dse ui` reaches its server (recorded, not started)."""
    astrasim = [["evaluate", "{point}", "--cost-model", "astrasim", "--json"]] * astra_sim
    cases = [
        ["evaluate", "{point}", "--json"],
        *astrasim,
        ["check", "{point}"],
        ["check", "{study}"],
        ["generate", "{point}", "--summary"],
        ["generate", "{point}", "--chakra", "{fresh}", "--prefix", "t"],
        ["report", "{done}"],
        ["compare", "{done}", "{done}"],
        ["timeline", "{done}", "--trial", "0"],
        ["ui", "{done}", "--port", "{port}"],
        ["run", "{study}", "--inline", "--out", "{done}"],
        ["sync", "{done}"],
    ]
    with bounded():
        for template in cases:
            argv = [fill(arg, world) for arg in template]
            outcome = run_command(argv, WORK_SECONDS)
            judge(outcome, refused=False)
            assert outcome.code == 0, outcome
    assert len(guarded) == 1 and "--port" in guarded[0], guarded
