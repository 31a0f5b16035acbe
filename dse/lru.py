"""Per-process caches bounded in bytes, least recently used out first, with their hit counts.

A study's points share far more structure than they differ in (issue 36): a cache holds the distinct structures
of a study only if it is bounded by what they weigh, not by a count of entries picked for one model, and emptying
it when full throws away the structures a second pass comes back to. Each cache is a `cachetools.LRUCache` (a
dependency already installed with mlflow) whose `getsizeof` is the caller's estimate of an entry's bytes: a count
of what the entry holds times bytes per item measured once with tracemalloc or a walk of gc referents. A generic
deep size at every put would walk into what entries share (calls, skeletons, a builder's closure): it summed
22 MB for a workload tracemalloc puts at ~270 KB, and took ~100 ms where pricing the point takes ~20.

Budgets: each cache's documented default, or `DSE_CACHE_MIB` for every cache (0: keep nothing). `summary()` is
the line `dse run` logs and the benchmarks print: per cache name, the lookups' hits in this process (over every
instance, alive or not) and the entries and bytes the live instances keep.
"""

import os
import weakref
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from cachetools import LRUCache

from dse.errors import SpecError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

ENV_VAR = "DSE_CACHE_MIB"
MIB = 1 << 20


def budget(default_bytes: int) -> int:
    """The byte budget of a cache whose default is `default_bytes`, unless DSE_CACHE_MIB sets every cache's."""
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return default_bytes
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    if not mib >= 0:
        raise SpecError(f"environment variable {ENV_VAR}={raw!r}: give each cache's budget in MiB, a number >= 0")
    return int(mib * MIB)


class ByteBoundedLru(Generic[K, V]):
    """A cache of at most `budget_bytes` by `size_of`'s estimate; putting an entry evicts the least recently
    used ones until it fits, and an entry larger than the whole budget is not kept. Values are never None."""

    def __init__(self, name: str, default_bytes: int, size_of: Callable[[V], int]) -> None:
        self.name = name
        self.hits = 0
        self.misses = 0
        self._entries: LRUCache[K, V] = LRUCache(maxsize=budget(default_bytes), getsizeof=size_of)
        _LIVE.add(self)

    def get(self, key: K) -> V | None:
        """The entry, made the most recently used; counts a hit or a miss."""
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            _LOOKUPS[self.name, "misses"] += 1
        else:
            self.hits += 1
            _LOOKUPS[self.name, "hits"] += 1
        return value

    def peek(self, key: K) -> V | None:
        """The entry, made the most recently used, without counting a lookup (a caller about to put it again)."""
        return self._entries.get(key)

    def put(self, key: K, value: V) -> None:
        if self._entries.getsizeof(value) > self._entries.maxsize:
            self._entries.pop(key, None)
            return
        self._entries[key] = value

    @property
    def bytes(self) -> int:
        return int(self._entries.currsize)

    @property
    def budget_bytes(self) -> int:
        return int(self._entries.maxsize)

    def values(self) -> list[V]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


_LIVE: "weakref.WeakSet[ByteBoundedLru]" = weakref.WeakSet()
"""Every cache alive in this process (a generator's lives as long as its instance)."""
_LOOKUPS: Counter[tuple[str, str]] = Counter()
"""Per cache name and outcome ("hits", "misses"), the lookups of every instance since the process started."""


def summary() -> str:
    """One line: every cache name looked up in this process, its hits, and what its live instances keep; empty
    if none was looked up (every point priced in other processes)."""
    names = sorted({name for name, _ in _LOOKUPS})
    parts = []
    for name in names:
        hits, looked = _LOOKUPS[name, "hits"], _LOOKUPS[name, "hits"] + _LOOKUPS[name, "misses"]
        live = [cache for cache in _LIVE if cache.name == name]
        kept, held = sum(len(cache) for cache in live), sum(cache.bytes for cache in live)
        budgets = sorted({cache.budget_bytes for cache in live})
        of = f" of {'/'.join(f'{b / MIB:.0f}' for b in budgets)}" if budgets else ""
        parts.append(f"{name} {hits}/{looked} hits ({100 * hits / looked:.0f}%), {kept} kept, {held / MIB:.1f}{of} MiB")
    return "caches in this process: " + "; ".join(parts) if parts else ""
