"""Results a cost model priced in this process, by point key and settings: an optimizer may propose a point
again, and a refinement re-prices points a screen already saw.

An entry serves only a workload equal to the one it priced (`contents`), so a workload built otherwise under the
same key, or edited since, is priced afresh; a cache empties when full. Every cost model plugin keeps its own.
"""

from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace

from dse.interfaces import SimResult
from dse.workload import DeferredPrograms, Program, TableTensors, Tensor, Workload

RESULT_CACHE_SIZE = 32


class ResultCache:
    def __init__(self, size: int = RESULT_CACHE_SIZE) -> None:
        self.size = size
        self._entries: dict[Hashable, tuple[tuple, SimResult]] = {}

    def priced(self, key: Hashable, workload: Workload, price: Callable[[], SimResult]) -> SimResult:
        """The cached result of an equal workload under this key, else `price()`'s, kept; a copy either way."""
        snapshot = contents(workload)
        cached = self._entries.get(key)
        if cached is not None and cached[0] == snapshot:
            return _copy(cached[1])
        result = price()
        if len(self._entries) >= self.size:
            self._entries.clear()
        self._entries[key] = (snapshot, _copy(result))
        return result

    def clear(self) -> None:
        self._entries.clear()


def contents(workload: Workload) -> tuple:
    """What a workload is made of, with every list copied: their items are immutable, so this stays equal to the
    workload as it was. Programs generated from one skeleton share their calls and their table of activation
    tensors, so two such snapshots compare by identity, item by item, and by the tensors' sizes. Programs still
    to be built (DeferredPrograms) cannot have been edited, and the generator builds them alike for workloads
    whose steady forms are alike."""
    w = workload
    if isinstance(w.programs, DeferredPrograms) and not w.programs.built and w.steady is not None:
        programs: tuple = ("steady", w.steady.microbatches, w.steady.repeats, _programs(w.steady.programs))
    else:
        programs = _programs(w.programs)
    return (w.point_key, w.layout, w.tokens, w.model_flops, w.dtype, w.class_of.tolist(), list(w.blocks), programs)


def _programs(programs: Sequence[Program]) -> tuple:
    return tuple((p.rank_class, p.name, list(p.calls), _tensors(p.tensors)) for p in programs)


def _tensors(tensors: Sequence[Tensor]) -> object:
    return tensors.snapshot() if isinstance(tensors, TableTensors) else list(tensors)


def _copy(result: SimResult) -> SimResult:
    """A copy the caller may change without changing the cached result."""
    classes = [
        replace(c, memory_at_peak=dict(c.memory_at_peak), time_by_category=dict(c.time_by_category))
        for c in result.classes
    ]
    return SimResult(result.step_time_s, classes, list(result.timeline))
