"""Captures kept on disk, so that a second process (a later `dse evaluate`, a study's Ray worker) reuses what an
earlier one captured instead of paying torch.compile again.

An entry is one pickled value (a lowered piece, `generators.fx.pieces`, without its fx graphs) under a digest of
its key, which is the caller's key (the generator's capture key: the factory, the model's fields and plan, the
shape, the parallel degrees, the recompute policy...) together with the installed torch version and the source of
this package's modules (so that an edit to the capture or the lowering invalidates every entry). What the model's
own code is cannot be known without building it (that needs torch), so an entry also records the source files the
model came from (`model_sources`: the factory's module and the modules its model's classes are defined in) with a
hash of each, and a lookup whose files have changed since is a miss: an entry is read without importing torch.

The cache lives in $DSE_FX_CACHE (default ~/.cache/dse/fx, under $XDG_CACHE_HOME when set; `off` disables it).
Writes are atomic (a temporary file renamed into place), so processes share it safely; an entry that cannot be
read (corrupt, truncated, from classes since renamed) is a miss and is captured again; the least recently used
entries are removed once the directory holds over MAX_BYTES. Clearing it is removing the directory. Entries are
pickles: the directory must be the user's own, as ~/.cache is.
"""

import contextlib
import hashlib
import os
import pickle
import sys
import tempfile
from collections.abc import Hashable, Iterable
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ENV = "DSE_FX_CACHE"
OFF = "off"
MAX_BYTES = 512 * 2**20
"""The directory's bound: a lowered llama3-8b layer is ~100 KB, so this holds thousands of captures."""
FORMAT = 1
"""The entries' layout: bumped when what an entry holds changes shape."""
SUFFIX = ".pkl"

_HERE = Path(__file__).resolve().parent


def directory() -> Path | None:
    """Where entries live; None when the cache is off."""
    configured = os.environ.get(ENV, "").strip()
    if configured.lower() == OFF:
        return None
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "dse" / "fx"


@cache
def code_version() -> str:
    """The installed torch and this package's own modules (not its models/, which are models): what a capture is
    made by, besides the model."""
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "none"
    digest = hashlib.sha256(f"{FORMAT} {torch} {sys.version_info[:2]}".encode())
    for path in sorted(_HERE.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _entry(key: Hashable) -> Path | None:
    root = directory()
    if root is None:
        return None
    name = hashlib.sha256(repr((code_version(), key)).encode()).hexdigest()
    return root / f"{name}{SUFFIX}"


def _hashes(paths: Iterable[str]) -> dict[str, str] | None:
    """Each file's content hash; None when one cannot be read (a source deleted since)."""
    try:
        return {path: hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in sorted(set(paths))}
    except OSError:
        return None


def load(key: Hashable) -> Any | None:
    """The value stored under `key`, or None: none stored, its model's sources changed since, or unreadable."""
    path = _entry(key)
    if path is None:
        return None
    try:
        with path.open("rb") as file:
            sources, value = pickle.load(file)
    except OSError:  # none stored, or a directory that cannot be read
        return None
    except Exception:  # corrupt or truncated, or of classes since changed: whatever unpickling raised, recapture
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    if not isinstance(sources, dict) or _hashes(sources) != sources:
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: pruned last
    return value


def store(key: Hashable, value: Any, sources: Iterable[str]) -> None:
    """Keeps `value` under `key` with the hashes of the model's `sources`. The cache is only a saving: a directory
    that cannot be written (read-only, full) leaves the run as it was, without the entry."""
    path = _entry(key)
    hashes = _hashes(sources)
    if path is None or hashes is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=path.parent, suffix=".tmp", delete=False) as file:
            pickle.dump((hashes, value), file, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(file.name, path)
    except OSError:
        return
    _prune(path.parent)


def _prune(root: Path) -> None:
    """The least recently used entries removed while the directory holds more than MAX_BYTES."""
    try:
        entries = [(entry.stat(), entry) for entry in root.glob(f"*{SUFFIX}")]
    except OSError:
        return
    total = sum(stat.st_size for stat, _ in entries)
    for stat, entry in sorted(entries, key=lambda pair: pair[0].st_mtime):
        if total <= MAX_BYTES:
            break
        with contextlib.suppress(OSError):  # another process's prune may have removed it first
            entry.unlink()
        total -= stat.st_size


def model_sources(factory: Any, built: Any) -> list[str]:
    """The source files a model comes from: its factory's module and the modules of its submodules' classes and
    their bases (a Hugging Face model's modeling file and transformers' own), torch's aside (its version is in
    every key)."""
    classes = {c for m in built.modules() for c in type(m).__mro__}
    modules = {getattr(factory, "__module__", None)} | {c.__module__ for c in classes}
    files = (getattr(sys.modules.get(name or ""), "__file__", None) for name in modules)
    return sorted(f for f in files if f and f.endswith(".py") and f"{os.sep}torch{os.sep}" not in f)
