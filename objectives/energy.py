"""Energy objectives and the power constraint, from the accelerators' TDP, how busy the step keeps them, and the
network's ports and switches (`dse.ownership`), under the point's `economics` terms.

The rule: each accelerator draws idle_power_share x tdp_W all the time and the rest of its TDP for the share of
the step its compute stream is busy (SimResult.compute_time_s, the mean over ranks, over step_time_s); every NIC
and switch draws its power for the whole step; the sum is multiplied by pue. A step's energy is that power times
step_time_s; a token's is it over the tokens per second: a training step's tokens, a serving point's output
tokens (its tokens_per_s; its busy share is its typical decode iteration's). facility_power_kW is the draw with
every accelerator busy, what the power limit (economics.power_limit_kW) is held against. A point whose
accelerator has no tdp_W has none of these metrics.
"""

from dse import ownership
from dse.interfaces import SimResult
from dse.objective import Constraint, Objective
from dse.serving.deployment import ServingResult
from dse.spec import DesignPoint
from dse.workload import Workload


def needs_tdp(point: DesignPoint) -> str | None:
    """Why the point has no energy metrics, or None."""
    accelerator = point.system.accelerator
    if accelerator.tdp_W is not None:
        return None
    return (
        f"accelerator '{accelerator.name}' has no tdp_W, so the point draws no known power; set "
        "system.accelerator.tdp_W (its board power, with its source) or use an accelerator of the catalog that has it"
    )


def busy_share(result: SimResult) -> float:
    """The share of the step the accelerators compute: their compute stream's busy time over the step."""
    return min(1.0, result.compute_time_s / result.step_time_s) if result.step_time_s > 0 else 0.0


def tokens_per_s(workload: Workload, result: SimResult) -> float:
    """The tokens a second of the point's work gives: a training (or prefill, decode) step's over its time, a
    serving point's output tokens."""
    if isinstance(result, ServingResult):
        return result.serving["tokens_per_s"]
    return workload.tokens / result.step_time_s


def average_power_W(point: DesignPoint, result: SimResult) -> float | None:
    """The facility's mean draw over the step (the module's rule), or None without tdp_W."""
    return ownership.power_W(point.system, point.economics, busy_share(result))


def _energy_per_step(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    power = average_power_W(point, result)
    return None if power is None else power * result.step_time_s


def _energy_per_token(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    power, rate = average_power_W(point, result), tokens_per_s(workload, result)
    return None if power is None or rate == 0 else power / rate


def _tokens_per_joule(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    power = average_power_W(point, result)
    return None if power is None else tokens_per_s(workload, result) / power


def _facility_power(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    power = ownership.power_W(point.system, point.economics, busy=1.0)
    return None if power is None else power / 1e3


def _needs_tdp_under_limit(point: DesignPoint) -> str | None:
    if point.economics.power_limit_kW is None:
        return "within_power holds the facility power to economics.power_limit_kW, which is unset; set it"
    return needs_tdp(point)


def _power_excess(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    """facility_power_kW - economics.power_limit_kW (<= 0: within it); no value for a point without a limit."""
    limit = point.economics.power_limit_kW
    if limit is None:
        return None
    power = _facility_power(point, workload, result)
    return None if power is None else power - limit


energy_per_step_J = Objective(
    "energy_per_step_J", "energy_per_step_J", "minimize", "J", _energy_per_step, needs=needs_tdp
)
energy_per_token_J = Objective(
    "energy_per_token_J", "energy_per_token_J", "minimize", "J", _energy_per_token, needs=needs_tdp
)
tokens_per_joule = Objective(
    "tokens_per_joule", "tokens_per_joule", "maximize", "tokens/J", _tokens_per_joule, needs=needs_tdp
)
facility_power_kW = Objective(
    "facility_power_kW", "facility_power_kW", "minimize", "kW", _facility_power, needs=needs_tdp
)
within_power = Constraint("within_power", "power_excess_kW", "kW", _power_excess, needs=_needs_tdp_under_limit)
