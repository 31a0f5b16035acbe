"""What a point's system costs to buy and draws to run: closed forms over the prices and powers of its hardware and
the owner's terms (dse/economics.py), read by the cost and energy objectives (objectives/cost.py, energy.py)."""

from collections.abc import Callable
from functools import wraps
from math import ceil
from typing import TypeVar

from dse.economics import EconomicsSpec
from dse.network import NetworkDim
from dse.system import SystemSpec

SECONDS_PER_YEAR = 365.25 * 24 * 3600
JOULES_PER_KWH = 3.6e6
DIRECT_PORTS = {"ring": 2, "torus2d": 4, "torus3d": 6, "hybrid_cube_mesh": 6}
"""Ports per NPU of a switchless topology (fully_connected: npus - 1; DGX-1's cube-mesh: six NVLinks), each cabled
to one peer's."""


def fat_tree(npus: int, ports: int, leaf_npus: int | None = None, oversubscription: float = 1.0) -> tuple[int, int]:
    """(switches, cables) of the smallest folded-Clos fat-tree of `ports`-port switches that connects `npus` NPUs.

    The count rule: NPUs that fit one leaf take one switch. A leaf holds leaf_npus NPUs (unset: half its ports,
    non-blocking, and `ports` when they all fit one switch); the tiers above are a non-blocking tree for the
    m = ceil(npus / oversubscription) links that leave the leaves, and t tiers reach leaf x ports x (ports / 2)^(t - 2)
    NPUs: t is the fewest that reach npus. Switches: ceil(npus / leaf) leaves, ceil(2m / ports) in each of the t - 2
    middle tiers and ceil(m / ports) at the top; cables: npus into the leaves and m between each pair of tiers
    above. Non-blocking, that is (t - 1) ceil(2 npus / ports) + ceil(npus / ports) switches: 3k/2 for k^2/2 NPUs in
    two tiers and 5k^2/4 for k^3/4 in three, the textbook k-ary fat-tree's."""
    leaf = leaf_npus or (ports if npus <= ports else ports // 2)
    if npus <= leaf:
        return 1, npus
    up = ceil(npus / oversubscription)
    tiers = 2
    while leaf * ports * (ports // 2) ** (tiers - 2) < npus:
        tiers += 1
    switches = ceil(npus / leaf) + (tiers - 2) * ceil(2 * up / ports) + ceil(up / ports)
    return switches, npus + (tiers - 1) * up


def dragonfly(npus: int, group_npus: int, ports: int) -> tuple[int, int]:
    """(routers, cables) of a dragonfly: each group's NPUs on routers that give half their ports to NPUs, the
    a = ceil(group_npus / (ports / 2)) routers of a group wired all-to-all (a(a - 1) / 2 local cables), one global
    cable between each pair of the g groups, and each NPU's cable to its router."""
    routers, groups = ceil(group_npus / (ports // 2)), ceil(npus / group_npus)
    return groups * routers, npus + groups * routers * (routers - 1) // 2 + groups * (groups - 1) // 2


T = TypeVar("T")


def _kept_for_last_system(fn: Callable[[SystemSpec], T]) -> Callable[[SystemSpec], T]:
    """fn, keeping its value for the last system it was given: a point's cost and energy metrics each ask it of the
    same system (its capital and network power about four times a point). A system is frozen, so one object has one
    value; the entry is one tuple, read and replaced whole, so that a thread never pairs a system with another's."""
    last: tuple[SystemSpec, T] | None = None

    @wraps(fn)
    def kept(system: SystemSpec) -> T:
        nonlocal last
        entry = last
        if entry is None or entry[0] is not system:
            entry = last = (system, fn(system))
        return entry[1]

    return kept


def dimension_parts(dim: NetworkDim, npus: int) -> tuple[int, int]:
    """(switches, cables) of one network dimension over a system of `npus` NPUs: npus / dim.npus copies of it
    (one per combination of the other dimensions' positions, as a rail-optimised fabric builds a rail apart), each
    a fat-tree (`fat_tree`, with the dimension's leaf_npus and oversubscription) or a dragonfly (`dragonfly`) when
    it has switches, else its NPUs' ports cabled pairwise (DIRECT_PORTS); a dimension of one NPU has neither."""
    hardware = dim.hardware
    copies = npus // dim.npus
    if dim.npus == 1:  # links nothing
        return 0, 0
    if hardware is not None and hardware.switch_ports is not None:
        if dim.topology == "dragonfly":
            assert dim.group_npus is not None  # NetworkDim's validator
            switches, cables = dragonfly(dim.npus, dim.group_npus, hardware.switch_ports)
        else:
            switches, cables = fat_tree(dim.npus, hardware.switch_ports, dim.leaf_npus, dim.oversubscription or 1.0)
        return copies * switches, copies * cables
    ports = dim.npus - 1 if dim.topology == "fully_connected" else DIRECT_PORTS.get(dim.topology, 1)
    return 0, copies * ceil(dim.npus * ports / 2)


@_kept_for_last_system
def capital_usd(system: SystemSpec) -> float | None:
    """What the system costs to buy: its accelerators (price_usd each, with their share of the server), and per
    network dimension its NICs (one per NPU), switches and cables (`dimension_parts`). None: the accelerator has no
    price."""
    price = system.accelerator.price_usd
    if price is None:
        return None
    total = price * system.npus
    for dim in system.network:
        if dim.hardware is not None:
            switches, cables = dimension_parts(dim, system.npus)
            hw = dim.hardware
            total += hw.nic_price_usd * system.npus + hw.switch_price_usd * switches + hw.cable_price_usd * cables
    return total


@_kept_for_last_system
def network_power_W(system: SystemSpec) -> float:
    """What the system's NICs and switches draw, all the time: a port draws about the same idle or busy."""
    total = 0.0
    for dim in system.network:
        if dim.hardware is not None:
            switches, _ = dimension_parts(dim, system.npus)
            total += dim.hardware.nic_power_W * system.npus + dim.hardware.switch_power_W * switches
    return total


def power_W(system: SystemSpec, economics: EconomicsSpec, busy: float) -> float | None:
    """The facility's draw while the accelerators compute `busy` of the time: each accelerator idle_power_share x
    tdp_W, plus the rest of its TDP x busy; the network (`network_power_W`); all x pue. None: no tdp_W."""
    tdp = system.accelerator.tdp_W
    if tdp is None:
        return None
    idle = economics.idle_power_share
    accelerators = system.npus * tdp * (idle + (1 - idle) * busy)
    return (accelerators + network_power_W(system)) * economics.pue


def capital_usd_per_s(capital: float, economics: EconomicsSpec) -> float:
    """The capital amortised over the seconds of paid work in the lifetime: lifetime_years x utilization x a year
    (365.25 days). A second of work carries the idle time around it."""
    return capital / (economics.lifetime_years * economics.utilization * SECONDS_PER_YEAR)


def energy_usd(joules: float, economics: EconomicsSpec) -> float:
    """What `joules` drawn from the grid cost at electricity_usd_per_kWh."""
    return joules / JOULES_PER_KWH * economics.electricity_usd_per_kWh
