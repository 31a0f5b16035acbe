"""The fx generator: transformer layers captured from a model's own PyTorch code (torch.compile's ATen graphs on
fake tensors under a fake process group), lowered to the IR; the rest of the step as the symbolic generator builds
it (`generator`). torch is the optional extra `fx`: without it, choosing this generator says how to install it."""

from importlib.util import find_spec

from dse.errors import PluginError
from dse.interfaces import WorkloadGenerator
from generators.fx.factories import describe_model

INSTALL = "pip install 'dse-orchestrator[fx]'"


def fx_generator() -> WorkloadGenerator:
    """The entry point: the generator, imported only here so that this package imports without torch."""
    if find_spec("torch") is None:
        raise PluginError(f"generator 'fx' needs PyTorch, which is not installed: {INSTALL}")
    from generators.fx.generator import FxGenerator

    return FxGenerator()


fx_generator.describe_model = describe_model  # type: ignore[attr-defined]  # dse.interfaces.ModelDescriber


__all__ = ["INSTALL", "fx_generator"]
