"""The dominance guard (``decoding/guard.py``): pure, and in SpecFit's loop on a tiny model (lossless, counted)."""

import time

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


STARTUP = 8 + 3 + 3  # the default warm-up and the other arms' trials


@pytest.mark.parametrize("fast", ["specfit", "eagle3", "plain"])
def test_the_guard_runs_the_fastest_way_and_explores_within_its_budget(fast):
    """Each of the three ways fastest in turn, the others 30% slower: after the warm-up and trials, the slower ways
    take at most the budget (2% of the wall clock), and they are still tried again (their evidence ages)."""
    rates = {arm: 10.0 for arm in ("specfit", "eagle3", "plain")}
    rates[fast] = 13.0
    guard = Guard()
    chosen = run(guard, rates, STARTUP)
    after = run(guard, rates, 2000, seed=1)
    slower = sum(n for arm, n in after.items() if arm != fast)
    assert slower <= 0.02 * (2000 + STARTUP) and guard.explored <= 0.02 * (2000 + STARTUP)
    assert 0 < guard.explored_seconds <= 0.02 * guard.seconds
    assert slower >= 3  # it keeps checking the other ways
    assert guard.cycles == {arm: chosen[arm] + after[arm] for arm in rates}


def test_a_clearly_slower_way_is_tried_again_once_its_evidence_has_aged():
    guard = Guard(warmup=3, trials=3)
    for _ in range(3):
        guard.record("specfit", 2.0, 0.1)
    for arm in ("eagle3", "plain"):
        for _ in range(3):
            guard.record(arm, 2.0, 0.2)  # half SpecFit's rate
    picks = []
    for _ in range(600):
        arm = guard.choose()
        picks.append(arm)
        guard.record(arm, 2.0, 0.1 if arm == "specfit" else 0.2)
    first = next(i for i, arm in enumerate(picks) if arm != "specfit")
    # a way at half the rate is not retried while its three cycles weigh; it is once they have aged
    assert 50 <= first < 400
    assert sum(arm != "specfit" for arm in picks) <= 0.02 * 609


def test_the_budget_is_time_so_a_way_with_longer_cycles_explores_less_often():
    """Plain cycles fastest (1 token in 0.1 s); SpecFit's way a little slower per token but its cycles take 4x as
    long (3 tokens in 0.4 s): its exploration takes at most 2% of the wall clock, so it runs in well under 2% of
    the cycles (a budget in cycles would give it 2% of the cycles, ~7% of the time)."""
    guard = Guard(warmup=8, trials=3)
    shape = {"specfit": (3.0, 0.4), "eagle3": (3.0, 0.6), "plain": (1.0, 0.1)}
    for _ in range(3000):
        arm = guard.choose()
        tokens, seconds = shape[arm]
        guard.record(arm, tokens, seconds)
    assert guard.best() == "plain"
    assert 0 < guard.explored_seconds <= 0.02 * guard.seconds
    assert guard.cycles["specfit"] - 8 <= 0.02 * 3000 / 4 + 2  # its cycles are 4x as long


def test_the_guard_follows_a_change():
    guard = Guard(warmup=5)
    run(guard, {"specfit": 13.0, "eagle3": 10.0, "plain": 9.0}, 300)
    chosen = run(guard, {"specfit": 7.0, "eagle3": 10.0, "plain": 9.0}, 300, seed=1)  # SpecFit's way got slower
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
    with pytest.raises(ValueError, match="budget is a share"):
        Guard(budget=2)


def test_a_seeded_guard_follows_its_own_clock_within_a_few_cycles():
    """A guard seeded from one that learned over many cycles (plain decoding 3x as fast) takes at most a couple of
    cycles' worth of that evidence: a few cycles of its own where plain decoding is slow make it choose another way
    (a batch whose size changed is not the batch it was)."""
    learned = Guard(warmup=1, trials=1)
    for _ in range(60):
        for arm, rate in (("specfit", 1.0), ("eagle3", 1.0), ("plain", 3.0)):
            learned.record(arm, tokens=rate, seconds=1.0)
    assert learned.best() == "plain"
    seeded = Guard(warmup=1, trials=1).seeded(learned)
    assert all(sums[0] <= 2.0 + 1e-9 for sums in seeded.sums.values())  # two cycles' worth at most, per way
    assert seeded.best() == "plain" and seeded.rate("plain") == pytest.approx(3.0)
    for _ in range(10):
        seeded.record("plain", tokens=0.2, seconds=1.0)  # plain decoding is slow at this size
    assert seeded.best() == "specfit" and seeded.rate("plain") < 1.0


def slowed(monkeypatch, method: str, seconds: float):
    """Make one of SpecFitGenerator's ways slower by ``seconds`` per cycle."""
    from specfit.decoding import assistants
    original = getattr(assistants.SpecFitGenerator, method)

    def slow(self, *args):
        time.sleep(seconds)
        return original(self, *args)
    monkeypatch.setattr(assistants.SpecFitGenerator, method, slow)


def test_the_guard_learns_each_cycle_under_the_way_it_ran(monkeypatch):
    """In SpecFit's loop: the guard's per-way counts equal the stats' (EAGLE-3's way counted, plain cycles drafted
    nothing); with EAGLE-3's way and plain decoding made clearly slower, most cycles after the start run SpecFit's
    way."""
    slowed(monkeypatch, "_draft_as_eagle", 0.1)  # a cycle here ~0.1 s: twice as slow
    slowed(monkeypatch, "_predict_root_only", 0.1)  # runs once in every plain cycle
    model = tiny_moe()
    specfit.enable(model, cache_slots=5, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3),
                   cost_model=COST)
    runtime = model.specfit
    guard = Guard(warmup=4, trials=2)
    runtime.guard = (runtime.options, guard)
    runtime.stats.start_trace()
    model.generate(PROMPT, max_new_tokens=60, do_sample=False, assistant="specfit")
    g, trace = runtime.stats.last_generate, runtime.stats.trace
    plain = sum(r.pool == 0 for r in trace)
    assert guard.cycles == {"specfit": g.cycles - g.guard_eagle_cycles - plain, "eagle3": g.guard_eagle_cycles,
                            "plain": plain}
    assert guard.cycles["eagle3"] >= 2 and guard.cycles["plain"] >= 2  # both tried
    assert guard.cycles["specfit"] >= g.cycles - 4 - 2 - 2 - 2  # the rest: SpecFit's way, but the budget


def test_in_specfits_loop_the_guard_is_lossless_forecast_and_counted():
    """A guard that tries EAGLE-3's way early: greedy output equals plain generate(); the cycles run EAGLE-3's way
    are counted, forecast (so forecast/real stays defined) and verify EAGLE-3's tree; the others refresh the cost
    model, and the stats name the profile it started from. ``guard=False`` runs SpecFit's rule alone."""
    expected = tiny_moe().generate(PROMPT, max_new_tokens=30, do_sample=False)
    model = tiny_moe()
    specfit.enable(model, cache_slots=5, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3),
                   cost_model=COST)
    runtime = model.specfit
    runtime.guard = (runtime.options, Guard(warmup=2, spread=5.0, budget=1.0))  # explores often
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
