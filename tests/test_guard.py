"""The dominance guard (``decoding/guard.py``): pure, and in SpecFit's loop on a tiny model (lossless, counted)."""

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.decoding.guard import Guard
from specfit.selection.cost_model import CostModel

PROMPT = torch.randint(2, 256, (1, 11), generator=torch.Generator().manual_seed(11))
COST = CostModel(tuple(0.010 + 0.0005 * n for n in range(8)), 4e-5, draft_level_seconds=(0.001,) * 5,
                 copy_overhead=1.6e-4, link_share=1.0)


def run(guard: Guard, rates: dict, cycles: int, seed: int = 0) -> dict:
    """Cycles chosen by ``guard`` on arms of the given true tokens per second (each cycle: 2 tokens, noisy time)."""
    rng = np.random.default_rng(seed)
    chosen = {arm: 0 for arm in rates}
    for _ in range(cycles):
        arm = guard.choose()
        chosen[arm] += 1
        guard.record(arm, 2.0, 2.0 / rates[arm] * (1 + 0.3 * abs(rng.standard_normal())))
    return chosen


@pytest.mark.parametrize("fast", ["specfit", "eagle3"])
def test_the_guard_runs_the_faster_way_almost_always_and_still_checks_the_other(fast):
    rates = {"specfit": 10.0, "eagle3": 10.0}
    rates[fast] = 13.0
    guard = Guard(warmup=10)
    chosen = run(guard, rates, 600)
    slow = "eagle3" if fast == "specfit" else "specfit"
    assert chosen[fast] >= 0.85 * 600 - 10 and chosen[slow] >= 5  # it keeps checking the other way
    assert guard.cycles == chosen


def test_the_guard_follows_a_change():
    guard = Guard(warmup=5)
    run(guard, {"specfit": 13.0, "eagle3": 10.0}, 300)
    chosen = run(guard, {"specfit": 7.0, "eagle3": 10.0}, 300, seed=1)  # SpecFit's way got slower
    assert chosen["eagle3"] > 0.75 * 300


def test_warmup_and_bad_arguments():
    guard = Guard(warmup=3)
    assert [guard.choose() for _ in range(5)] == ["specfit"] * 5  # nothing recorded: still warming up
    for _ in range(3):
        guard.record("specfit", 2, 0.1)
    assert guard.choose() == "eagle3"  # never tried
    with pytest.raises(ValueError, match="unknown arm 'ar'"):
        guard.record("ar", 1, 0.1)
    with pytest.raises(ValueError, match="decay must be in"):
        Guard(decay=1.5)


def test_in_specfits_loop_the_guard_is_lossless_forecast_and_counted():
    """A guard that tries EAGLE-3's way early: greedy output equals plain generate(); the cycles run EAGLE-3's way
    are counted, forecast (so forecast/real stays defined) and verify EAGLE-3's tree; the others refresh the cost
    model, and the stats name the profile it started from. ``guard=False`` runs SpecFit's rule alone."""
    expected = tiny_moe().generate(PROMPT, max_new_tokens=30, do_sample=False)
    model = tiny_moe()
    specfit.enable(model, cache_slots=5, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3),
                   cost_model=COST)
    runtime = model.specfit
    runtime.guard = (runtime.options, Guard(warmup=2, spread=5.0))  # explores EAGLE-3's way often
    runtime.stats.start_trace()
    assert torch.equal(model.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant="specfit"), expected)
    g = runtime.stats.last_generate
    eagle_way = g.guard_eagle_cycles
    assert 0 < eagle_way < g.cycles and g.cost_refresh_cycles == g.cycles - eagle_way
    assert g.forecast_cycles == g.cycles and g.forecast_over_real is not None
    assert any(r.n_nodes == 7 and r.pool == 18 for r in runtime.stats.trace)  # EAGLE-3's tree of its full pool
    assert "given to enable/configure" in runtime.stats.cost_profile
    assert "refreshed online by" in runtime.stats.cost_profile and "cost profile" in repr(runtime.stats)
    specfit.configure(model, guard=False, cost_refresh=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant="specfit"), expected)
    g = runtime.stats.last_generate
    assert g.guard_eagle_cycles == 0 and g.cost_refresh_cycles == 0
    assert runtime.stats.cost_profile.endswith("frozen (no online refresh)")
