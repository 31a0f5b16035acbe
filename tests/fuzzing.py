"""What the fuzz tests share (test_bad_input.py: point and study files; test_command_fuzz.py: every command and
plugin option): the seeds, the values a user might type, the mutations of a file, the bounds a case runs in, a
command run in-process and judged by the README's promise, and the right and wrong values of a plugin's options.

The mutations reach every field without a list kept here: the seeds are the shipped point and study files and
the tiny catalog models written out whole (every model, accelerator and network field present), and the fields
added are walked from the pydantic models. So a field added later is mutated too.
"""

import contextlib
import copy
import dataclasses
import importlib
import os
import pkgutil
import re
import resource
import shlex
import shutil
import signal
import tempfile
import time
import traceback
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import inf, nan
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from conftest import ROOT, patience
from helpers import run_cli
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from dse import catalog, plugins
from dse.point.points import expand
from dse.search.space import StudySpec
from dse.spec import DesignPoint

HEADROOM = 3 << 30
"""Address space the test allows the process beyond what it had: an unbounded case fails with MemoryError
instead of taking the machine down."""
NUL = "a\x00b"
"""A value with a NUL byte in it, which no path or name can hold."""

# Hypothesis: the same cases on every run (CI is reproducible), and nothing written into the repository (no
# example database; the constants it mines from the code under test are cached outside it).
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "dse-hypothesis")
# Hypothesis also draws constants it finds in the project's loaded modules (limits, defaults: good edge cases);
# importing them all makes that pool, and so the cases, the same whichever tests ran before.
for _package in ("dse", "generators", "simulators", "objectives"):
    for _module in pkgutil.walk_packages(importlib.import_module(_package).__path__, f"{_package}."):
        importlib.import_module(_module.name)
PROFILE = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


# ---- seeds: valid files, and every field they can hold --------------------------------------------------------


def tiny_points() -> list[dict[str, Any]]:
    """Each tiny catalog model on the 8-NPU test ring, written out whole: every field of the model, workload,
    parallel layout, accelerator and network is in the file, defaults included, but the accelerator's attention
    kernel tables. Those are the H100's, as in hopper_point, where the workload's attention kernel reads them: in
    each of these seeds too they were 600 of its 720 values, so most mutations landed in a table these points do
    not read, and parsing the 12 KB files was most of what a case cost."""
    parallel = {"tiny-moe": {"dp": 8, "ep": 2}, "tiny-deepseek": {"dp": 8, "ep": 2}}
    routing = {"tiny-moe": {"routing": {"imbalance": 1.5, "source": "a skew for the fuzzer"}}}
    out = []
    for name in [name for name in catalog.names("models") if name.startswith("tiny-")]:
        raw = {"model": name, "workload": {"seq_len": 128, "global_batch": 16, **routing.get(name, {})}}
        raw |= {"parallel": parallel.get(name, {"dp": 2, "tp": 2, "pp": 2}), "system": "tiny-ring"}
        point = DesignPoint.model_validate(expand(raw))
        out.append(point.model_dump(mode="json", exclude_none=True))
        del out[-1]["system"]["accelerator"]["attention_kernels"]
    return out


def hopper_point() -> dict[str, Any]:
    """A point on H100s written out whole: the accelerator's attention kernel tables, the catalog's measured kernel
    tables (GEMMs, NCCL) and clock share and the workload's attention kernel are in the file."""
    raw = {
        "model": "tiny-llama",
        "workload": {"seq_len": 256, "global_batch": 16, "attention_kernel": "fa3"},
        "parallel": {"dp": 8},
        "system": {"base": "dgx-h100", "accelerator": {"clock_share": 0.9}, "network": {1: {"npus": 1}}},
    }
    return DesignPoint.model_validate(expand(raw)).model_dump(mode="json", exclude_none=True)


def shipped(pattern: str) -> list[dict[str, Any]]:
    return [yaml.safe_load(path.read_text()) for path in sorted(ROOT.glob(pattern))]


def serving_points() -> list[dict[str, Any]]:
    """tiny-llama served on the test ring: a rate simulated request by request with every scheduler, cache,
    speculation and length field set, a trace, the highest rate under an SLO, clients in a closed loop, and
    clients of a disaggregated deployment with every decode-pool field set."""
    base = {"model": "tiny-llama", "parallel": {"dp": 4, "tp": 2}, "system": "tiny-ring"}
    events = {
        "isl": 64,
        "osl": 16,
        "lengths": {"distribution": "lognormal", "cv": 0.5},
        "rate_per_s": 200.0,
        "arrival": "uniform",
        "requests": 200,
        "seed": 1,
        "warmup": 0.1,
        "depth": "events",
        "scheduler": {
            "max_num_seqs": 32,
            "max_batched_tokens": 256,
            "admission": "reserve",
            "chunked_prefill": True,
            "prefill_chunk": 32,
        },
        "kv_cache": {"block_tokens": 16, "memory_fraction": 0.8, "dtype": "fp8"},
        "speculative": {"draft_tokens": 1, "acceptance": 0.7},
        "slo": {"ttft_p99_s": 0.01, "tpot_p99_s": 0.001},
    }
    trace = {"trace": str(ROOT / "tests" / "serving_trace.csv")}
    highest = {"isl": 64, "osl": 16, "max_rate": True, "slo": {"tpot_mean_s": 0.001}}
    clients = {"isl": 64, "osl": 16, "concurrency": 16}
    sections = (events, trace, highest, clients)
    pool = {"dp": 2, "tp": 2, "pp": 1, "ep": 1, "max_num_seqs": 64, "admission": "reserve"}
    apart = {**clients, "kind": "disaggregated", "kv_transfer": "layers", "decode": pool}
    return [
        *({**base, "workload": {"mode": "serve", "serving": serving}} for serving in sections),
        {**base, "parallel": {"dp": 2, "tp": 2}, "workload": {"mode": "serve", "serving": apart}},
    ]


POINT_SEEDS = [
    *tiny_points(),
    hopper_point(),
    *serving_points(),
    *shipped("studies/points/*.yaml"),
    {"model": "tiny-llama", "workload": {"seq_len": 256, "global_batch": 16}, "parallel": {"dp": 8}},
]
POINT_SEEDS[-1]["system"] = {"base": "dgx-h100", "accelerator": {"hbm_GiB": 141}, "network": {1: {"npus": 1}}}
POINT_SEEDS[-1]["system"]["accelerator"]["memory_tiers"] = [{"name": "ddr", "GiB": 512, "bandwidth_GBps": 100.0}]
POINT_SEEDS[-1]["economics"] = {"lifetime_years": 5, "utilization": 0.7, "idle_power_share": 0.2, "pue": 1.3}
POINT_SEEDS[-1]["economics"] |= {"electricity_usd_per_kWh": 0.1, "budget_usd": 1e6, "power_limit_kW": 20.0}
POINT_SEEDS[-1]["system"]["network"][0] = {"hardware": {"nic_price_usd": 100, "nic_power_W": 5, "switch_ports": 64}}
POINT_SEEDS[-1]["system"]["network"][0]["hardware"] |= {"switch_price_usd": 1e4, "switch_power_W": 500}
POINT_SEEDS[-1]["system"]["network"][0]["hardware"] |= {"cable_price_usd": 50, "sources": ["a guess for the fuzzer"]}
FABRICS = [
    {"topology": "ring", "npus": 2, "bandwidth_GBps": 100.0, "latency_ns": 1000.0},
    {"topology": "switch", "npus": 2, "bandwidth_GBps": 50.0, "latency_ns": 5000.0, "rails": True},
    {"topology": "switch", "npus": 2, "bandwidth_GBps": 50.0, "latency_ns": 5000.0},
]
DRAGONFLY = {**FABRICS[2], "topology": "dragonfly", "group_npus": 1, "global_bandwidth_GBps": 5.0}
FABRICS[1] |= {"collectives": "pipelined"}
FABRICS[2] |= {"leaf_npus": 1, "oversubscription": 2.0}
"""tiny-llama on rails and leaves under a taper, then on a dragonfly: the fabric fields written out."""
POINT_SEEDS += [
    {"model": "tiny-llama", "workload": {"seq_len": 256, "global_batch": 16}, "parallel": {"dp": 8}, "system": system}
    for system in ({"base": "tiny-ring", "network": network} for network in (FABRICS, [*FABRICS[:2], DRAGONFLY]))
]
LAYOUTS = {"norm": "layernorm", "norm_bias": False, "activation": "geglu", "qkv_bias": True, "qk_norm": True}
LAYOUT_POINT = {
    "model": {"base": "tiny-llama", **LAYOUTS, "parallel_block": "two_norms"},
    "workload": {"seq_len": 128, "global_batch": 16},
    "parallel": {"dp": 4, "tp": 2, "sp": True},
    "system": "tiny-ring",
}
"""tiny-llama with every layout field of the model set away from its default, under tp with sp."""
POINT_SEEDS.append(LAYOUT_POINT)
STUDY_SEEDS = shipped("studies/*.yaml") + shipped("studies/nightly/*.yaml")


def schema_paths(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, annotation) of every field of a pydantic model, nested models and list items included."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        yield path, field.annotation
        for inner in _models_in(field.annotation):
            yield from schema_paths(inner, f"{path}.0." if _is_list(field.annotation) else f"{path}.")


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def _is_list(annotation: Any) -> bool:
    return get_origin(annotation) is list or any(_is_list(arg) for arg in get_args(annotation))


POINT_PATHS = [path for path, _ in schema_paths(DesignPoint)]
STUDY_PATHS = [path for path, _ in schema_paths(StudySpec)]


# ---- values a user might type ---------------------------------------------------------------------------------

NASTY = [
    None, True, False, 0, -1, 1, 2, 3, 7, 2**31, 2**63, 10**30, -(10**30), 0.0, -0.0, 0.5, 1e-300, 5e-324, 1e300,
    float("inf"), float("-inf"), float("nan"), "", "x", "8", "1e9", "true", "null", "~", "fsdp1", "ring",
    "llama3-8b", "tiny-llama", "dgx-h100", "h200", "/dev/zero", "/etc/passwd", [], {}, [1, 2], {"a": 1},
    "\x00", "é", "💥", "x" * 100_000, "world / 0", "-" * 20_000 + "1", "world ** 2", "__import__('os')",
]  # fmt: skip


def deep(depth: int) -> Any:
    value: Any = 1
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


def near(value: Any) -> st.SearchStrategy[Any]:
    """Values close to a valid one: what a typo or a wrong unit makes of it."""
    if isinstance(value, bool):
        return st.sampled_from([not value, int(value), str(value).lower(), "yes"])
    if isinstance(value, int | float):
        return st.sampled_from(
            [value * 2, value * 1000, value * 10**9, -value, value + 1, value - 1, value / 3, float(value), str(value)]
        )
    if isinstance(value, str):
        return st.sampled_from([value.upper(), value + "x", value[:-1], f"{value} ", 8])
    return st.sampled_from([None, [value], {"value": value}])


VALUES = st.one_of(
    st.sampled_from(NASTY),
    st.integers(),
    st.floats(),
    st.text(max_size=12),
    st.integers(1, 80).map(deep),
    st.lists(st.integers(-3, 300), max_size=4),
).map(copy.deepcopy)  # a later mutation may add to a drawn {} or []: never to NASTY's own


# ---- mutations --------------------------------------------------------------------------------------------------


def leaves(node: Any, path: tuple = ()) -> Iterator[tuple]:
    """Paths of every value in a document, containers included."""
    yield path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from leaves(child, (*path, key))


def get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


MUTATIONS = ["set"] * 4 + ["near"] * 6 + ["delete", "unknown"] * 2 + ["field"] * 4 + ["duplicate"]
"""Weighted: a near miss (a typo, a wrong unit) is what users make most, and what reaches evaluation."""


@st.composite
def mutated(draw: st.DrawFn, seeds: list[dict[str, Any]], fields: list[str]) -> bytes:
    """A seed with one to three mutations, written as YAML, then perhaps damaged as bytes."""
    doc = copy.deepcopy(draw(st.sampled_from(seeds)))
    duplicate = False
    for _ in range(draw(st.integers(1, 3))):
        paths = [path for path in leaves(doc) if path]
        kind = draw(st.sampled_from(MUTATIONS))
        path = draw(st.sampled_from(paths)) if paths else ()
        if kind == "set" and path:
            get(doc, path[:-1])[path[-1]] = draw(VALUES)
        elif kind == "near" and path:
            get(doc, path[:-1])[path[-1]] = draw(near(get(doc, path)))
        elif kind == "delete" and path:
            del get(doc, path[:-1])[path[-1]]
        elif kind == "unknown":
            target = get(doc, path) if path else doc
            if isinstance(target, dict):
                target[draw(st.sampled_from(["tpp", "hbm_GB", "Layers", "base", "name", "zero"]))] = draw(VALUES)
        elif kind == "field":
            add_field(draw, doc, draw(st.sampled_from(fields)))
        elif kind == "duplicate":
            duplicate = True
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1000)
    if duplicate:
        text = duplicate_line(draw, text)
    return damage(draw, text)


def add_field(draw: st.DrawFn, doc: dict[str, Any], path: str) -> None:
    """Set a schema field (`path`, of a point or a study) the file may not have; in a study, perhaps a field of
    the point instead: into its base, as a searched parameter (choices or a range) or as a derived value."""
    value = draw(VALUES)
    if "space" in doc and (where := draw(st.sampled_from(["study", "space", "derived", "base"]))) != "study":
        point_path = draw(st.sampled_from(POINT_PATHS))
        if where == "space" and isinstance(doc["space"], dict):
            choices = draw(st.lists(st.one_of(VALUES, st.integers(0, 64)), min_size=1, max_size=5))
            doc["space"][point_path] = draw(
                st.sampled_from([{"choices": choices}, {"low": value, "high": choices[0]}, {"choices": value}])
            )
            return
        if where == "derived":
            expression = draw(st.sampled_from(["world / 2", "world * world", "parallel.tp - 9", "1e308 * 10"]))
            if isinstance(doc.get("derived"), dict):
                doc["derived"][point_path] = draw(st.sampled_from([expression, value]))
            return
        doc, path = doc.get("base"), point_path
        if not isinstance(doc, dict):
            return
    node: Any = doc
    parts = path.split(".")
    for part in parts[:-1]:
        key: Any = int(part) if part.isdigit() else part
        if isinstance(node, dict):
            node = node.setdefault(key, {})
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return
    if isinstance(node, dict):
        node[parts[-1]] = value


def duplicate_line(draw: st.DrawFn, text: str) -> str:
    """Give a mapping key a second time, with another value, as a hand edit does."""
    lines = text.splitlines()
    keyed = [i for i, line in enumerate(lines) if re.match(r"^\s*[A-Za-z_][\w.]*:\s*\S", line)]
    if not keyed:
        return text
    index = draw(st.sampled_from(keyed))
    key = lines[index].split(":")[0]
    lines.insert(index + 1, f"{key}: {draw(st.sampled_from(['1', '0', 'x', '[]', '{}']))}")
    return "\n".join(lines) + "\n"


def damage(draw: st.DrawFn, text: str) -> bytes:
    """The file as bytes, perhaps in another encoding, cut short or with a foreign byte in it."""
    data = text.encode()
    kind = draw(st.sampled_from(["none"] * 25 + ["utf16", "utf16-nobom", "latin1", "nul", "binary", "cut", "bom"]))
    at = draw(st.integers(0, max(len(data) - 1, 0)))
    if kind == "utf16":
        return text.encode("utf-16")
    if kind == "utf16-nobom":
        return text.encode("utf-16-le")
    if kind == "latin1":
        return data[:at] + b"\xe9" + data[at:]
    if kind == "nul":
        return data[:at] + b"\x00" + data[at:]
    if kind == "binary":
        return draw(st.binary(min_size=1, max_size=200))
    if kind == "cut":
        return data[:at]
    if kind == "bom":
        return b"\xef\xbb\xbf" + data
    return data


# ---- bounds -----------------------------------------------------------------------------------------------------


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """Wall time by SIGALRM (a hang fails the case instead of the suite: the caller sets the timer per case),
    address space by RLIMIT_AS."""

    def expire(signum: int, frame: object) -> None:
        raise CaseTimeout("a case ran past its time limit")

    previous = signal.signal(signal.SIGALRM, expire)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    vm = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    limit = vm + HEADROOM if hard == resource.RLIM_INFINITY else min(vm + HEADROOM, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def bare_type(annotation: Any) -> Any:
    """The type under Annotated[...] and Optional[...]."""
    while get_origin(annotation) in (Annotated, Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        if get_origin(annotation) is not Annotated and len(args) != 1:
            return annotation
        annotation = args[0]
    return annotation


# ---- a command, run and judged ---------------------------------------------------------------------------------


class WouldStartRay(BaseException):
    """Raised for a local Ray start (10-35 s and ~1 GiB), which no fuzz case may need: bad input is refused first.
    A BaseException, so that no `except Exception` in the code under test takes it for a failed start."""


@dataclass
class Outcome:
    argv: list[str]
    code: int
    out: str
    err: str
    seconds: float
    note: str = ""
    """What the case did to its input beyond the arguments (a damaged file, say)."""

    def __str__(self) -> str:
        return (
            f"dse {shlex.join(self.argv)!r} {self.note}\n--- exit {self.code} after {self.seconds:.1f} s\n--- stdout:\n"
            f"{self.out[-3000:]}\n--- stderr:\n{self.err[-3000:]}"
        )


def run_command(argv: list[str], seconds: float) -> Outcome:
    """`dse ARGV` in this process (helpers.run_cli), an exception that escapes shown as the process would show it
    (a traceback, exit code 1), with a SIGALRM after `seconds` (stretched for load by conftest.patience) to end a
    hang; run it inside `bounded()`."""
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, patience(seconds))
    try:
        code, out, err = run_cli(*argv)
    except CaseTimeout:
        raise
    except WouldStartRay as exc:
        code, out, err = -1, "", repr(exc)
    except Exception:
        code, out, err = 1, "", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return Outcome(argv, code, out, err, time.perf_counter() - start)


ARGPARSE_ERROR = re.compile(r"dse(?: \S+)?: error: ")


def judge(outcome: Outcome, refused: bool | None, names: Sequence[str] = ()) -> None:
    """What every case must show. refused: True, the input is wrong (exit 2); None, either end is sane. For exit 2,
    one `error:` line on stderr (argparse's usage lines before its own error are its form) naming one of `names`
    (flags, paths, values; an empty one or one with a NUL byte cannot be named), and nothing on stdout."""
    assert "Traceback" not in outcome.out + outcome.err, outcome
    assert outcome.code in (0, 2), f"exit code {outcome.code}\n{outcome}"
    if refused:
        assert outcome.code == 2, f"wrong input accepted (exit 0)\n{outcome}"
    if outcome.code != 2:
        return
    lines = outcome.err.strip().splitlines()
    ours = len(lines) == 1 and lines[0].startswith("error: ")
    argparse = (
        bool(lines) and ARGPARSE_ERROR.match(lines[-1]) and all(line.startswith(("usage:", " ")) for line in lines[:-1])
    )
    assert ours or argparse, f"not one error line\n{outcome}"
    assert outcome.out == "", f"stdout beside the error\n{outcome}"
    named = [name for name in names if name and "\x00" not in name]
    if named:
        assert any(name in lines[-1] for name in named), f"the error names none of {named}\n{outcome}"


# ---- the files a command's arguments name, and the values of a plugin's options -----------------------------


UNWRITABLE = "/sys/dse-fuzz"
"""A folder nobody can create, root included."""


@dataclass
class World:
    """Files and folders a case's arguments name, made once per module; `fresh()` is a new path per case."""

    root: Path
    point: Path
    study: Path
    done: Path
    """A finished run of `study` (its MLflow store checkpointed into mlflow.db alone)."""
    suite: Path
    bad_suite: Path
    file: Path
    binary_file: Path
    empty: Path
    traces: Path
    emulator: Path
    busy_port: int
    counter: list[int] = dataclasses.field(default_factory=lambda: [0])

    def fresh(self) -> Path:
        self.counter[0] += 1
        return self.root / "cases" / str(self.counter[0])

    def copy_of_done(self) -> Path:
        target = self.fresh()
        shutil.copytree(self.done, target)
        return target

    @property
    def missing(self) -> Path:
        return self.root / "missing"


def option_models() -> dict[str, type[BaseModel]]:
    """Each installed cost model's `Options`, found as dse finds the models: through entry points."""
    models = {
        name: getattr(plugins.load("cost model", name), "Options", None) for name in plugins.available("cost model")
    }
    return {name: schema for name, schema in models.items() if schema is not None}


def option_values(info: FieldInfo, w: World) -> tuple[list[Any], list[Any]]:
    """(right, wrong) values of one option, by its type and what its description says it names. Wrong: what the
    issue names (non-finite and quoted numbers, booleans for numbers and the reverse, a file where a folder
    belongs) and what no option of these models can mean (a negative or zero count or duration, 10^30)."""
    kind, text = bare_type(info.annotation), (info.description or "").lower()
    default = info.get_default(call_default_factory=True)
    structure: list[Any] = [[1], {"a": 1}]
    if kind is bool:
        return [True, False], [1, 0, "true", "yes", 1.0, None, *structure]
    if kind in (int, float):
        numbers = [inf, -inf, nan, "8", str(default), True, False, -1, 0, 10**30, *structure]
        return [default, 2, 8, 30.0 if kind is float else 4], numbers + ([1.5] if kind is int else [])
    if get_origin(kind) is Literal:
        return list(get_args(kind)), [f"{get_args(kind)[0]}x", "", 1, True, *structure]
    if get_origin(kind) is list:
        if "argument list" in text:  # a program to run
            return [[str(w.emulator)]], [[], [str(w.missing)], [str(w.file)], [str(w.empty)], [NUL], "x", [1]]
        return [[], ["--x"]], ["x", [1], [None]]
    if text.startswith("folder"):
        return [default, str(w.fresh())], [str(w.file), f"{w.file}/sub", UNWRITABLE, NUL, 1, True, *structure]
    if "binary" in text:
        real = [os.environ["ASTRA_SIM_BIN"]] if os.environ.get("ASTRA_SIM_BIN") else []
        return [default, *real], [str(w.missing), str(w.empty), str(w.file), NUL, 1, True, *structure]
    if kind is str:
        return [default, "m.json"], ["a/b", "", "..", NUL, 1, True, *structure]
    return [default], structure


@st.composite
def option_sets(draw: st.DrawFn, models: dict[str, type[BaseModel]], w: World) -> tuple[str, dict, bool]:
    """(cost model, options, wrong): one to three options of one model, each right or wrong, perhaps a misspelt one."""
    name = draw(st.sampled_from(sorted(models)))
    fields = models[name].model_fields
    options, wrong = {}, False
    for key in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)):
        right, bad = option_values(fields[key], w)
        if draw(st.booleans()):
            options[key], wrong = copy.deepcopy(draw(st.sampled_from(bad))), True
        else:
            options[key] = copy.deepcopy(draw(st.sampled_from(right)))
    if draw(st.integers(0, 9)) == 0:
        options[draw(st.sampled_from(["tpp", "Timeout_s", "exact "]))], wrong = 1, True
    return name, options, wrong


def scalar(value: Any) -> str:
    """A value as a user types it after KEY= (the YAML the README says --cost-option reads)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("...\n").strip()
