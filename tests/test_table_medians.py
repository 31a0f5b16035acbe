"""`dse.tables.source.medians` stands in for pandas' groupby median where the GEMM and NCCL tables are read without
pandas: it must give pandas' keys and medians, NaN times left out, on repeated rows of several key columns."""

import numpy as np
import pandas as pd

from dse.tables.source import medians


def test_medians_agree_with_pandas_groupby_median() -> None:
    rng = np.random.default_rng(7)
    rows = 2_000
    names = rng.choice(np.array(["all_gather", "all_reduce", "reduce_scatter"]), rows)
    gpus = rng.choice([2, 4, 8], rows)
    sizes = rng.choice([1024.0, 4096.0, 65536.0, 2.0**20], rows)
    seconds = rng.lognormal(-10, 1, rows)
    seconds[rng.random(rows) < 0.1] = np.nan
    seconds[(names == "all_gather") & (gpus == 2) & (sizes == 1024.0)] = np.nan  # a key timed by no row

    (got_names, got_gpus, got_sizes), got = medians([names, gpus, sizes], seconds)

    frame = pd.DataFrame({"name": names, "gpus": gpus, "size": sizes, "seconds": seconds})
    expected = frame.groupby(["name", "gpus", "size"])["seconds"].median().dropna()
    assert list(zip(got_names, got_gpus.tolist(), got_sizes.tolist(), strict=True)) == expected.index.tolist()
    assert np.array_equal(got, expected.to_numpy())  # the same middle values, and their mean where two
    assert ("all_gather", 2, 1024.0) not in expected.index
