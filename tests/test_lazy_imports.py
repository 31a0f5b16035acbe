"""A process imports scipy.optimize only to solve a serving steady state, and pandas only to read a kernel table
other than the GEMM and NCCL ones (which pyarrow reads alone): at import they cost about 0.4 CPU-s and 100 MiB,
which every Ray worker and CLI call would pay, and every catalog GPU's training point reads those two tables."""

import subprocess
import sys

HEAVY = ("pandas", "pyarrow", "scipy.optimize")


def loaded_after(code: str) -> list[str]:
    """Which of HEAVY a fresh interpreter has imported after running `code`."""
    report = f"import sys\n{code}\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", report], capture_output=True, text=True, check=True).stdout
    return [name for name in out.strip().split(",") if name]


def test_importing_the_pricing_path_leaves_the_heavy_modules_unloaded() -> None:
    code = "import dse.point.points, dse.point.evaluate, dse.search.executor, simulators.analytical"
    assert loaded_after(code) == []


def test_a_training_point_priced_from_the_gemm_and_nccl_tables_imports_no_pandas() -> None:
    code = (
        "from dse import plugins\n"
        "from dse.point.evaluate import evaluate\n"
        "from dse.point.points import build_point, expand\n"
        "from dse.tables import gemm, nccl\n"
        "raw = {'model': 'tiny-llama', 'workload': {'seq_len': 256, 'global_batch': 64, 'micro_batch': 1},\n"
        "       'parallel': {'tp': 8, 'dp': 8}, 'system': 'dgx-h100'}\n"
        "evaluate(build_point(expand(raw), 'x'), plugins.generator('symbolic'), plugins.cost_model('analytical'))\n"
        "assert gemm._grid.cache_info().currsize and nccl._table.cache_info().currsize  # both tables were read\n"
    )
    assert loaded_after(code) == ["pyarrow"]
