"""The slot cache's policies by behaviour (issue 44, items 5-6): ``clear_cache()`` gives back a fresh cache under
every policy, read from a generate() call's hits and misses; the frequency policies stay exact past their rescale,
read from their scores and from which experts hold the slots. Each test was checked to fail with its behaviour
broken (the issue's planting table)."""

import numpy as np
import pytest
import torch
from conftest import tiny_moe

import specfit
from specfit.offload.policies import POLICIES, DecayedFrequency, FrequencyOverAge, make_policy
from specfit.offload.slots import SlotBook

PROMPT = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(4))
OTHER = torch.randint(2, 256, (1, 11), generator=torch.Generator().manual_seed(5))


def counted(model):
    """(hits, misses, streamed) of the last call, its prompt's forward included."""
    s = model.specfit.stats
    return [(c.hits, c.misses, c.streamed) for c in (s.last_prefill, s.last_generate)]


# --- item 5: clear_cache() leaves a fresh cache ---------------------------------------------------------------------
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_clear_cache_leaves_the_cache_as_a_fresh_one(policy):
    """After another call and a pending forecast (a drafted pool's, which only "forecast" reads), clear_cache(): a
    call gives the same hits and misses as the same call on a freshly enabled model (scores, recency and forecast
    all forgotten)."""
    fresh = specfit.enable(tiny_moe(), cache_slots=3, cache_policy=policy)
    fresh.generate(PROMPT, max_new_tokens=10, do_sample=False)
    want = counted(fresh)
    used = specfit.enable(tiny_moe(), cache_slots=3, cache_policy=policy)
    used.generate(OTHER, max_new_tokens=12, do_sample=False)
    assert counted(used) != want  # the history the clear must forget would show
    runtime = used.specfit
    layers, experts = len(runtime.layers), runtime.num_experts
    routes = np.zeros((2, layers, experts), dtype=bool)  # a pool of two nodes routed to the rarest experts
    routes[0, :, :4] = routes[1, :, 12:] = True
    runtime.expect_tree([100.0, 100.0], routes)
    runtime.clear_cache()
    assert all(not layer.cache.lru.resident for layer in runtime.layers)
    used.generate(PROMPT, max_new_tokens=10, do_sample=False)
    assert counted(used) == want


def test_a_pending_forecast_would_change_the_counts():
    """The control of the test above: the same pending forecast given to a fresh "forecast" cache (not cleared)
    changes what its next call counts, so a forecast surviving clear_cache() would be seen."""
    fresh = specfit.enable(tiny_moe(), cache_slots=3, cache_policy="forecast")
    fresh.generate(PROMPT, max_new_tokens=10, do_sample=False)
    forecasted = specfit.enable(tiny_moe(), cache_slots=3, cache_policy="forecast")
    runtime = forecasted.specfit
    routes = np.zeros((2, len(runtime.layers), runtime.num_experts), dtype=bool)
    routes[0, :, :4] = routes[1, :, 12:] = True
    runtime.expect_tree([100.0, 100.0], routes)
    forecasted.generate(PROMPT, max_new_tokens=10, do_sample=False)
    assert counted(forecasted) != counted(fresh)


# --- item 6: exact past the rescale ---------------------------------------------------------------------------------
PLANS = 5000  # decay 0.9: the running scale 0.9**-t passes 1e200 near plan 4371, where "frequency" rescales


def decayed(uses, now, decay=0.9):
    """The decayed sum of an expert's uses (plan numbers) at plan ``now``, summed directly."""
    return sum(decay ** (now - u) for u in uses)


@pytest.mark.parametrize("policy", ["frequency", "forecast"])
def test_the_decayed_frequency_stays_exact_past_its_rescale(policy):
    """5,000 plans of two slots: expert 0 every plan, 1 every other, 2 every third plan up to plan 4,900. The scores
    after are the decayed sums computed directly; a forecast still adds its tokens; a new pair of experts (5, 6),
    used every plan from then on, takes both slots of a bypassing book within a few tens of plans: once it outscores
    the residents (0 at ~10 and 1 at ~5.3, each decaying; a newcomer at (1 - 0.9**n) / 0.1: the 7th plan)."""
    book = SlotBook(2, 8, make_policy(policy, 8))
    bypass = SlotBook(2, 8, DecayedFrequency(8, bypass=True))
    history = {0: [], 1: [], 2: []}
    for t in range(1, PLANS + 1):
        needed = [e for e, every in ((0, 1), (1, 2), (2, 3)) if t % every == 0 and (e != 2 or t <= 4900)]
        for b in (book, bypass):
            b.plan(needed)
        for e in needed:
            history[e].append(t)
    for e in range(4):
        assert book.score(e) == pytest.approx(decayed(history.get(e, []), PLANS), rel=1e-9, abs=1e-300), e
    assert sorted(book.resident) == [0, 1] and sorted(bypass.resident) == [0, 1]
    if policy == "forecast":
        book.expect([0.0, 0.0, 3.0] + [0.0] * 5)
        assert book.score(2) == pytest.approx(decayed(history[2], PLANS) + 3.0, rel=1e-9)
        book.plan([])  # the forecast is consumed by the plan
        assert book.score(2) == pytest.approx(decayed(history[2], PLANS + 1), rel=1e-9)
    took = next((n for n in range(1, 100) if bypass.plan([5, 6]) and sorted(bypass.resident) == [5, 6]), None)
    # the newcomers' score after n plans, summed directly, must pass the residents' (each decayed n more plans)
    new = lambda n: decayed(range(PLANS + 1, PLANS + n + 1), PLANS + n)  # noqa: E731
    first = next(n for n in range(1, 100) if new(n) > decayed(history[0], PLANS + n)
                 and new(n) > decayed(history[1], PLANS + n))
    assert took == first and took <= 30, (took, first)
    assert book.plan([3]).evicted == (1,)  # the weaker resident (1: ~5.3 against 0: ~10)


def test_frequency_over_age_stays_exact_over_a_long_run():
    """5,000 plans of frequency over age (no rescale: counts): scores f / (age + 1) exactly, and a new pair used every
    plan takes both slots of a bypassing book once its n / 1 passes both residents' (5000 / (n + 1): near n = 71)."""
    book = SlotBook(2, 8, FrequencyOverAge(8, bypass=True))
    for t in range(1, PLANS + 1):
        book.plan([0, 1] if t <= 4990 else [0])
    assert book.score(0) == pytest.approx(PLANS / 1) and book.score(1) == pytest.approx(4990 / 11)
    assert book.score(3) == 0.0
    took = next((n for n in range(1, 200) if book.plan([5, 6]) and sorted(book.resident) == [5, 6]), None)
    first = next(n for n in range(1, 200) if n > PLANS / (n + 1) and n > 4990 / (n + 11))
    assert took == first and took <= 100, (took, first)


# --- what the frequency policies rank by ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["frequency", "frequency-age", "forecast"])
def test_the_likelier_of_two_misses_takes_the_one_slot(policy):
    """One slot; 2 was used three times, then 3 took the slot once. A forward needing 2 and 4 (never used): 2 takes
    the slot back, 4 is streamed, whichever order they are asked in."""
    for needed in ([2, 4], [4, 2]):
        book = SlotBook(1, 8, make_policy(policy, 8))
        for used in ([2], [2], [2], [3]):
            book.plan(used)
        plan = book.plan(needed)
        assert (plan.loads, plan.streamed, plan.evicted) == (((2, 0),), (4,), (3,)), (policy, needed)


@pytest.mark.parametrize("policy", ["frequency", "frequency-age", "forecast"])
def test_a_use_by_many_tokens_weighs_more(policy):
    """A forward's use of an expert weighs 1 + 0.1 x (its tokens - 1): a prompt's use by 11 tokens counts 2."""
    book = SlotBook(4, 8, make_policy(policy, 8))
    book.plan([0, 1, 2], uses=[11, 1, 3])
    assert [book.score(e) for e in (0, 1, 2, 3)] == pytest.approx([2.0, 1.0, 1.2, 0.0])


@pytest.mark.parametrize("policy, kept", [("lru", [2, 3, 4]), ("frequency", [0, 3, 4]), ("frequency-age", [0, 3, 4]),
                                          ("forecast", [0, 3, 4])])
def test_two_misses_evict_the_two_weakest(policy, kept):
    """Three slots: 0 used three times, then 1, then 2. Two new experts evict the least recently used two (LRU) or
    the two least used lately (1 and 2: the frequency policies keep 0)."""
    book = SlotBook(3, 8, make_policy(policy, 8))
    for needed in ([0], [0], [0], [1], [2]):
        book.plan(needed)
    book.plan([3, 4])
    assert sorted(book.resident) == kept
