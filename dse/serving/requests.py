"""The request stream of a serving point: drawn from its lengths and rate, or read from its trace."""

import csv
from pathlib import Path

import numpy as np

from dse.errors import SpecError
from dse.serving.shapes import Requests
from dse.serving.spec import MAX_REQUESTS, ServingSpec

TRACE_COLUMNS = ("arrival_s", "isl", "osl")


def lengths(spec: ServingSpec, mean: int, rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` token lengths of this mean under `spec.lengths` (whole tokens, at least one)."""
    how, cv = spec.lengths.distribution, spec.lengths.cv
    if how == "fixed":
        drawn = np.full(count, float(mean))
    elif how == "uniform":
        half = cv * np.sqrt(3.0) * mean
        drawn = rng.uniform(mean - half, mean + half, count)
    else:
        sigma = np.sqrt(np.log1p(cv * cv))
        drawn = rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, count)
    return np.maximum(np.rint(drawn), 1).astype(np.int64)


def requests(spec: ServingSpec) -> Requests:
    """The point's requests: `spec.requests` of them from its lengths at its rate (arrivals unused in a closed
    loop), or every row of its trace."""
    if spec.trace is not None:
        return read_trace(Path(spec.trace))
    assert spec.isl is not None and spec.osl is not None
    rng = np.random.default_rng(spec.seed)
    count = spec.requests
    isl, osl = lengths(spec, spec.isl, rng, count), lengths(spec, spec.osl, rng, count)
    if spec.rate_per_s is None:
        arrival = np.zeros(count)
    elif spec.arrival == "poisson":
        arrival = np.cumsum(rng.exponential(1.0 / spec.rate_per_s, count))
    else:
        arrival = np.arange(count) / spec.rate_per_s
    return Requests(arrival, isl, osl)


def read_trace(path: Path) -> Requests:
    """A trace CSV with a header naming arrival_s, isl and osl (other columns ignored), sorted by arrival on read."""
    where = f"field 'workload.serving.trace': {path}"
    try:
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{where}: cannot be read ({exc.__class__.__name__}); give a CSV file") from None
    if not rows:
        raise SpecError(f"{where}: has no requests; give a header {','.join(TRACE_COLUMNS)} and a row per request")
    missing = [c for c in TRACE_COLUMNS if c not in rows[0]]
    if missing:
        raise SpecError(f"{where}: has no column '{missing[0]}'; its header needs {', '.join(TRACE_COLUMNS)}")
    if len(rows) > MAX_REQUESTS:
        raise SpecError(f"{where}: has {len(rows):,} requests, over the limit of {MAX_REQUESTS:,}; split it")
    arrival, isl, osl = [], [], []
    for number, row in enumerate(rows, start=2):
        try:
            a, i, o = float(row["arrival_s"]), int(row["isl"]), int(row["osl"])
        except (TypeError, ValueError):
            raise SpecError(
                f"{where}: line {number}: arrival_s, isl and osl must be numbers (isl, osl whole)"
            ) from None
        if not (np.isfinite(a) and a >= 0 and i > 0 and o > 0):
            raise SpecError(f"{where}: line {number}: needs arrival_s >= 0 and isl, osl above 0")
        arrival.append(a)
        isl.append(i)
        osl.append(o)
    order = np.argsort(np.array(arrival), kind="stable")
    return Requests(
        np.array(arrival)[order], np.array(isl, dtype=np.int64)[order], np.array(osl, dtype=np.int64)[order]
    )
