"""dse.lru: caches bounded in bytes, least recently used out first, with hit counts and the summary line."""

import random
from collections import OrderedDict

import pytest

from dse import lru
from dse.errors import SpecError
from dse.lru import MIB, ByteBoundedLru, IdentityMemo


def sized(budget: int, name: str = "test") -> ByteBoundedLru[str, bytes]:
    return ByteBoundedLru(name, budget, len)


def test_entries_are_evicted_by_bytes_not_by_count():
    cache = sized(10)
    cache.put("a", b"xxxx")
    cache.put("b", b"yyyy")
    assert (len(cache), cache.bytes) == (2, 8)
    cache.put("c", b"zzz")  # 11 bytes would pass 10: the oldest goes
    assert cache.peek("a") is None
    assert (len(cache), cache.bytes) == (2, 7)
    for many in "defghij":  # ten one-byte entries fit where two four-byte ones did
        cache.put(many, b"1")
    assert (len(cache), cache.bytes) == (8, 10)


def test_the_least_recently_used_goes_first():
    cache = sized(8)
    cache.put("a", b"xxxx")
    cache.put("b", b"yyyy")
    assert cache.get("a") == b"xxxx"  # now b is the least recently used
    cache.put("c", b"zzzz")
    assert cache.peek("b") is None
    assert cache.peek("a") == b"xxxx"


def test_an_entry_over_the_whole_budget_is_not_kept_and_replaces_nothing_but_its_key():
    cache = sized(4)
    cache.put("a", b"xx")
    cache.put("b", b"y")
    cache.put("a", b"xxxxx")
    assert cache.peek("a") is None
    assert (cache.peek("b"), cache.bytes) == (b"y", 1)


def test_putting_a_key_again_counts_its_new_size():
    cache = sized(10)
    cache.put("a", b"xx")
    cache.put("a", b"xxxxxx")
    assert (len(cache), cache.bytes) == (1, 6)


def test_hits_and_misses_are_counted_per_cache_and_in_the_summary():
    cache = sized(10, name="counted")
    cache.put("a", b"xx")
    cache.get("a")
    cache.get("a")
    cache.get("b")
    cache.peek("b")  # not a lookup
    assert (cache.hits, cache.misses) == (2, 1)
    assert "counted 2/3 hits (67%), 1 kept, 0.0 of 0 MiB" in lru.summary()


def test_the_environment_variable_sets_every_budget(monkeypatch):
    monkeypatch.setenv(lru.ENV_VAR, "1.5")
    assert sized(10).budget_bytes == 3 * MIB // 2
    monkeypatch.setenv(lru.ENV_VAR, "0")
    cache = sized(10)
    cache.put("a", b"x")
    assert len(cache) == 0
    monkeypatch.setenv(lru.ENV_VAR, "lots")
    with pytest.raises(SpecError, match="DSE_CACHE_MIB='lots'"):
        sized(10)


def test_a_random_run_keeps_what_a_reference_lru_keeps():
    """Gets, peeks and puts of entries of random sizes: the entries kept, their order of use and the bytes are those
    of an OrderedDict that evicts from its front until a put fits."""
    rng = random.Random(7)
    cache, want = sized(40), OrderedDict()
    for _ in range(3000):
        key, what = rng.randrange(30), rng.random()
        if what < 0.4:
            found = cache.get(key) if what < 0.3 else cache.peek(key)
            assert found == want.get(key)
            if key in want:
                want.move_to_end(key)
        else:
            value = b"v" * rng.randrange(1, 45)
            cache.put(key, value)
            want.pop(key, None)
            if len(value) <= 40:
                while sum(map(len, want.values())) + len(value) > 40:
                    want.popitem(last=False)
                want[key] = value
        assert cache.values() == list(want.values())
        assert cache.bytes == sum(map(len, want.values()))


def test_an_identity_memo_derives_once_per_object_and_empties_when_full():
    """`IdentityMemo` finds a value by its object's identity (an equal object is another key), keeps the object so
    that its identity cannot be reused while the entry lives, and empties itself when it holds `most`."""
    memo: IdentityMemo[int] = IdentityMemo(2)
    derived: list[object] = []

    def derive(of: object) -> int:
        derived.append(of)
        return len(derived)

    a, b, c = [1], [1], [2]
    assert memo.get(a, lambda: derive(a)) == 1
    assert memo.get(a, lambda: derive(a)) == 1
    assert memo.get(b, lambda: derive(b)) == 2  # equal to a, not a
    assert memo.get(c, lambda: derive(c)) == 3  # full: emptied first
    assert memo.get(a, lambda: derive(a)) == 4
    assert memo.get(c, lambda: derive(c)) == 3
    assert derived == [a, b, c, a]
