"""Cost objectives and the budget constraint: the capital of a point's system (`dse.ownership.capital_usd`:
accelerators, NICs, switches, cables), amortised over the point's `economics` terms, plus the electricity its
energy costs (objectives/energy.py).

A second of paid work costs capital / (lifetime_years x utilization x a year) plus the facility's mean draw
(energy.average_power_W) x electricity_usd_per_kWh; a step costs its seconds of that, a million tokens a million
over the tokens per second (energy.tokens_per_s: a training step's tokens, a serving point's output tokens). A
point whose accelerator has no price_usd (or, with an electricity price, no tdp_W) has none of these metrics.
"""

from dse import ownership
from dse.interfaces import SimResult
from dse.objective import Constraint, Objective
from dse.spec import DesignPoint
from dse.workload import Workload
from objectives.energy import average_power_W, needs_tdp, tokens_per_s


def _needs_price(point: DesignPoint) -> str | None:
    accelerator = point.system.accelerator
    if accelerator.price_usd is not None:
        return None
    return (
        f"accelerator '{accelerator.name}' has no price_usd, so the point has no cost; set "
        "system.accelerator.price_usd (its list price with its share of the server, and its source) or use an "
        "accelerator of the catalog that has it"
    )


def _needs_price_and_power(point: DesignPoint) -> str | None:
    """The price, and the TDP where electricity costs something."""
    return _needs_price(point) or (needs_tdp(point) if point.economics.electricity_usd_per_kWh > 0 else None)


def cost_per_s(point: DesignPoint, result: SimResult) -> float | None:
    """Dollars per second of paid work: the amortised capital and the electricity (the module's rule)."""
    capital = ownership.capital_usd(point.system)
    if capital is None:
        return None
    terms = point.economics
    energy = 0.0
    if terms.electricity_usd_per_kWh > 0:
        power = average_power_W(point, result)
        if power is None:
            return None
        energy = ownership.energy_usd(power, terms)
    return ownership.capital_usd_per_s(capital, terms) + energy


def _capital(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    return ownership.capital_usd(point.system)


def _cost_per_step(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    cost = cost_per_s(point, result)
    return None if cost is None else cost * result.step_time_s


def _cost_per_million_tokens(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    cost, rate = cost_per_s(point, result), tokens_per_s(workload, result)
    return None if cost is None or rate == 0 else cost / rate * 1e6


def _tokens_per_dollar(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    cost = cost_per_s(point, result)
    return None if not cost else tokens_per_s(workload, result) / cost


def _needs_price_under_budget(point: DesignPoint) -> str | None:
    if point.economics.budget_usd is None:
        return "within_budget holds the capital to economics.budget_usd, which is unset; set it (in base or space)"
    return _needs_price(point)


def _budget_excess(point: DesignPoint, workload: Workload, result: SimResult) -> float | None:
    """capital_usd - economics.budget_usd (<= 0: within it); no value for a point without a budget (it is held to
    none, as a training point to no SLO)."""
    budget = point.economics.budget_usd
    if budget is None:
        return None
    capital = ownership.capital_usd(point.system)
    return None if capital is None else capital - budget


capital_usd = Objective("capital_usd", "capital_usd", "minimize", "$", _capital, needs=_needs_price)
cost_per_step_usd = Objective(
    "cost_per_step_usd", "cost_per_step_usd", "minimize", "$", _cost_per_step, needs=_needs_price_and_power
)
cost_per_million_tokens_usd = Objective(
    "cost_per_million_tokens_usd",
    "cost_per_million_tokens_usd",
    "minimize",
    "$",
    _cost_per_million_tokens,
    needs=_needs_price_and_power,
)
tokens_per_dollar = Objective(
    "tokens_per_dollar", "tokens_per_dollar", "maximize", "tokens/$", _tokens_per_dollar, needs=_needs_price_and_power
)
within_budget = Constraint("within_budget", "budget_excess_usd", "$", _budget_excess, needs=_needs_price_under_budget)
