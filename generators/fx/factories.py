"""Finding a model factory: a name registered in the `dse.fx_models` entry-point group, or `package.module:callable`
for a user's installed code (the one place a study names an import path: the model's code is the user's own).

A factory is `factory(model: ModelSpec, workload: WorkloadSpec) -> torch.nn.Module`: a module whose
`forward(tokens)` returns logits and whose `layers` is the nn.ModuleList of its transformer blocks. For a decode
workload it builds the model with a KV cache of workload.seq_len tokens for each of workload.micro_batch sequences,
and its `forward(tokens, input_pos)` is gpt-fast's decoding step: tokens [batch, 1], one new token per sequence, at
positions input_pos [1] (seq_len - 1, the cache's last slot), whose keys and values each block writes to its cache
in place before attending over all of it (`generators.fx.models`: a cache module `attention.cache` of buffers
[batch, seq, kv_heads, head_dim], split over tp like the heads; Hugging Face's StaticCache).

`check` is the generator's pre-flight: each factory a study's points name is imported and called on the meta
device in a child process (`python -m generators.fx.factories`), whose prints cannot reach our stdout (a
`dse evaluate --json` prints one JSON line there) and whose hang is ended by a timeout.
"""

import contextlib
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
from dse.spec import DesignPoint, ModelSpec, WorkloadSpec

GROUP = "dse.fx_models"
FIELD = "model.fx_factory"
CHECK_TIMEOUT_S = 120.0
"""How long the child that imports and calls the factories may take (importing torch takes 2-10 s)."""

Factory = Callable[..., Any]


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


def check(points: Sequence[DesignPoint], timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """A SpecError naming FIELD if a factory the points name is not registered, does not import, is not callable, or
    does not return an nn.Module with its `layers` when called with a point's model and workload (on the meta
    device: no weights). Each factory is checked once, with the first point that names it, all in one child."""
    wanted: dict[str, DesignPoint] = {}
    for point in points:
        wanted.setdefault(factory_name(point.model), point)
    unknown = [name for name in wanted if ":" not in name and name not in _registered()]
    if unknown:
        resolve(unknown[0])  # raises the error naming the registered factories
    if not wanted:
        return
    request = [[name, p.model.model_dump_json(), p.workload.model_dump_json()] for name, p in wanted.items()]
    # The child imports what this process can: the same sys.path ('' is the working directory).
    path = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        names = ", ".join(wanted)
        raise SpecError(
            f"field '{FIELD}': importing and calling the model factory ({names}) took over {timeout_s:g} s; check "
            "that importing its module does not wait on anything"
        ) from None
    lines = done.stdout.strip().splitlines()
    try:
        problem = json.loads(lines[-1] if done.returncode == 0 and lines else "")
    except json.JSONDecodeError:  # no verdict: the factory's module exited, or crashed the child
        tail = " | ".join(line.strip() for line in done.stderr.strip().splitlines()[-3:] if line.strip())
        raise SpecError(
            f"field '{FIELD}': the check of model factory {', '.join(wanted)} ended with exit code "
            f"{done.returncode}{f' ({tail})' if tail else ''}; a factory's module must import without exiting"
        ) from None
    if problem:
        raise SpecError(str(problem))


def _problem(name: str, model: ModelSpec, workload: WorkloadSpec) -> str | None:
    """Why `name` cannot build the model, or None: in the checking child, which imports torch."""
    try:
        factory = resolve(name)
    except SpecError as error:
        return str(error)
    except Exception as error:  # the factory's module is the user's code: whatever it raises is the reason
        return f"field '{FIELD}': importing '{name}' raised {_first_line(error)}; fix its module"
    import torch  # the child's, not the caller's; after the factory's module, so that a typo needs no torch
    from torch import nn

    try:
        with torch.device("meta"):
            built = factory(model, workload)
    except Exception as error:
        return (
            f"field '{FIELD}': '{name}' failed when called as factory(model, workload) ({_first_line(error)}); it "
            "must build the model as an nn.Module"
        )
    if not isinstance(built, nn.Module):
        return f"field '{FIELD}': '{name}' returned {type(built).__name__}, not a torch.nn.Module"
    if not isinstance(getattr(built, "layers", None), nn.ModuleList):
        kind = type(built).__name__
        return f"field '{FIELD}': '{name}' built a {kind} without `layers`, the nn.ModuleList of its blocks"
    return None


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def _check_requested() -> None:
    """The child of `check`: the request on stdin, the first problem (or null) as the one line on its stdout.
    Whatever the factories print goes to stderr: file descriptor 1 is pointed there while they run."""
    verdict = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    problem = None
    for name, model, workload in json.load(sys.stdin):
        problem = _problem(name, ModelSpec.model_validate_json(model), WorkloadSpec.model_validate_json(workload))
        if problem:
            break
    with contextlib.suppress(BrokenPipeError), verdict:
        verdict.write(json.dumps(problem) + "\n")


if __name__ == "__main__":
    _check_requested()
