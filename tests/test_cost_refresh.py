"""The online refresh of the cost model (``selection/cost_refresh.py``): pure NumPy, synthetic cycles."""

import numpy as np
import pytest

from specfit.selection.cost_model import CostModel
from specfit.selection.cost_refresh import CostRefresh

LINK = 1e-3  # the link's own time per copy (an emulated link: load does not change it)
PROFILE = CostModel((0.080, 0.083, 0.087, 0.088, 0.089, 0.090, 0.092, 0.092), 3.5e-5,
                    draft_level_seconds=(0.003, 0.0023, 0.0024, 0.0025, 0.0026), copy_overhead=2e-5,
                    link_share=1.0).priced(LINK)


def machine(slowdown: float):
    """The true cycle time of a machine whose host is ``slowdown`` x the profile's (the link's time unchanged)."""
    def seconds(n, demand, misses, levels):
        link = PROFILE.link_share * LINK * misses
        return slowdown * (PROFILE.predict(n, demand, levels=levels, misses=misses) - link) + link
    return seconds


def cycles(rng, count):
    """Cycles as SpecFit runs them: 1-6 nodes, 1-4 levels (the stop rule), sometimes a skipped one."""
    for _ in range(count):
        if rng.random() < 0.15:
            yield 0, int(rng.integers(150, 200)), int(rng.integers(0, 40)), 0
            continue
        n = int(rng.integers(1, 7))
        yield n, int(rng.integers(200, 200 + 90 * n)), int(rng.integers(0, 25 + 10 * n)), min(n, 4)


def forecast_over_real(model, truth, rng, count=40):
    predicted = real = 0.0
    for n, demand, misses, levels in cycles(rng, count):
        predicted += model.predict(n, demand, levels=levels, misses=misses)
        real += truth(n, demand, misses, levels)
    return predicted / real


def feed(refresh, truth, rng, count, noise=0.05):
    for n, demand, misses, levels in cycles(rng, count):
        seconds = truth(n, demand, misses, levels) * (1 + noise * rng.standard_normal())
        refresh.record(n, demand, misses, levels, seconds)


def test_a_machine_slower_than_the_profile_is_forecast_within_ten_percent_after_30_cycles():
    """The reference profile of another machine forecasts 1/1.6 of this one's clock; 30 refreshed cycles bring the
    forecast within +-10% (the issue's goal), also at node counts and levels the records never reached."""
    rng, truth = np.random.default_rng(0), machine(1.6)
    assert forecast_over_real(PROFILE, truth, rng) < 0.7  # the profile alone: far off
    refresh = CostRefresh(PROFILE, LINK, depth=5)
    feed(refresh, truth, rng, 30)
    assert refresh.cycles == 30 and refresh.model is not PROFILE
    assert 0.9 < forecast_over_real(refresh.model, truth, rng) < 1.1
    m = refresh.model
    assert 0.9 < m.predict(7, 700, levels=5, misses=60) / truth(7, 700, 60, 5) < 1.1  # never seen: 7 nodes, 5 levels
    # level 5 was never drafted: its price follows the host's measured slowdown, not the profile's machine
    assert m.draft_level_seconds[4] == pytest.approx(1.6 * PROFILE.draft_level_seconds[4], rel=0.2)
    assert m.copy == pytest.approx(m.copy_overhead + m.link_share * LINK)  # priced at the link it learned on


def test_a_change_of_load_is_followed_within_30_cycles():
    rng = np.random.default_rng(1)
    refresh = CostRefresh(PROFILE, LINK, depth=5)
    feed(refresh, machine(1.0), rng, 60)
    assert 0.95 < forecast_over_real(refresh.model, machine(1.0), rng) < 1.05
    feed(refresh, machine(1.5), rng, 30)  # another process now shares the core
    assert 0.9 < forecast_over_real(refresh.model, machine(1.5), rng) < 1.1


def test_the_profiles_constraints_hold_whatever_the_records_say():
    """Records in which more nodes take *less* time: intercepts stay non-decreasing, every coefficient >= 0, the
    drafting of the levels inside every intercept."""
    rng = np.random.default_rng(2)
    refresh = CostRefresh(PROFILE, LINK, depth=5, every=1)
    for n, demand, misses, levels in cycles(rng, 40):
        refresh.record(n, demand, misses, levels, 0.2 - 0.02 * n)
    m = refresh.model
    assert m.monotone and min(m.intercepts) >= sum(m.draft_level_seconds)
    assert min(m.draft_level_seconds) >= 0 and m.beta >= 0 and m.copy_overhead >= 0 and m.link_share >= 0
    assert m.meta["refresh_cycles"] == 40


def test_it_refits_every_few_cycles_and_ignores_cycles_without_a_clock():
    refresh = CostRefresh(PROFILE, LINK, depth=5, every=4)
    assert [refresh.record(2, 300, 10, 2, 0.1) for _ in range(4)] == [False, False, False, True]
    assert refresh.record(2, 300, 10, 2, float("nan")) is False and refresh.cycles == 4


def test_a_profile_without_copies_or_drafting_levels_is_refused_with_the_remedy():
    with pytest.raises(ValueError, match="needs a version-3 profile.*specfit calibrate"):
        CostRefresh(CostModel((0.1, 0.11), 1e-4), LINK, depth=5)
    with pytest.raises(ValueError, match="decay must be in"):
        CostRefresh(PROFILE, LINK, depth=5, decay=0.0)


def test_a_cold_expert_is_refreshed_along_the_path_the_selector_prices_it_by():
    """Under cold="auto" with a host lane cheaper than a copy, the selector prices a cold expert at the host's time:
    the refresh starts from that price (the lane's seconds and the host's fitted parts), so its first refits keep
    it, not the copy's (issue 36 and 38 together)."""
    from types import SimpleNamespace

    from specfit.decoding.assistants import miss_path
    from specfit.selection.cost_refresh import CostRefresh, EVERY

    profile = CostModel((0.10, 0.11, 0.12), 1e-4, draft_level_seconds=(0.01, 0.01), copy_overhead=1e-5,
                        link_share=1.0, host_overhead=2e-5, host_share=0.5)
    runtime = SimpleNamespace(copy_seconds=lambda: 1e-3, host_seconds=lambda: 4e-4)
    priced = profile.priced(1e-3, 4e-4, "auto")
    assert priced.miss == pytest.approx(2.2e-4)  # the host's 2e-5 + 0.5 x 4e-4, below the copy's 1.01e-3
    lane, parts = miss_path(runtime, priced)
    assert (lane, parts) == (4e-4, (2e-5, 0.5))
    assert miss_path(runtime, profile.priced(1e-3)) == (1e-3, (1e-5, 1.0))  # cold="copy": the link's
    refresh = CostRefresh(priced, lane, depth=2, miss_parts=parts)
    for i in range(EVERY):  # a machine as the profile says, many cold experts per cycle
        n, demand, misses = i % 3, 300 + 7 * i, 40 + 5 * i
        assert refresh.record(n, demand, misses, 2, priced.predict(n, demand, levels=2, misses=misses)) == \
            (i == EVERY - 1)
    assert refresh.model.miss == pytest.approx(2.2e-4, rel=0.1)


# issue 44, items 7-9: what the refresh moves, and what it leaves where it was -----------------------------------

def coefficients(m):
    return np.array([*m.intercepts, *m.draft_level_seconds, m.beta, m.copy])


def test_on_a_machine_exactly_as_the_profile_nothing_moves():
    """Cycles that take exactly what the profile predicts: every refit keeps the profile (the priors are its values,
    the host scale stays 1)."""
    rng = np.random.default_rng(4)
    refresh = CostRefresh(PROFILE, LINK, depth=5, every=1)
    feed(refresh, machine(1.0), rng, 60, noise=0.0)
    assert refresh.scale == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(coefficients(refresh.model), coefficients(PROFILE), rtol=0.01, atol=1e-6)


def test_after_a_change_of_load_the_terms_no_recent_cycle_reaches_move_with_the_host():
    """Cycles of at most two levels on a host now 2x slower: the price of levels 3-5 (never drafted) and the host
    scale follow the load; the link's own time per copy does not."""
    rng = np.random.default_rng(5)
    truth = machine(2.0)
    refresh = CostRefresh(PROFILE, LINK, depth=5)
    for n, demand, misses, levels in cycles(rng, 80):
        levels = min(levels, 2)
        refresh.record(n, demand, misses, levels, truth(n, demand, misses, levels))
    m = refresh.model
    assert refresh.scale == pytest.approx(2.0, rel=0.1)
    for level in (2, 3, 4):  # levels 3, 4, 5
        assert m.draft_level_seconds[level] == pytest.approx(2.0 * PROFILE.draft_level_seconds[level], rel=0.2)
    assert m.link_share == pytest.approx(PROFILE.link_share, rel=0.1)


@pytest.mark.parametrize("levels", [0, 1, 2, 4])
def test_each_drafted_level_is_charged_once(levels):
    """Cycles fed exactly as the profile predicts, of every kind SpecFit runs (root-only, 1-4 levels): the refitted
    forecasts of root-only and of 1, 2 and 4 levels stay within 3% of the profile's."""
    rng = np.random.default_rng(6)
    refresh = CostRefresh(PROFILE, LINK, depth=5)
    feed(refresh, machine(1.0), rng, 80, noise=0.0)
    n = 0 if levels == 0 else min(levels + 1, 7)
    for demand, misses in ((180, 10), (400, 30)):
        want = PROFILE.predict(n, demand, levels=levels, misses=misses)
        assert refresh.model.predict(n, demand, levels=levels, misses=misses) == pytest.approx(want, rel=0.03)


def test_within_one_call_the_refit_reprices_later_cycles():
    """A profile 20x too dear for this machine: within one generate() call the refreshed forecasts of the last
    cycles are well under the first's, and the stats count the cycles that refreshed it."""
    import torch
    from conftest import SelfDrafter, tiny_moe

    import specfit

    prompt = torch.randint(2, 256, (1, 11), generator=torch.Generator().manual_seed(11))
    # a cycle of the tiny model with this drafter takes 20-250 ms on a loaded CPU; the profile says 3-4 s
    dear = CostModel(tuple(3.0 + 0.1 * n for n in range(8)), 2e-3, draft_level_seconds=(0.1,) * 5,
                     copy_overhead=3e-3, link_share=1.0)
    model = tiny_moe()
    specfit.enable(model, cache_slots=5, drafter=SelfDrafter(model, first_token=int(prompt[0, 0]), noise=0.3),
                   cost_model=dear, guard=False)
    trace = model.specfit.stats.start_trace()
    model.generate(prompt, max_new_tokens=40, do_sample=False, assistant="specfit")
    g = model.specfit.stats.last_generate
    assert g.cost_refresh_cycles > 0 and g.cost_refresh_cycles == g.forecast_cycles == g.cycles
    first = [r.predicted_seconds for r in trace[:3]]
    last = [r.predicted_seconds for r in trace[-3:]]
    assert min(first) > 2.0 and max(last) < 0.5 * min(first)
    assert f"refreshed online by {model.specfit.cost_refresh.cycles} cycles" in model.specfit.stats.cost_profile
