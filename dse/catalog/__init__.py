"""Known models, accelerators and system presets, as YAML files beside this module."""

from functools import cache
from pathlib import Path
from typing import Any, Literal

from dse.errors import SpecError
from dse.yamlio import load_mapping

CATALOG_DIR = Path(__file__).parent
Kind = Literal["models", "accelerators", "systems"]


def names(kind: Kind) -> list[str]:
    return sorted(p.stem for p in (CATALOG_DIR / kind).glob("*.yaml"))


@cache
def _entry(kind: Kind, name: str) -> dict[str, Any]:
    path = CATALOG_DIR / kind / f"{name}.yaml"
    if not path.is_file():
        singular = kind.rstrip("s")
        raise SpecError(f"unknown {singular} '{name}'; known: {', '.join(names(kind))}")
    data = load_mapping(path)
    data.setdefault("name", name)
    return data


def entry(kind: Kind, name: str) -> dict[str, Any]:
    """A fresh copy of a catalog entry as plain data, ready to be overridden."""
    import copy

    return copy.deepcopy(_entry(kind, name))
