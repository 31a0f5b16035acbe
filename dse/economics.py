"""What hardware costs and draws, and the owner's terms it is judged under: the inputs of the cost and energy
objectives (objectives/cost.py, objectives/energy.py) and of the budget and power constraints.

Prices and powers belong to the hardware (an accelerator's `price_usd` and `tdp_W`, a network dimension's
`hardware`), each with its source in the catalog; the terms (lifetime, utilisation, electricity, budget) belong to
the design point (`economics`), as a planner states them. The closed forms over them are dse/ownership.py's.
"""

from typing import Annotated

from annotated_types import Ge, Gt, Le
from pydantic import Field

from dse.fields import Share, Spec, left_out_at_default
from dse.limits import MAX_RATE

Money = Annotated[float, Ge(0), Le(1e12)]
"""US dollars."""
Power = Annotated[float, Ge(0), Le(MAX_RATE)]
"""Watts."""


class LinkHardware(Spec):
    """The hardware one network dimension is built from, per NPU it connects: its NIC or port, the switches behind it
    and the cables. A dimension without it costs and draws nothing beyond its accelerators."""

    nic_price_usd: Money = Field(0.0, description="per NPU: its NIC or port in this dimension, with its optics")
    nic_power_W: Power = Field(0.0, description="per NPU: what its NIC or port and optics draw")
    switch_price_usd: Money = Field(0.0, description="per switch")
    switch_ports: Annotated[int, Ge(4), Le(1_000_000)] | None = Field(
        None,
        description="ports (radix) of one switch, at least 4 (a tree of smaller ones never grows); unset: the "
        "dimension has no switches (direct links)",
    )
    switch_power_W: Power = Field(0.0, description="per switch")
    cable_price_usd: Money = Field(0.0, description="per cable")
    sources: list[str] = Field(default_factory=list, description="where the figures come from")


class EconomicsSpec(Spec):
    """The owner's terms a point's cost and energy are judged under, and the study's budget and power limits."""

    lifetime_years: Annotated[float, Gt(0), Le(50)] = Field(4.0, description="years the capital is amortised over")
    utilization: Share = Field(1.0, description="share of the lifetime the system runs paid work")
    idle_power_share: Annotated[float, Ge(0), Le(1)] = Field(
        0.3, description="what an idle accelerator draws, as a share of its TDP"
    )
    pue: Annotated[float, Ge(1), Le(10)] = Field(1.0, description="the datacentre's power usage effectiveness")
    electricity_usd_per_kWh: Annotated[float, Ge(0), Le(100)] = Field(0.0, description="energy price")
    budget_usd: Money | None = left_out_at_default(None, description="the capital a study may spend; unset: none")
    power_limit_kW: Annotated[float, Gt(0), Le(1e9)] | None = left_out_at_default(
        None, description="the facility power a study may draw; unset: none"
    )
