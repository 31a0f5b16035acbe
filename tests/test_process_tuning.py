"""What `tune_process` sets: the evaluators' garbage-collector thresholds, and an allocator that keeps freed memory
for the next point instead of faulting fresh pages in for it."""

import os
import subprocess
import sys

import pytest

FAULTS = """
import gc, resource, sys
import numpy as np
from dse.search.tuning import GC_THRESHOLDS, tune_process
if sys.argv[1] == "tuned":
    tune_process()
    assert gc.get_threshold() == GC_THRESHOLDS
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    values = np.ones(100 << 17)  # 100 MiB, written through: every page touched
    del values
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[-1])
"""


def _faults(mode: str) -> int:
    env = {**os.environ, "NUMPY_MADVISE_HUGEPAGE": "0"}  # count 4 KiB pages, not whichever the kernel gives
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True, env=env)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_a_tuned_process_reuses_the_pages_it_freed():
    """A 100 MiB array (25,600 pages of 4 KiB) allocated again after being freed: mapped afresh by default, so
    every page faults in again; from the kept heap once tuned."""
    assert _faults("default") > 20_000
    assert _faults("tuned") < 1_000
