"""The cost and energy objectives and the budget and power constraints (objectives/cost.py, objectives/energy.py,
dse/economics.py), each pinned by its closed form worked by hand."""

from types import SimpleNamespace

import pytest
from helpers import make_point

from dse.economics import EconomicsSpec, LinkHardware
from dse.errors import SpecError
from dse.interfaces import ClassResult, SimResult
from dse.ownership import SECONDS_PER_YEAR, dragonfly, fat_tree
from dse.point.evaluate import metrics_of
from dse.search.space import load_study
from dse.serving.deployment import ServingResult
from objectives import cost, energy

SWITCH = {"nic_price_usd": 2000, "switch_price_usd": 25000, "switch_ports": 64, "cable_price_usd": 500}
"""NICs at $2,000, a 64-port switch at $25,000 and cables at $500."""
NODE = {
    "base": "tiny-ring",
    "accelerator": {"price_usd": 30000},  # tdp_W 700 from the H100
    "network": [
        {
            "topology": "switch",
            "npus": 8,
            "bandwidth_GBps": 100,
            "latency_ns": 1000,
            "hardware": {**SWITCH, "nic_power_W": 20, "switch_power_W": 1000},
        }
    ],
}
"""8 GPUs at $30,000 on one switch: $240,000 + 8 x $2,000 + $25,000 + 8 cables x $500 = $285,000."""
TERMS = {"lifetime_years": 4, "utilization": 0.8, "idle_power_share": 0.25, "pue": 1.5}


def _point(terms: dict | None = None, system: dict = NODE):
    return make_point(system=system, dp=8, overrides={"economics": {**TERMS, **(terms or {})}})


def _result(step_s: float, compute_s: float) -> SimResult:
    ranks = ClassResult("all", 8, step_s, compute_s, 0.0, 0.0, 1.0, {}, {})
    return SimResult(step_time_s=step_s, classes=[ranks])


def make_workload(point) -> SimpleNamespace:
    """A stand-in for the generated workload: the metrics read its tokens and model FLOPs only."""
    return SimpleNamespace(tokens=point.workload.global_batch * point.workload.seq_len, model_flops=1.0)


def test_capital_is_accelerators_nics_switch_and_cables_amortised_over_paid_seconds():
    point = _point({"electricity_usd_per_kWh": 0.0})
    per_second = 285_000 / (4 * 0.8 * 365.25 * 86400)  # $ per second of paid work
    metrics, _ = metrics_of(point, make_workload(point), _result(step_s=2.0, compute_s=1.0))
    assert metrics["capital_usd"] == 285_000
    assert metrics["cost_per_step_usd"] == pytest.approx(2.0 * per_second, rel=1e-12)
    tokens = 8 * 256  # global_batch x seq_len per step
    assert metrics["cost_per_million_tokens_usd"] == pytest.approx(2.0 * per_second / tokens * 1e6, rel=1e-12)
    assert metrics["tokens_per_dollar"] == pytest.approx(tokens / (2.0 * per_second), rel=1e-12)
    assert SECONDS_PER_YEAR == 31_557_600


def test_energy_per_step_counts_idle_share_busy_share_network_and_pue():
    point = _point({"electricity_usd_per_kWh": 0.12})
    # Busy half the step: each GPU draws 0.25 x 700 + 0.75 x 700 x 0.5 = 437.5 W; 8 of them 3,500 W, 8 NICs 160 W,
    # the switch 1,000 W: 4,660 W x PUE 1.5 = 6,990 W for 2 s.
    metrics, _ = metrics_of(point, make_workload(point), _result(step_s=2.0, compute_s=1.0))
    assert metrics["energy_per_step_J"] == pytest.approx(13_980.0, rel=1e-12)
    assert metrics["energy_per_token_J"] == pytest.approx(13_980.0 / 2048, rel=1e-12)
    assert metrics["tokens_per_joule"] == pytest.approx(2048 / 13_980.0, rel=1e-12)
    # Busy all the time: (8 x 700 + 160 + 1000) x 1.5 = 10,140 W.
    assert metrics["facility_power_kW"] == pytest.approx(10.14, rel=1e-12)
    capital = 2.0 * 285_000 / (4 * 0.8 * SECONDS_PER_YEAR)
    electricity = 13_980.0 / 3.6e6 * 0.12
    assert metrics["cost_per_step_usd"] == pytest.approx(capital + electricity, rel=1e-12)


@pytest.mark.parametrize(
    ("npus", "ports", "leaf_npus", "oversubscription", "switches", "cables"),
    [
        (8, 64, None, 1.0, 1, 8),  # one switch
        (64, 64, None, 1.0, 1, 64),
        (128, 64, None, 1.0, 4 + 2, 256),  # two tiers: 128 / 32 leaves, 128 uplinks / 64 spines
        (2048, 64, None, 1.0, 64 + 32, 4096),  # a full two-tier tree: 3k/2
        (65536, 64, None, 1.0, 2048 + 2048 + 1024, 3 * 65536),  # a full three-tier tree: 5k^2/4
        (2049, 64, None, 1.0, 65 + 65 + 33, 3 * 2049),  # one past two tiers
        (96, 64, 48, 3.0, 2 + 1, 96 + 32),  # 3:1, 48 down and 16 up per leaf: 2 leaves, 32 uplinks on one spine
    ],
)
def test_fat_tree_switch_count_rule(npus, ports, leaf_npus, oversubscription, switches, cables):
    assert fat_tree(npus, ports, leaf_npus, oversubscription) == (switches, cables)


def test_dragonfly_routers_and_cables():
    # 4 groups of 16 NPUs on 16-port routers (8 NPUs each): 2 routers a group, 1 local cable, 6 global cables.
    assert dragonfly(64, 16, 16) == (8, 64 + 4 * 1 + 6)


def test_each_copy_of_a_dimension_is_built_apart_and_direct_links_have_no_switch():
    system = {
        "base": "tiny-ring",
        "accelerator": {"price_usd": 0},
        "network": {  # 4 rings of 4 ($10 cables, 4 each), two copies of a 2-NPU switch dimension (one switch each)
            0: {"hardware": {"cable_price_usd": 10}},
            1: {"hardware": {"switch_price_usd": 1000, "switch_ports": 4, "cable_price_usd": 1}},
        },
    }
    point = make_point(system=system, dp=8)
    assert cost._capital(point, None, None) == 2 * 4 * 10 + 4 * (1000 + 2 * 1)


def test_serving_cost_and_energy_per_million_output_tokens():
    point = _point({"electricity_usd_per_kWh": 0.1})
    result = ServingResult(step_time_s=0.02, classes=[_result(0.02, 0.01).classes[0]], serving={"tokens_per_s": 5000})
    power = (8 * 700 * (0.25 + 0.75 * 0.5) + 160 + 1000) * 1.5  # W, busy half the decode iteration
    per_second = 285_000 / (4 * 0.8 * SECONDS_PER_YEAR) + power / 3.6e6 * 0.1
    assert cost._cost_per_million_tokens(point, None, result) == pytest.approx(per_second / 5000 * 1e6, rel=1e-12)
    assert energy._energy_per_token(point, None, result) == pytest.approx(power / 5000, rel=1e-12)


def test_budget_and_power_constraints_are_met_at_or_under_their_limit():
    result = _result(1.0, 1.0)
    over = _point({"budget_usd": 284_999, "power_limit_kW": 10.0})
    under = _point({"budget_usd": 285_000, "power_limit_kW": 10.14})
    assert cost.within_budget.fn(over, None, result) == 1.0
    assert cost.within_budget.fn(under, None, result) == 0.0
    assert energy.within_power.fn(over, None, result) == pytest.approx(0.14)
    assert energy.within_power.fn(under, None, result) <= 0
    unlimited = _point()  # held to no budget or limit: no value, and a study that lists them without one is refused
    assert (
        cost.within_budget.fn(unlimited, None, result) is None
        and energy.within_power.fn(unlimited, None, result) is None
    )
    assert "economics.budget_usd, which is unset" in cost.within_budget.needs(unlimited)
    assert "economics.power_limit_kW, which is unset" in energy.within_power.needs(unlimited)


def test_an_accelerator_without_price_has_no_cost_and_a_study_optimising_it_is_refused(tmp_path):
    point = make_point(dp=8, overrides={"system.accelerator.price_usd": None})  # a TDP but no price
    metrics, _ = metrics_of(point, make_workload(point), _result(1.0, 0.5))
    assert "tokens_per_dollar" not in metrics and "capital_usd" not in metrics
    assert metrics["energy_per_step_J"] > 0
    study = tmp_path / "study.yaml"
    study.write_text(
        "name: t\nobjectives: {tokens_per_dollar: }\ntrials: 2\nworkers: 1\nbase:\n  model: tiny-llama\n"
        "  workload: {seq_len: 512, global_batch: 16}\n"
        "  system: {base: tiny-ring, accelerator: {price_usd: null}}\nspace:\n  parallel.tp: {choices: [1, 2]}\n"
        "derived:\n  parallel.dp: world / parallel.tp\n"
    )
    with pytest.raises(SpecError) as error:
        load_study(study)
    assert str(error.value) == (
        f"{study}: field 'objectives.tokens_per_dollar': accelerator 'h100-sxm' has no price_usd, so the point has "
        "no cost; set system.accelerator.price_usd (its list price with its share of the server, and its source) or "
        "use an accelerator of the catalog that has it"
    )


def test_economics_left_at_its_default_keeps_the_point_key():
    plain, default = make_point(dp=8), make_point(dp=8, overrides={"economics": EconomicsSpec().model_dump()})
    assert plain.key == default.key and "economics" not in plain.model_dump()
    assert _point().key != make_point(system=NODE, dp=8).key
    assert LinkHardware().switch_ports is None


def test_each_point_reads_its_own_systems_capital():
    """capital_usd and network_power_W keep the last system's value (several metrics of a point read them): points
    taken in turn still get their own."""
    cheap, dear = _point(), make_point(system={**NODE, "accelerator": {"price_usd": 40000}}, dp=8)
    for point, capital in [(cheap, 285_000), (dear, 365_000)] * 2:
        assert cost._capital(point, None, None) == capital
