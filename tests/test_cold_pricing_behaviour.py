"""The selector's price of a cold expert by behaviour (issue 44, item 12): under ``cold="host"``/``"auto"`` the cost
model SpecFit resolves prices a cold expert at the host lane where the lane is cheaper than a copy, and so SpecFit
verifies more draft nodes per cycle than under ``"copy"`` on the same model, drafter and prompt."""

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.offload.host_lane import HostConfig
from specfit.selection.cost_model import CostModel
from specfit.selection.profiles import resolve_cost_model

PROMPT = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(12))
LINK = 1e-4  # seconds per expert copy
LANE = HostConfig(bandwidth=2e9)  # ~12 us per tiny expert: cheaper than a copy
# copies dear against the cycle's intercepts (a cold expert's copy ~ a fifth of a cycle), the lane cheap
COST = CostModel(intercepts=(1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12, 1.14), beta=0.002, copy_overhead=0.2,
                 link_share=1.0, host_overhead=0.002, host_share=0.5)


def enabled(cold):
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, link=LINK, host=LANE, cold=cold, cost_model=COST,
                   drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3))
    specfit.configure(model, cost_refresh=False, guard=False, route_source="oracle")  # true routes; the prices decide
    return model


def test_the_resolved_cost_model_prices_a_cold_expert_at_the_cheaper_lane():
    copy = COST.copy_overhead + LINK
    for cold in ("copy", "host", "auto"):
        model = enabled(cold)
        lane = LANE.expert_time(model.specfit.store.expert_bytes)
        host = COST.host_overhead + COST.host_share * lane
        assert host < copy / 10
        resolved = resolve_cost_model(model)
        assert resolved.miss == pytest.approx(copy if cold == "copy" else host, rel=1e-12), cold
        assert resolved.predict(1, 40, misses=3) == pytest.approx(1.02 + 40 * 0.002 + 3 * resolved.miss), cold


def test_specfit_verifies_more_nodes_per_cycle_where_a_cold_expert_costs_the_lane():
    verified = {}
    expected = tiny_moe().generate(PROMPT, max_new_tokens=16, do_sample=False)
    for cold in ("copy", "auto", "host"):
        model = enabled(cold)
        out = model.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant="specfit")
        assert torch.equal(out, expected), cold
        c = model.specfit.stats.last_generate
        verified[cold] = c.nodes_verified / c.cycles
    assert verified["auto"] > 1.5 * verified["copy"] and verified["host"] > 1.5 * verified["copy"], verified


def test_host_prices_the_lane_even_where_a_copy_is_cheaper():
    """cold="host" computes every cold expert on the lane, so its price is the lane's even where a copy would be
    cheaper; "auto" takes the cheaper of the two, there the copy."""
    cheap_copies = CostModel(COST.intercepts, COST.beta, copy_overhead=0.0, link_share=1.0, host_overhead=0.002,
                             host_share=0.5)
    for cold in ("host", "auto"):
        model = tiny_moe()
        specfit.enable(model, cache_slots=4, link=LINK, host=LANE, cold=cold, cost_model=cheap_copies)
        host = 0.002 + 0.5 * LANE.expert_time(model.specfit.store.expert_bytes)
        assert LINK < host
        assert resolve_cost_model(model).miss == pytest.approx(host if cold == "host" else LINK, rel=1e-12), cold
