"""Known models, accelerators and system presets, as YAML files beside this module."""

from functools import cache
from pathlib import Path
from typing import Any, Literal

from dse.errors import SpecError
from dse.yamlio import load_mapping

CATALOG_DIR = Path(__file__).parent
Kind = Literal["models", "accelerators", "systems"]


@cache
def names(kind: Kind) -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (CATALOG_DIR / kind).glob("*.yaml")))


@cache
def _entry(kind: Kind, name: str) -> dict[str, Any]:
    if name not in names(kind):  # a name, not a path: '../systems/x' or a 300-character name is unknown too
        shown = name if len(name) <= 60 else f"{name[:40]}...({len(name)} characters)"
        raise SpecError(f"unknown {kind.rstrip('s')} '{shown}'; known: {', '.join(names(kind))}")
    data = load_mapping(CATALOG_DIR / kind / f"{name}.yaml")
    data.setdefault("name", name)
    return data


def entry(kind: Kind, name: str) -> dict[str, Any]:
    """A fresh copy of a catalog entry as plain data, ready to be overridden."""
    import copy

    return copy.deepcopy(_entry(kind, name))
