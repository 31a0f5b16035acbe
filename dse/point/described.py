"""A point's model read from the model's code: with a generator whose model is code (fx, which declares
`describe_model` on its entry point: dse.interfaces.ModelDescriber), the model is the source of truth.

The point's model fields become optional: those it leaves out are filled from the description before the point is
validated (`complete_model`, called where a point file is loaded and where a study's trial is decoded), and those it
gives must agree with it, or the point is refused in one line naming the field and both values (`agree`). The
symbolic skeleton, memory, optimizer, DP/ZeRO traffic, model_flops and MFU are then computed from the model's real
sizes, and the parameter counts reported are the module's own (`description`). Under a generator that models the
architecture from the fields, a model that leaves them out is refused, saying to give them or to use fx.

A describer builds the model where it keeps the caller light (fx: in a child process, which imports torch), unless
the caller is about to generate the point in this same process anyway (`in_this_process`).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from dse import plugins
from dse.errors import SpecError
from dse.interfaces import ModelDescriber, ModelDescription
from dse.spec import DesignPoint, ModelSpec

REQUIRED = tuple(name for name, info in ModelSpec.model_fields.items() if info.is_required() and name != "name")
"""The model fields a point must give unless its generator reads them from the model's code."""
NOT_DESCRIBED = ("name", "fx_factory", "dtype", "family", "dropout", "flash_attention", "rope_impl")
"""Fields the model's code does not decide (its name, the training's dtype, how kernels run), or decides only
loosely (`family`, checked by `_families`)."""
SECTIONS = ("moe", "mla", "ssm")
"""The model's optional sections: one the spec sets to null that the model has is a contradiction, not a gap."""
FAMILIES = {False: ("gpt", "llama"), True: ("mixtral", "deepseek")}
"""The families a dense (False) and a mixture-of-experts (True) model can be named by."""

_IN_THIS_PROCESS: ContextVar[bool] = ContextVar("describe_in_this_process", default=False)


@contextmanager
def in_this_process() -> Iterator[None]:
    """While inside, a describer builds the model in this process rather than in a child: for a command that
    generates the point here next (`dse evaluate`), where fx would otherwise import torch twice, once in the child
    and once to capture (2-3 s of a first evaluation). `dse check` and a study's pre-flight stay outside: the
    child's isolation (a factory's module that hangs or crashes the process is one line there) is what they are
    for."""
    token = _IN_THIS_PROCESS.set(True)
    try:
        yield
    finally:
        _IN_THIS_PROCESS.reset(token)


def describing_here() -> bool:
    """Whether a describer is asked to build the model in this process (`in_this_process`)."""
    return _IN_THIS_PROCESS.get()


def describer(generator: str) -> ModelDescriber | None:
    """The generator's `describe_model`, or None for one that models the architecture from the fields."""
    return getattr(plugins.load("generator", generator), "describe_model", None)


def complete_model(expanded: dict[str, Any], generator: str, where: str = "") -> dict[str, Any]:
    """Expanded point data (dse.point.points.expand) with its model filled from the model's code and checked
    against it, under a generator that describes models; `where` leads the fields an error names ('base.')."""
    model = expanded.get("model")
    if not isinstance(model, dict):
        return expanded
    describe = describer(generator)
    missing = [name for name in REQUIRED if name not in model]
    if describe is None:
        if missing and "fx_factory" in model:
            raise SpecError(
                f"field '{where}model.{missing[0]}' is missing: generator '{generator}' builds the model from its "
                "fields; give them, or use generator fx, which reads them from the model's code (model.fx_factory)"
            )
        return expanded
    if "fx_factory" not in model and "family" not in model:
        return expanded  # no code named: validation names the missing field
    workload = expanded.get("workload")
    description = describe(model, workload if isinstance(workload, dict) else {})
    agree(model, description, where)
    return {**expanded, "model": filled(model, description)}


def agree(model: dict[str, Any], description: ModelDescription, where: str = "") -> None:
    """A SpecError naming the first field the point gives that the model's code contradicts, and both values."""
    has = description.fields
    for name, value in model.items():
        if value is None and name in SECTIONS and has.get(name):  # a section the spec says the model lacks
            _refuse(f"{where}model.{name}", value, has[name], description.factory)
        if name in NOT_DESCRIBED:
            if name == "family" and value not in FAMILIES["moe" in has]:
                kind = "a mixture of experts" if "moe" in has else "a dense transformer"
                _refuse(f"{where}model.family", value, kind, description.factory)
            continue
        if name == "moe":
            sections = {**(value or {})} if isinstance(value, dict) else {}
            if value and "moe" not in has:
                _refuse(f"{where}model.moe", "a section", "no experts", description.factory)
            for inner, given in sections.items():
                if given != has.get("moe", {}).get(inner, given):
                    _refuse(f"{where}model.moe.{inner}", given, has["moe"][inner], description.factory)
            continue
        found = _effective(name, has)
        if found is not None and value is not None and value != found:
            _refuse(f"{where}model.{name}", value, found, description.factory)


def _effective(name: str, fields: dict[str, Any]) -> Any:
    """The described value of a field, its default worked out where the description leaves it to one."""
    if name == "head_dim" and "heads" in fields:
        return fields.get("head_dim") or fields["hidden"] // fields["heads"]
    return fields.get(name)


def _refuse(field: str, given: Any, found: Any, factory: str) -> None:
    raise SpecError(
        f"field '{field}': the spec says {given!r}, the model built by factory '{factory}' has {found!r}; remove "
        "the field (the model is the truth) or fix it"
    )


def filled(model: dict[str, Any], description: ModelDescription) -> dict[str, Any]:
    """The point's model fields with those it leaves out taken from the description (which they agree with)."""
    out = {**description.fields, **model}
    if isinstance(model.get("moe"), dict) and "moe" in description.fields:
        out["moe"] = {**description.fields["moe"], **model["moe"]}
    return out


def description(point: DesignPoint, generator: str) -> ModelDescription | None:
    """The point's model as its code builds it (its exact parameter counts), under a generator that describes
    models; None under the others, whose counts are ModelSpec's closed form (dse.modelstats)."""
    describe = describer(generator)
    if describe is None:
        return None
    return describe(point.model.model_dump(mode="json", exclude_unset=True), point.workload.model_dump(mode="json"))
