"""Per-process caches bounded in bytes, least recently used out first, with their hit counts.

A study's points share far more structure than they differ in (issue 36): a cache holds the distinct structures of a
study only if it is bounded by what they weigh, not by a count of entries picked for one model, and emptying it when
full throws away the structures a second pass comes back to. Each cache sizes an entry by the caller's estimate of
its bytes (`ByteBoundedLru`): a count of what the entry holds times bytes per item measured once with tracemalloc or
a walk of gc referents. A generic deep size at every put would walk into what entries share (calls, skeletons, a
builder's closure): it summed 22 MB for a workload tracemalloc puts at ~270 KB, and took ~100 ms where pricing the
point takes ~20.

Budgets: each cache's documented default, or `DSE_CACHE_MIB` for every cache (0: keep nothing). `summary()` is
the line `dse run` logs and the benchmarks print: per cache name, the lookups' hits in this process (over every
instance, alive or not) and the entries and bytes the live instances keep.
"""

import os
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

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
    used ones until it fits, and an entry larger than the whole budget is not kept. Values are never None.

    A plain dict in recency order (a hit is taken out and put back at the end, the oldest is first) with each
    entry's size beside it: cachetools' LRUCache, which this replaces, is a few Python calls deep per lookup (a hit
    0.36 us against 0.11 here, a put 0.36 against 0.20, timeit on this machine), and a point makes about 50
    lookups and 20 puts."""

    def __init__(self, name: str, default_bytes: int, size_of: Callable[[V], int]) -> None:
        self.name = name
        self.hits = 0
        self.misses = 0
        self._size_of = size_of
        self._budget = budget(default_bytes)
        self._bytes = 0
        self._entries: dict[K, V] = {}
        """The entries, least recently used first."""
        self._sizes: dict[K, int] = {}
        """Each entry's size, as `size_of` gave it when put."""
        self._counts = _LOOKUPS.setdefault(name, [0, 0])
        _LIVE.add(self)

    def get(self, key: K) -> V | None:
        """The entry, made the most recently used; counts a hit or a miss."""
        entries = self._entries
        value = entries.pop(key, None)
        if value is None:
            self.misses += 1
            self._counts[1] += 1
            return None
        entries[key] = value
        self.hits += 1
        self._counts[0] += 1
        return value

    def peek(self, key: K) -> V | None:
        """The entry, made the most recently used, without counting a lookup (a caller about to put it again)."""
        entries = self._entries
        value = entries.pop(key, None)
        if value is not None:
            entries[key] = value
        return value

    def put(self, key: K, value: V) -> None:
        size = self._size_of(value)
        entries, sizes = self._entries, self._sizes
        if key in entries:
            del entries[key]
            self._bytes -= sizes.pop(key)
        if size > self._budget:
            return
        while self._bytes + size > self._budget:
            oldest = next(iter(entries))
            del entries[oldest]
            self._bytes -= sizes.pop(oldest)
        entries[key] = value
        sizes[key] = size
        self._bytes += size

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def values(self) -> list[V]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._sizes.clear()
        self._bytes = 0


class IdentityMemo(Generic[V]):
    """Values derived from objects, found by the object's identity: a few bytes each (a system's parts as JSON, a
    block's facts), derived where hashing or comparing the object would cost as much as deriving them again. The
    object is kept with its value, so that its identity stays its own while the entry lives. Bounded by a count and
    emptied when full, not by bytes as `ByteBoundedLru` is: its entries weigh too little to estimate, and a study
    meets few enough objects that emptying it costs one derivation each."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._kept: dict[int, tuple[object, V]] = {}

    def get(self, of: object, derive: Callable[[], V]) -> V:
        """derive()'s value for `of`, derived once while kept."""
        found = self._kept.get(id(of))
        if found is None or found[0] is not of:
            if len(self._kept) >= self.most:
                self._kept.clear()
            found = self._kept[id(of)] = (of, derive())
        return found[1]

    def clear(self) -> None:
        self._kept.clear()


_LIVE: "weakref.WeakSet[ByteBoundedLru]" = weakref.WeakSet()
"""Every cache alive in this process (a generator's lives as long as its instance)."""
_LOOKUPS: dict[str, list[int]] = {}
"""Per cache name, the hits and misses of every instance since the process started (one list its instances share)."""


def summary() -> str:
    """One line: every cache name looked up in this process, its hits, and what its live instances keep; empty
    if none was looked up (every point priced in other processes)."""
    parts = []
    for name in sorted(_LOOKUPS):
        hits, looked = _LOOKUPS[name][0], sum(_LOOKUPS[name])
        if not looked:
            continue
        live = [cache for cache in _LIVE if cache.name == name]
        kept, held = sum(len(cache) for cache in live), sum(cache.bytes for cache in live)
        budgets = sorted({cache.budget_bytes for cache in live})
        of = f" of {'/'.join(f'{b / MIB:.0f}' for b in budgets)}" if budgets else ""
        parts.append(f"{name} {hits}/{looked} hits ({100 * hits / looked:.0f}%), {kept} kept, {held / MIB:.1f}{of} MiB")
    return "caches in this process: " + "; ".join(parts) if parts else ""
