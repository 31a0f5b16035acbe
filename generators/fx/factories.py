"""Finding a model factory: a name registered in the `dse.fx_models` entry-point group, or `package.module:callable`
for a user's installed code (the one place a study names an import path: the model's code is the user's own).

A factory is `factory(model: ModelSpec, workload: WorkloadSpec) -> torch.nn.Module`: a module whose
`forward(tokens)` returns logits and whose `layers` is the nn.ModuleList of its transformer blocks. For a decode
workload it builds the model with a KV cache of workload.seq_len tokens for each of workload.micro_batch sequences,
and its `forward(tokens, input_pos)` is gpt-fast's decoding step: tokens [batch, 1], one new token per sequence, at
positions input_pos [1] (seq_len - 1, the cache's last slot), whose keys and values each block writes to its cache
in place before attending over all of it (`generators.fx.models`: a cache module `attention.cache` of buffers
[batch, seq, kv_heads, head_dim], split over tp like the heads; Hugging Face's StaticCache).

A factory's module may hold `TP_PLAN`, a dict of module-name patterns (fnmatch over the built model's names) to
tensor-parallel styles (colwise, rowwise, sequence_parallel, replicate, vocab), which replaces the plan the fx
generator derives for the modules it names; a point's `model.fx_plan` wins over it (generators/fx/plans.py).

`check` is the generator's pre-flight: each factory a study's points name is imported and called on the meta
device in a child process (`CHILD`), whose prints cannot reach our stdout (a
`dse evaluate --json` prints one JSON line there) and whose hang is ended by a timeout.
"""

import contextlib
import hashlib
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from dse.errors import SpecError
from dse.interfaces import ModelDescription
from dse.point.described import describing_here, filled
from dse.spec import DesignPoint, ModelSpec, WorkloadSpec
from generators.fx import disk_cache

GROUP = "dse.fx_models"
FIELD = "model.fx_factory"
CHECK_TIMEOUT_S = 120.0
"""How long the child that imports and calls the factories may take (importing torch takes 2-10 s)."""

Factory = Callable[..., Any]
CHILD = f"from {__name__} import _describe_requested; _describe_requested()"
"""The child's program. Not `python -m generators.fx.factories`: the package's __init__ imports this module first,
and runpy's warning that it found it imported already ended every refusal's message."""


def factory_name(model: ModelSpec) -> str:
    """The factory a model names, else for a mixture of experts `moe`, else the one registered under its family."""
    return model.fx_factory or ("moe" if model.moe is not None else model.family)


@cache
def _registered() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def resolve(name: str) -> Factory:
    """The factory `name` stands for; a SpecError naming the field and the fix otherwise."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise SpecError(f"field '{FIELD}': cannot import '{module_name}' ({exc}); install the package") from None
        found = getattr(module, attr, None)
        if not callable(found):
            raise SpecError(f"field '{FIELD}': '{module_name}' has no callable '{attr}'")
        return found
    registered = _registered()
    if name not in registered:
        installed = ", ".join(sorted(registered)) or "none"
        raise SpecError(
            f"field '{FIELD}': no FX model factory '{name}' is registered (installed: {installed}); set "
            f"{FIELD} to a registered name or to package.module:callable"
        )
    return registered[name].load()


def check(points: Sequence[DesignPoint], timeout_s: float = CHECK_TIMEOUT_S) -> list[tuple[str, dict[str, Any]]]:
    """Each factory the points name with the description of the model it builds (`describe`), checked once with
    the first point that names it; a SpecError naming FIELD if one is not registered, does not import, is not
    callable, or does not build an nn.Module with its `layers` (on the meta device: no weights)."""
    wanted: dict[str, DesignPoint] = {}
    for point in points:
        wanted.setdefault(factory_name(point.model), point)
    unknown = [name for name in wanted if ":" not in name and name not in _registered()]
    if unknown:
        resolve(unknown[0])  # raises the error naming the registered factories
    requests = [(name, p.model.model_dump(mode="json"), described_workload(p.workload)) for name, p in wanted.items()]
    return list(zip(wanted, describe_models(requests, timeout_s), strict=True))


def described_workload(workload: WorkloadSpec) -> dict[str, Any]:
    """The workload a model is described with: a training step of one sequence of the point's length (128 for a
    serving point, whose requests say theirs): the model's parameters do not depend on the mode or the batch."""
    return {"seq_len": workload.seq_len or 128, "global_batch": 1}


def describe_model(model: dict[str, Any], workload: dict[str, Any]) -> ModelDescription:
    """The description of the model a point's model fields name (dse.interfaces.ModelDescriber, declared on the
    entry point): built by its factory in a child process, so that the caller needs no torch, or in this process
    when the caller is about to capture here (`dse.point.described.in_this_process`)."""
    name = factory_name(ModelSpec.model_construct(**model))  # the caller gives fx_factory or family
    try:
        valid = WorkloadSpec.model_validate(workload)
    except ValueError:
        valid = WorkloadSpec(seq_len=128, global_batch=1)
    shape = described_workload(valid)
    (described,) = describe_models([(name, model, shape)], here=describing_here())
    description = ModelDescription(name, **described)
    with contextlib.suppress(ValueError):  # the point's model once filled is the same model: known without a build
        same = _key((name, filled(model, description), shape))
        _DESCRIBED.setdefault(same, described)
        if (sources := _SOURCES.get(_key((name, model, shape)))) is not None:
            _SOURCES.setdefault(same, sources)
    return description


Request = tuple[str, dict[str, Any], dict[str, Any]]
_DESCRIBED: dict[str, dict[str, Any]] = {}
_SOURCES: dict[str, list[str]] = {}
"""The source files of the models this process built to describe them, by request key (`described_sources`)."""


def described_sources(request: Request) -> list[str] | None:
    """The source files of the model a request describes (`disk_cache.model_sources`), when this process built it
    to describe it: what a capture's disk entry records, known without building the model once more. None for a
    description read from disk, or none yet."""
    return _SOURCES.get(_key(request))


def describe_models(
    requests: Sequence[Request], timeout_s: float = CHECK_TIMEOUT_S, here: bool = False
) -> list[dict[str, Any]]:
    """Each request's (factory name, model fields, workload fields) description (`describe.Description` as a
    dict), from this process's memory, the disk cache (`disk_cache`: kept while the source files of the model's
    modules are unchanged), or one child process for those neither holds (`here`: in
    this process, which has imported torch already)."""
    keys = [_key(request) for request in requests]
    for key in keys:
        if key not in _DESCRIBED and (cached := disk_cache.load(("describe", key))) is not None:
            _DESCRIBED[key] = cached
    missing = [(key, request) for key, request in zip(keys, requests, strict=True) if key not in _DESCRIBED]
    if missing:
        todo = [request for _, request in missing]
        done = [_here(*request) for request in todo] if here else _child(todo, timeout_s)
        for (key, _), (description, sources) in zip(missing, done, strict=True):
            _DESCRIBED[key], _SOURCES[key] = description, sources
            disk_cache.store(("describe", key), description, sources)
    return [_DESCRIBED[key] for key in keys]


def _here(name: str, model: dict[str, Any], workload: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A request described in this process; a factory's module that exits is refused as the child's exit is."""
    try:
        done = _described(name, model, WorkloadSpec.model_validate(workload))
    except SystemExit as exited:  # sys.exit(message) prints it and exits 1, as it would in the child
        code = exited.code
        raise SpecError(_exited(name, f"1 ({code})" if isinstance(code, str) else code or 0)) from None
    if isinstance(done, str):
        raise SpecError(done)
    return done


def _key(request: Request) -> str:
    """The cache key of a request: its model's fields as validated where they are complete (a point's model with
    its defaults written out or left out is one model) and its workload's."""
    name, model, workload = request
    with contextlib.suppress(ValueError):
        model = ModelSpec.model_validate(model).model_dump(mode="json")
    text = json.dumps([name, model, workload], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _child(requests: Sequence[Request], timeout_s: float) -> list[tuple[dict[str, Any], list[str]]]:
    """The requests described in one child process (`_describe_requested`); its first problem a SpecError."""
    names = ", ".join(dict.fromkeys(name for name, _, _ in requests))
    # The child imports what this process can: the same sys.path ('' is the working directory).
    path = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD],
            input=json.dumps(list(requests)),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        raise SpecError(
            f"field '{FIELD}': importing and calling the model factory ({names}) took over {timeout_s:g} s; check "
            "that importing its module does not wait on anything"
        ) from None
    lines = done.stdout.strip().splitlines()
    try:
        reply = json.loads(lines[-1] if done.returncode == 0 and lines else "")
    except json.JSONDecodeError:  # no verdict: the factory's module exited, or crashed the child
        tail = " | ".join(line.strip() for line in done.stderr.strip().splitlines()[-3:] if line.strip())
        raise SpecError(_exited(names, f"{done.returncode}{f' ({tail})' if tail else ''}")) from None
    if reply["problem"]:
        raise SpecError(str(reply["problem"]))
    return [(description, sources) for description, sources in reply["described"]]


def _exited(names: str, code: object) -> str:
    return (
        f"field '{FIELD}': the check of model factory {names} ended with exit code {code}; a factory's module "
        "must import without exiting"
    )


def _described(name: str, model: dict[str, Any], workload: WorkloadSpec) -> tuple[dict[str, Any], list[str]] | str:
    """`name`'s model described, with the source files of its modules; or why it cannot be: in the child, or in
    this process (`here`), either of which imports torch."""
    try:
        factory = resolve(name)
    except SpecError as error:
        return str(error)
    except Exception as error:  # the factory's module is the user's code: whatever it raises is the reason
        return f"field '{FIELD}': importing '{name}' raised {_first_line(error)}; fix its module"
    from generators.fx.describe import describe  # the child's torch, after the factory's module

    try:
        description, sources = describe(factory, name, model, workload)
    except SpecError as error:
        return str(error)
    except Exception as error:
        return (
            f"field '{FIELD}': '{name}' failed when called as factory(model, workload) ({_first_line(error)}); it "
            "must build the model as an nn.Module"
        )
    return description.as_dict(), sources


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def _describe_requested() -> None:
    """The child of `describe_models`: the requests on stdin; on its stdout, as its one line, the first problem
    or the descriptions with their source files. Whatever the factories print goes to stderr: file descriptor 1 is
    pointed there while they run."""
    verdict = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    reply: dict[str, Any] = {"problem": None, "described": []}
    for name, model, workload in json.load(sys.stdin):
        done = _described(name, model, WorkloadSpec.model_validate(workload))
        if isinstance(done, str):
            reply["problem"] = done
            break
        reply["described"].append(done)
    with contextlib.suppress(BrokenPipeError), verdict:
        verdict.write(json.dumps(reply) + "\n")
