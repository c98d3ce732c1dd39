"""Offloaded experts on a tiny random Qwen3-MoE (fp32, CPU): exact logits, counters, routes, enable/disable."""

import time

import pytest
import torch
from conftest import tiny_moe
from transformers import Qwen3Config, Qwen3ForCausalLM

import specfit
from specfit.offload.lru import LRUSlots
from specfit.offload.policies import make_policy
from specfit.offload.slots import SlotBook
from specfit.offload.routes import pack, unpack

E, K, LAYERS = 16, 4, 4


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def router_topk(model, ids):
    """Independent routes: each layer's router logits (output_router_logits) -> softmax -> top-k."""
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    routes = torch.zeros(ids.shape[1], LAYERS, E, dtype=torch.bool)
    for layer, lg in enumerate(out.router_logits):
        routes[:, layer].scatter_(1, torch.softmax(lg.float(), -1).topk(K, dim=-1).indices, True)
    return routes


@pytest.mark.parametrize("slots", [1, 2, K, E])
@pytest.mark.parametrize("length", [1, 7, 33])
def test_logits_equal_original(slots, length):
    model = tiny_moe()
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
    ref = logits(model, ids)
    specfit.enable(model, cache_slots=slots)
    for _ in range(2):  # second pass starts from a warm cache
        torch.testing.assert_close(logits(model, ids), ref, rtol=1e-5, atol=1e-5)
    if length > 1 and slots < E:
        assert model.specfit.stats.last_forward.streamed > 0 or slots >= K


def test_union_exceeds_slots_streams_and_stays_exact():
    model = tiny_moe()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    union = router_topk(model, ids).any(0).sum(-1)  # [layers] distinct experts per layer
    assert (union > 3).all()
    ref = logits(model, ids)
    specfit.enable(model, cache_slots=3)
    torch.testing.assert_close(logits(model, ids), ref, rtol=1e-5, atol=1e-5)
    c = model.specfit.stats.last_forward
    assert c.streamed == int((union - 3).clamp(min=0).sum())
    assert c.misses == c.demand == int(union.sum())  # cold cache: every expert is copied once


@pytest.mark.parametrize("policy", ["lru", "forecast"])
def test_counters_match_independent_replay(policy):
    """The runtime's counters equal the router's routes replayed through one slot book per layer (the policy given
    each forward's tokens per expert, as the experts function passes them)."""
    model = tiny_moe()
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(0, 256, (1, n), generator=g) for n in (5, 1, 1, 3, 1, 9, 1, 1)]
    routes = [router_topk(model, ids) for ids in inputs]
    specfit.enable(model, cache_slots=5, cache_policy=policy)
    stats = model.specfit.stats
    for ids, r in zip(inputs, routes):
        logits(model, ids)
        assert torch.equal(model.specfit.routes.last, r)  # recorded routes are the router's top-k
    reference = [LRUSlots(5, E) if policy == "lru" else SlotBook(5, E, make_policy(policy, E)) for _ in range(LAYERS)]
    demand = misses = 0
    for r in routes:
        for layer in range(LAYERS):
            counts = r[:, layer].sum(0)
            needed = counts.nonzero().flatten().tolist()
            uses = [int(counts[e]) for e in needed] if len(r) > 1 else None
            demand += len(needed)
            misses += reference[layer].plan(needed, uses=uses).misses
    assert (stats.total.demand, stats.total.misses, stats.total.forwards) == (demand, misses, len(inputs))
    assert stats.total.hits == demand - misses
    assert stats.total.bytes_copied == misses * model.specfit.store.expert_bytes
    assert 0 < stats.total.hits  # the cache does its job across forwards
    stats.reset()
    assert stats.total.demand == 0 and stats.last_forward.demand == 0


def test_cleared_mode_copies_all_demand():
    model = tiny_moe()
    specfit.enable(model, cache_slots=E, cache_mode="cleared")
    ids = torch.randint(0, 256, (1, 6))
    for _ in range(3):
        logits(model, ids)
        c = model.specfit.stats.last_forward
        assert c.misses == c.demand > 0 and c.hits == 0


def test_clear_empties_every_layer():
    model = tiny_moe()
    specfit.enable(model, cache_slots=E)
    ids = torch.randint(0, 256, (1, 4))
    logits(model, ids)
    logits(model, ids)
    assert model.specfit.stats.last_forward.misses == 0
    model.specfit.clear_cache()
    logits(model, ids)
    assert model.specfit.stats.last_forward.misses == model.specfit.stats.last_forward.demand


def test_packed_routes_round_trip():
    model = tiny_moe()
    specfit.enable(model, cache_slots=4)
    logits(model, torch.randint(0, 256, (1, 5)))
    packed = model.specfit.routes.packed()
    assert packed.shape == (5, LAYERS, 2) and packed.dtype.name == "uint8"
    assert (unpack(packed, E) == model.specfit.routes.last.numpy()).all()
    assert (pack(unpack(packed, E)) == packed).all()


def test_enable_disable_restores_bit_identical():
    model = tiny_moe()
    ids = torch.randint(0, 256, (1, 9))
    ref = logits(model, ids)
    ref_gen = model.generate(ids, max_new_tokens=8, do_sample=False)
    names = sorted(n for n, _ in model.named_parameters())
    cls, impl = type(model), model.config._experts_implementation
    specfit.enable(model, cache_slots=2)
    assert not any("experts" in n for n, _ in model.named_parameters())  # no second copy of the experts
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), ref_gen)
    specfit.disable(model)
    assert torch.equal(logits(model, ids), ref)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), ref_gen)
    assert type(model) is cls and model.config._experts_implementation == impl
    assert sorted(n for n, _ in model.named_parameters()) == names
    assert not hasattr(model, "specfit")
    assert not model.model._forward_hooks and not model.model._forward_pre_hooks
    specfit.enable(model, cache_slots=3)  # and again
    torch.testing.assert_close(logits(model, ids), ref, rtol=1e-5, atol=1e-5)


def test_emulated_link_costs_each_copy():
    model = tiny_moe()
    specfit.enable(model, cache_slots=E, cache_mode="cleared", link=2e-3)
    ids = torch.randint(0, 256, (1, 3))
    t0 = time.perf_counter()
    logits(model, ids)
    wall = time.perf_counter() - t0
    c = model.specfit.stats.last_forward
    assert wall >= c.misses * 2e-3  # copies queue on the link one behind the other
    assert 0.5 * c.misses * 2e-3 <= c.copy_wait_seconds <= wall  # time compute waited; the rest overlapped compute
    assert c.copy_busy_seconds == pytest.approx(c.misses * 2e-3)  # the link's time, one figure per copy
    assert c.bytes_copied == c.misses * model.specfit.store.expert_bytes and c.pageable_copies == 0
    assert "emulated" in model.specfit.link_label


def test_prefetch_wasted_counts_only_prefetched_experts_a_forward_did_not_use():
    """Per layer, 2 experts the next forward needs and 3 it does not are prefetched into a cold cache: the forward
    hits the 2, and exactly the 3 others count as wasted (then nothing more, as nothing was prefetched since);
    prefetched experts dropped by clear_cache() count as wasted there. Kills the mutant: cache.py counts every
    prefetched expert as wasted, hits included."""
    model = tiny_moe()
    ids = torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(5))
    needed = router_topk(model, ids).any(0)  # [layers, experts]
    specfit.enable(model, cache_slots=E)
    rt, stats = model.specfit, model.specfit.stats
    ahead = torch.zeros(LAYERS, E, dtype=torch.bool)
    for layer in range(LAYERS):
        ahead[layer, needed[layer].nonzero().flatten()[:2]] = True
        ahead[layer, (~needed[layer]).nonzero().flatten()[:3]] = True
    rt.prefetch(ahead.numpy())
    assert stats.total.prefetch_copies == 5 * LAYERS and stats.total.prefetch_wasted == 0
    logits(model, ids)
    c = stats.last_forward
    assert (c.hits, c.misses, c.demand) == (2 * LAYERS, int(needed.sum()) - 2 * LAYERS, int(needed.sum()))
    assert c.prefetch_wasted == 3 * LAYERS
    logits(model, ids)
    assert stats.last_forward.prefetch_wasted == 0 and stats.last_forward.hits == int(needed.sum())
    rt.clear_cache()
    before = stats.total.prefetch_wasted
    rt.prefetch(ahead.numpy())
    rt.clear_cache()
    assert stats.total.prefetch_wasted - before == 5 * LAYERS


def test_errors():
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16, intermediate_size=64))
    with pytest.raises(ValueError, match="has no MoE layers"):
        specfit.enable(dense, cache_slots=1)
    model = tiny_moe()
    for bad in (0, 17, -1, 2.5, None):
        with pytest.raises(ValueError, match="cache_slots"):
            specfit.enable(model, cache_slots=bad)
    with pytest.raises(ValueError, match="cache_mode"):
        specfit.enable(model, cache_slots=2, cache_mode="warm")
    for bad in (True, "0.3"):
        with pytest.raises(ValueError, match="link must be a LinkConfig or seconds per expert copy"):
            specfit.enable(model, cache_slots=2, link=bad)
    assert not hasattr(model, "specfit")  # a failed enable leaves nothing behind
    specfit.enable(model, cache_slots=2)
    with pytest.raises(RuntimeError, match="already enabled"):
        specfit.enable(model, cache_slots=2)
    specfit.disable(model)
    with pytest.raises(RuntimeError, match="not enabled"):
        specfit.disable(model)


def test_fetch_groups_yield_what_fetch_yields():
    """Random workloads through two identical caches: the grouped fetch gives the same experts and weights as the
    per-expert fetch (hits first, then loads, then each streamed expert alone), and counts the same."""
    from specfit.offload.cache import CopyEngine, LayerCache
    from specfit.offload.store import ExpertStore
    from specfit.stats import Counters

    store = ExpertStore(1, 12, 2, 2, torch.float32, pin=False)
    store.arenas[0].copy_(torch.arange(12, dtype=torch.float32)[:, None].expand(-1, store.expert_numel))
    engine = CopyEngine(torch.device("cpu"))
    one, grouped = LayerCache(store, 0, 4, engine), LayerCache(store, 0, 4, engine)
    c1, c2 = Counters(), Counters()
    rng = torch.Generator().manual_seed(0)
    kinds = set()
    for _ in range(40):
        needed = torch.randperm(12, generator=rng)[: int(torch.randint(1, 7, (), generator=rng))].tolist()
        singles = [(e, w[0].item()) for e, w in one.fetch(needed, c1)]
        groups = list(grouped.fetch_groups(needed, c2))
        assert [(e, w[0].item()) for es, ws in groups for e, w in zip(es, ws)] == singles
        assert all(ws.shape == (len(es), store.expert_numel) for es, ws in groups)
        kinds.add(len(groups))
    timing = ("copy_busy_seconds", "copy_wait_seconds")  # measured, so not equal between the two
    assert {k: v for k, v in vars(c1).items() if k not in timing} == {k: v for k, v in vars(c2).items()
                                                                        if k not in timing}
    assert c1.streamed > 0 and max(kinds) >= 3  # every kind of group occurred
