"""Finding a model factory: a name registered in the `dse.fx_models` entry-point group, or `package.module:callable`
for a user's installed code (the one place a study names an import path: the model's code is the user's own).

A factory is `factory(model: ModelSpec, workload: WorkloadSpec) -> torch.nn.Module`: a module whose
`forward(tokens)` returns logits and whose `layers` is the nn.ModuleList of its transformer blocks.
"""

import importlib
from collections.abc import Callable
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from dse.errors import SpecError
from dse.spec import ModelSpec

GROUP = "dse.fx_models"
FIELD = "model.fx_factory"

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
