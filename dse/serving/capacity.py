"""The highest request rate at which a deployment meets its SLO (Vidur-Search's question): a bisection over the
rate between nothing and what the engines sustain when full, each probe priced at the point's depth.

The steady state's latencies rise with the rate, so one crossing bounds the search; an event simulation's
percentiles are noisy near the crossing, and the bisection keeps the highest rate that was seen to meet the SLO.
"""

from collections.abc import Callable

from dse.errors import InfeasibleError
from dse.serving.spec import meets

RELATIVE_TOLERANCE = 0.01
"""The search stops when the bracket is within 1% of the rate: below the noise of any measured serving figure."""
MAX_PROBES = 20


def highest_rate(meets: Callable[[float], bool], ceiling: float, slo: dict[str, float]) -> float:
    """The highest rate in (0, ceiling) for which `meets` holds, within RELATIVE_TOLERANCE; an InfeasibleError
    naming the SLO if even a trickle (a thousandth of the ceiling) misses it."""
    low, high = ceiling / 1000, ceiling * (1 - RELATIVE_TOLERANCE / 2)
    if not meets(low):
        bounds = ", ".join(f"{name} <= {bound:g}" for name, bound in slo.items())
        raise InfeasibleError(
            f"no request rate meets serving.slo ({bounds}): one request at a time already misses it; relax the "
            "SLO or give the deployment faster or more GPUs per instance"
        )
    if meets(high):
        return high
    for _ in range(MAX_PROBES):
        if high - low <= RELATIVE_TOLERANCE * low:
            break
        rate = (low + high) / 2
        low, high = (rate, high) if meets(rate) else (low, rate)
    return low


def at_highest_rate(
    measure: Callable[[float], dict[str, float]], ceiling: float, slo: dict[str, float]
) -> dict[str, float]:
    """The serving metrics (`measure` at a rate) at the highest rate below `ceiling` that meets the SLO, with that
    rate as max_rate_per_s."""
    rate = highest_rate(lambda r: _meets(measure, r, slo), ceiling, slo)
    return measure(rate) | {"max_rate_per_s": rate}


def _meets(measure: Callable[[float], dict[str, float]], rate: float, slo: dict[str, float]) -> bool:
    try:
        found = measure(rate)
    except InfeasibleError:  # beyond what the engines sustain
        return False
    return meets(found, slo)
