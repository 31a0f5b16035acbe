"""The fx generator: transformer layers captured from a model's own PyTorch code (torch.compile's ATen graphs on
fake tensors under a fake process group), lowered to the IR; the rest of the step as the symbolic generator builds
it (`generator`). torch is the optional extra `fx`: without it, choosing this generator says how to install it."""

from collections.abc import Mapping
from importlib.util import find_spec

from dse.errors import PluginError
from dse.interfaces import WorkloadGenerator

INSTALL = "pip install 'dse-orchestrator[fx]'"
UNREAD_FIELDS: Mapping[str, str] = {
    "workload.routing": "the captured MoE block routes every token in balanced capacity slots, so a skew "
    "would change nothing; remove it, or use generator symbolic"
}
"""Fields of a point this generator never reads (dse.interfaces.FieldReadingGenerator): setting one is refused.
Declared here, on the entry point, so that a point is checked without importing torch."""


def fx_generator() -> WorkloadGenerator:
    """The entry point: the generator, imported only here so that this package imports without torch."""
    if find_spec("torch") is None:
        raise PluginError(f"generator 'fx' needs PyTorch, which is not installed: {INSTALL}")
    from generators.fx.generator import FxGenerator

    return FxGenerator()


fx_generator.unread_fields = UNREAD_FIELDS  # type: ignore[attr-defined]


__all__ = ["INSTALL", "UNREAD_FIELDS", "fx_generator"]
