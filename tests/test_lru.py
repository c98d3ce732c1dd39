"""LRU bookkeeping: golden traces, written out by hand."""

import random

import pytest

from specfit.offload.lru import LRUSlots


def test_golden_trace_two_slots():
    lru = LRUSlots(num_slots=2, num_experts=8)
    p = lru.plan([3, 5])
    assert (p.hits, p.loads, p.streamed, p.evicted) == ((), ((3, 0), (5, 1)), (), ())
    p = lru.plan([5])
    assert (p.hits, p.loads) == (((5, 1),), ())
    p = lru.plan([1])  # 3 is least recently used now
    assert (p.loads, p.evicted) == (((1, 0),), (3,))
    assert list(lru.resident) == [5, 1]
    p = lru.plan([3, 1])  # 1 hits and is protected; 3 evicts 5
    assert (p.hits, p.loads, p.evicted) == (((1, 0),), ((3, 1),), (5,))
    p = lru.plan([0, 2, 4])  # 3 needed, 2 slots: two loads evicting 1 then 3, the third is streamed
    assert (p.loads, p.streamed, p.evicted) == (((0, 0), (2, 1)), (4,), (1, 3))
    assert p.misses == 3
    assert lru.resident == {0: 0, 2: 1}


def test_golden_trace_hits_protected_when_overfull():
    lru = LRUSlots(num_slots=3, num_experts=16)
    lru.plan([1, 2, 3])
    p = lru.plan([9, 1, 2, 3, 8])  # all three residents are hits, so both misses stream
    assert p.hits == ((1, 0), (2, 1), (3, 2))
    assert p.loads == () and p.streamed == (9, 8) and p.evicted == ()


def test_clear_empties_slots():
    lru = LRUSlots(2, 4)
    lru.plan([0, 1])
    lru.clear()
    assert lru.resident == {}
    assert lru.plan([0, 1]).loads == ((0, 0), (1, 1))


def _reference_misses(trace, slots):
    """Independent count: a list kept in recency order, misses counted per distinct needed expert."""
    order, misses = [], 0
    for needed in trace:
        kept = [e for e in needed if e in order]
        for e in kept:
            order.remove(e)
            order.append(e)
        for e in needed:
            if e in kept:
                continue
            misses += 1
            if len(order) < slots:
                order.append(e)
                continue
            victims = [v for v in order if v not in needed]
            if victims:
                order.remove(victims[0])
                order.append(e)
    return misses


@pytest.mark.parametrize("slots", [1, 2, 5, 12])
def test_counts_match_reference(slots):
    rng = random.Random(slots)
    lru = LRUSlots(slots, 12)
    trace = [sorted(rng.sample(range(12), rng.randint(1, 7))) for _ in range(300)]
    misses = 0
    for needed in trace:
        plan = lru.plan(needed)
        assert sorted(e for e, _ in plan.hits) + sorted(e for e, _ in plan.loads) + sorted(plan.streamed) != []
        assert {e for e, _ in plan.hits} | {e for e, _ in plan.loads} | set(plan.streamed) == set(needed)
        assert len(set(lru.resident.values())) == len(lru.resident) <= slots  # one expert per slot
        misses += plan.misses
    assert misses == _reference_misses(trace, slots)


def test_bad_input():
    with pytest.raises(ValueError, match="num_slots must be in 1..8"):
        LRUSlots(0, 8)
    with pytest.raises(ValueError, match="num_slots must be in 1..8"):
        LRUSlots(9, 8)
    lru = LRUSlots(2, 8)
    with pytest.raises(ValueError, match="out of range"):
        lru.plan([8])
    with pytest.raises(ValueError, match="distinct"):
        lru.plan([1, 1])


def test_an_unconfirmed_load_is_a_load_again_at_the_next_plan():
    """``plan(..., confirmed=False)`` interrupted before ``confirm``: the next plan forgets the load (its copy may never
    have run), so the expert is a load again, into a free slot, and nothing else is disturbed. Confirmed, it hits."""
    lru = LRUSlots(num_slots=3, num_experts=8)
    lru.plan([1, 2])
    p = lru.plan([4], confirmed=False)
    assert p.loads == ((4, 2),)
    assert lru.slot_of(4) is None and lru.resident == {1: 0, 2: 1}  # not resident until confirmed
    p = lru.plan([4, 1])  # no confirm came: 4 is a load again, not a hit; 1 still hits
    assert (p.hits, p.loads, p.streamed, p.evicted) == (((1, 0),), ((4, 2),), (), ())
    assert lru.resident == {2: 1, 4: 2, 1: 0}
    # full slots: an unconfirmed load that evicted an expert; the evicted one stays gone, its slot is free again
    p = lru.plan([5], confirmed=False)
    assert (p.loads, p.evicted) == (((5, 1),), (2,))
    p = lru.plan([5])
    assert (p.hits, p.loads, p.evicted) == ((), ((5, 1),), ())
    assert lru.resident == {4: 2, 1: 0, 5: 1}
    # confirmed before the next plan: resident, a hit
    lru.plan([6], confirmed=False)
    lru.confirm([6])
    assert lru.slot_of(6) is not None
    p = lru.plan([6])
    assert p.hits == ((6, lru.slot_of(6)),) and p.loads == ()
