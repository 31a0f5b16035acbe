"""Settings of a process that prices points: its garbage collector and its allocator, set once per process by
what evaluates points (a study's evaluator actors, a sweep's workers, the benchmarks that measure them)."""

import ctypes
import gc
import sys

GC_THRESHOLDS = (10_000, 100, 20)
"""The evaluator processes' garbage-collector thresholds. A workload is tens of thousands of small objects, nearly
all freed by reference counting; with CPython's defaults (700, 10, 10) the cyclic collector still walks the whole
heap, the plugins' caches included, every few evaluations: 13-16% of the CPU time of benchmarks/evaluate_rate.py,
which applies the same thresholds. What a young collection walks is what was made since the last one and is still
alive: mostly the tuples a generated workload's calls are (untracked once walked, so each is walked once). At
50,000 a collection walked about 50,000 of them, a 14-17 ms pause landing on one point: on
benchmarks/vs_calculon.py's 96 configurations, 5x the median revisit on whichever configuration it fell on. At
10,000 the pauses are at most 3.5-4 ms and their total is lower (27 against 34 ms over the benchmark's 288
points: fewer objects walked out of the processor's caches); the middle generation's 100 keeps its collections
to one per million objects, as 50,000 x 20 did (at 20 one walked 34 ms of objects kept by the caches)."""

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""glibc's mallopt parameters (malloc.h)."""
MALLOC_SETTINGS = ((M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20), (M_MMAP_THRESHOLD, 1 << 30))
"""Keep freed heap for the next point rather than give it back to the system: pricing a point allocates and frees
a few MB of arrays (the compiled engine's tables, busy intervals, memory events), and with glibc's defaults the
heap's top is trimmed and arrays over its adaptive threshold are mapped afresh, so every point touched its pages
anew: about 600 page faults a point on benchmarks/vs_calculon.py's GPT-3 configurations, 0.4-1 ms of the 9-10 ms a
first-visit point cost (2026-11-29). Trimming only above 1 GiB free, growing the heap 64 MiB at a time and mapping
only blocks of 1 GiB or more halves those faults (an older glibc refuses a mapping threshold over 32 MiB; that
is then set instead). The price: a
process keeps its peak heap (up to 1 GiB) instead of returning it, which a long-lived evaluator reuses anyway."""


def tune_process() -> None:
    """GC_THRESHOLDS, and MALLOC_SETTINGS where the C library is glibc (elsewhere its allocator is left as is)."""
    gc.set_threshold(*GC_THRESHOLDS)
    if not sys.platform.startswith("linux"):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # musl has none
    if mallopt is None:
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    for parameter, value in MALLOC_SETTINGS:
        if not mallopt(parameter, value) and parameter == M_MMAP_THRESHOLD:
            mallopt(parameter, 32 << 20)
