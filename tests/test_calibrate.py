"""Calibration on CPU with the emulated link, the route oracle as a measurement device, and profile lookup."""

import warnings

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.evaluation.calibrate import calibrate
from specfit.selection.cost_model import CostModel, ProfileError, profile_path
from specfit.selection.profiles import device_name, model_id, resolve_cost_model
from specfit.selection.route_sources import Cycle, oracle_routes
from specfit.drafting.tree import DraftTree

PROMPTS = [torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]


def random_drafter(model, seed=0):
    from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter

    torch.manual_seed(seed)
    config = Eagle3Config.from_target(model.config, draft_vocab_size=256, intermediate_size=128)
    config.aux_layer_ids = (0, 1, 3)
    return Eagle3Drafter(config)


def test_fitted_beta_recovers_emulated_link():
    """Cleared cache: every expert of demand is one emulated copy of 5 ms; the fit must find ~5 ms per expert."""
    model = tiny_moe()
    specfit.enable(model, cache_slots=16, cache_mode="cleared", link=5e-3, drafter=random_drafter(model),
                   depth=3, pool_nodes=10)
    cost, records = calibrate(model, PROMPTS, probes=90, warmup=1, max_new_tokens=50)
    assert len(records) == 90
    assert len({r.n_nodes for r in records}) >= 6  # the probes span subtree sizes
    assert abs(cost.beta - 5e-3) / 5e-3 < 0.15, f"beta {cost.beta * 1e3:.3f} ms"
    assert cost.meta["cache_mode"] == "cleared" and cost.meta["slots"] == 16 and "emulated" in cost.meta["link"]
    assert cost.meta["r2"] > 0.9


def test_oracle_leaves_cache_and_counters_untouched():
    model = tiny_moe()
    specfit.enable(model, cache_slots=3, drafter=SelfDrafter(model, first_token=int(PROMPTS[0][0, 0])))
    ids = PROMPTS[0]
    cache_kv = __import__("transformers").DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache_kv, use_cache=True)
    rt = model.specfit
    before = rt.stats.total.copy()
    resident = [layer.cache.lru.resident for layer in rt.layers]
    last_routes = rt.routes.last.clone()
    kv_len = cache_kv.get_seq_length()
    tree = DraftTree()
    a = tree.add(-1, 5, 0.5)
    tree.add(-1, 6, 0.3)
    tree.add(a, 7, 0.2)
    cycle = Cycle(model, cache_kv, base=kv_len, root=9)
    routes, root_routes = oracle_routes(cycle, tree)
    assert rt.stats.total == before
    assert [layer.cache.lru.resident for layer in rt.layers] == resident
    assert torch.equal(rt.routes.last, last_routes)
    assert cache_kv.get_seq_length() == kv_len and cycle.measurement_seconds > 0
    # the oracle's routes are the true ones: a plain forward of the root->node path routes the same way
    for node, path in ((0, [9, 5]), (2, [9, 5, 7]), (1, [9, 6])):
        reference = tiny_moe()
        with torch.no_grad():
            out = reference(torch.cat([ids, torch.tensor([path])], 1), output_router_logits=True)
        want = np.stack([torch.softmax(lg[-1].float(), -1).topk(4).indices.sort().values.numpy()
                         for lg in out.router_logits])
        got = np.stack([np.flatnonzero(routes[node, layer]) for layer in range(4)])
        assert (got == want).all()
    assert root_routes.sum() == 16


def test_enable_finds_profile_or_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=1))
    with pytest.warns(RuntimeWarning, match="no calibrated cost profile"):
        assert resolve_cost_model(model).meta["source"] == "default"
    rt = model.specfit  # a profile calibrated later in the same process is found: the default was not kept
    mine = CostModel((0.01,) * 8, 1e-4, {"slots": 4, "cache_mode": "cached"})
    mine.save(profile_path(device_name(rt), model_id(model), 4, "cached"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cost_model(model) == mine
    specfit.disable(model)
    wrong = tmp_path / "wrong.json"
    CostModel((0.01,) * 8, 1e-4, {"slots": 8, "cache_mode": "cached"}).save(wrong)
    with pytest.raises(ProfileError, match=r"wrong\.json: field 'slots' is 8, expected 4"):  # at enable, not later
        specfit.enable(model, cache_slots=4, cost_model=str(wrong), drafter=SelfDrafter(model, first_token=1))
    assert getattr(model, "specfit", None) is None  # a failed enable leaves the model as it was


def test_cost_profiles_fail_at_enable_and_configure_replaces_them(tmp_path):
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=1)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format": "specfit-cost-model", "version": 1, "uni')
    with pytest.raises(ProfileError, match=r"corrupt\.json: not valid JSON"):
        specfit.enable(model, cache_slots=4, cost_model=corrupt, drafter=drafter)
    negative = tmp_path / "negative.json"
    CostModel((0.01,) * 8, 1e-4).save(negative)
    negative.write_text(negative.read_text().replace('"beta": 0.0001', '"beta": -0.0001'))
    with pytest.raises(ProfileError, match=r"negative\.json: .*'beta' must be a non-negative number, got -0\.0001"):
        specfit.enable(model, cache_slots=4, cost_model=negative, drafter=drafter)
    short = CostModel((0.01,) * 4, 1e-4)  # predicts up to 3 nodes, max_nodes is 7
    with pytest.raises(ProfileError, match="predicts up to 3 nodes but max_nodes is 7"):
        specfit.enable(model, cache_slots=4, cost_model=short, drafter=drafter)

    first, second = CostModel((0.01,) * 8, 1e-4), CostModel((0.02,) * 8, 2e-4, {"slots": 4})
    specfit.enable(model, cache_slots=4, cost_model=first, drafter=drafter)
    assert resolve_cost_model(model) == first
    specfit.configure(model, cost_model=second)
    assert resolve_cost_model(model) == second
    with pytest.raises(ProfileError, match="field 'slots' is 8, expected 4"):
        specfit.configure(model, cost_model=CostModel((0.01,) * 8, 1e-4, {"slots": 8}), max_nodes=3)
    assert resolve_cost_model(model) == second and model.specfit.options.max_nodes == 7  # nothing changed
    with pytest.raises(ProfileError, match="predicts up to 3 nodes but max_nodes is 7"):
        specfit.configure(model, cost_model=short)
