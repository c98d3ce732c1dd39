"""Route sources for draft nodes: gate and trained predictors, prefetch during drafting, the cache-aware cost."""

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe
from test_probes import random_drafter

import specfit
from specfit.evaluation.probes import calibrate
from specfit.selection.cost_model import CostModel
from specfit.patch import configure
from specfit.selection.route_predictor import RoutePredictor, recall
from specfit.training.router import collect, train

PROMPT = torch.randint(2, 256, (1, 11), generator=torch.Generator().manual_seed(11))
COST = CostModel((0.010, 0.0105, 0.011, 0.0115, 0.012, 0.0125, 0.013, 0.0135), 4e-5, copy_overhead=1.6e-4,
                 link_share=1.0)  # a resident expert costs its compute, a missing one 5x that


def test_recall_by_hand():
    true = torch.zeros(2, 1, 6, dtype=torch.bool)
    true[0, 0, [0, 1]] = True
    true[1, 0, [2, 3]] = True
    pred = torch.zeros_like(true)
    pred[0, 0, [0, 5]] = True
    pred[1, 0, [2, 3]] = True
    assert recall(pred, true).tolist() == [0.75]


def test_gate_head_is_the_targets_router():
    model = tiny_moe()
    head = RoutePredictor.from_gates(model)
    h = torch.randn(5, 64)
    want = torch.stack([torch.softmax(h @ m.mlp.gate.weight.T, -1).topk(4).indices.sort().values
                        for m in model.model.layers], 1)  # [5, L, 4]
    got = head.routes(h)
    assert (got.sum(-1) == 4).all()
    assert torch.equal(got.nonzero()[:, 2].view(5, 4, 4), want)


def test_save_load_and_mismatch(tmp_path):
    model = tiny_moe()
    head = RoutePredictor.from_gates(model)
    with torch.no_grad():
        head.bias.add_(0.5)
    head.save(tmp_path)
    again = RoutePredictor.load(tmp_path, model)
    h = torch.randn(3, 64)
    assert torch.equal(again(h), head(h))
    with pytest.raises(ValueError, match=r"is for \(layers, experts, hidden\) = \(4, 16, 64\)"):
        RoutePredictor.load(tmp_path, tiny_moe(num_experts=8))


def test_training_learns_a_linear_router():
    torch.manual_seed(0)
    truth = RoutePredictor(3, 16, 32, 4)
    with torch.no_grad():
        truth.weight.normal_()
    states = torch.randn(3000, 32)
    routes = truth.routes(states)
    head = RoutePredictor(3, 16, 32, 4)
    before = recall(head.routes(states[2500:]), routes[2500:]).mean()
    train(head, states[:2500], routes[:2500], epochs=30, lr=1e-2)
    after = recall(head.routes(states[2500:]), routes[2500:]).mean()
    assert before < 0.5 < 0.9 < after


def test_collected_pairs_are_true_routes():
    model = tiny_moe()
    specfit.enable(model, cache_slots=16, drafter=random_drafter(model))
    states, routes = collect(model, [PROMPT], max_new_tokens=6)
    assert states.shape[1] == 64 and routes.shape[1:] == (4, 16)
    assert len(states) == len(routes) and len(states) % 19 == 0  # root + 18 pool nodes per cycle
    assert (routes.sum(-1) == 4).all()


@pytest.mark.parametrize("route_source", ["gate", "predictor", "oracle"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_specfit_with_predicted_routes_and_prefetch_is_lossless(route_source, prefetch):
    expected = tiny_moe().generate(PROMPT, max_new_tokens=24, do_sample=False)
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3, sharpen=8.0)
    predictor = RoutePredictor.from_gates(model) if route_source == "predictor" else None
    specfit.enable(model, cache_slots=5, drafter=drafter, cost_model=COST, route_source=route_source,
                   prefetch=prefetch, route_predictor=predictor, link=2e-4)
    out = model.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant="specfit")
    assert torch.equal(out, expected)
    g = model.specfit.stats.last_generate
    assert g.nodes_per_cycle > 0
    if prefetch:
        assert g.prefetch_copies > 0 and g.prefetch_wasted < g.prefetch_copies  # some prefetches were hits
    else:
        assert g.prefetch_copies == g.prefetch_wasted == 0


def test_prefetch_with_true_routes_leaves_no_miss():
    """Oracle routes and room for every expert: the winner's experts are all copied before its verify forward, so
    the verify forwards of drafted cycles never miss (a cycle that skips drafting prefetches nothing); wasted
    prefetches are those of winners dropped by a later level."""
    expected = tiny_moe().generate(PROMPT, max_new_tokens=24, do_sample=False)
    model = tiny_moe()
    specfit.enable(model, cache_slots=16, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3,
                                                              sharpen=8.0), cost_model=COST, prefetch=True,
                   route_source="oracle", guard=False)  # SpecFit's way every cycle (EAGLE-3's does not prefetch)
    model.specfit.stats.trace = []
    assert torch.equal(model.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant="specfit"), expected)
    g = model.specfit.stats.last_generate
    drafted = [c for c in model.specfit.stats.trace if c.pool > 0]
    assert drafted and all(c.misses == 0 for c in drafted) and g.prefetch_copies > 0


def test_predictor_source_needs_a_predictor():
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=random_drafter(model), cost_model=COST, route_source="predictor")
    with pytest.raises(ValueError, match="needs a trained route predictor"):
        model.generate(PROMPT, max_new_tokens=3, assistant="specfit")
    with pytest.raises(ValueError, match="unknown route_source 'atlas'"):
        configure(model, route_source="atlas")
    with pytest.raises(ValueError, match="prefetch=True needs cache_mode='cached'"):
        specfit.enable(tiny_moe(), cache_slots=4, cache_mode="cleared", prefetch=True)
    cleared = specfit.enable(tiny_moe(), cache_slots=4, cache_mode="cleared")
    with pytest.raises(ValueError, match="prefetch=True needs cache_mode='cached'"):
        configure(cleared, prefetch=True)


def test_both_costs_are_lossless_and_the_papers_needs_its_fit():
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3)
    no_paper = CostModel(COST.intercepts, COST.beta, copy_overhead=1e-5, link_share=1.0)  # a profile without it
    with pytest.raises(ValueError, match="cost='paper' needs the profile's fit on demand alone"):  # where given
        specfit.enable(model, cache_slots=5, drafter=drafter, cost_model=no_paper, cost="paper")
    specfit.enable(model, cache_slots=5, drafter=drafter, cost_model=no_paper)
    with pytest.raises(ValueError, match="cost='paper' needs"):
        configure(model, cost="paper")
    fitted = calibrate(model, [PROMPT], probes=24, warmup=1, max_new_tokens=40).cost
    paper = fitted.paper()  # the same probes fitted on demand alone, stored beside the fit with its checks
    assert paper.max_nodes == fitted.max_nodes and paper.draft_level_seconds == fitted.draft_level_seconds
    assert {"r2", "heldout_r2", "beta_interval_s", "slots", "link"} <= set(paper.meta) and fitted.prices_copies
    expected = tiny_moe().generate(PROMPT, max_new_tokens=20, do_sample=False)
    for cost in ("cache-aware", "paper"):
        configure(model, cost_model=fitted, cost=cost)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant="specfit"), expected)


def test_cache_aware_selection_prices_resident_experts_at_their_compute_only():
    """Every draft node needs the same 15 experts per layer, the root one other, and copies dominate the cost: with
    nothing resident no subtree pays (16 copies per layer against 1), so the winner is the root alone. With the 15
    resident in the slot cache, cost="cache-aware" prices them at their compute only and the winner verifies draft
    nodes; with them evicted it is the root alone again; the paper's demand-only price ignores residency. Kills the
    mutant: the selector ignores residency and prices every expert as a copy."""
    from specfit.decoding.assistants import SpecFitGenerator
    from specfit.selection.route_sources import Cycle

    layers, experts = 4, 16
    shared = np.zeros((layers, experts), dtype=bool)  # [L, E] what every draft node needs
    shared[:, :15] = True
    root = ~shared  # [L, E] what the root needs
    intercepts = (0.010, 0.0105, 0.011, 0.0115, 0.012, 0.0125, 0.013, 0.0135)
    cost = CostModel(intercepts, beta=1e-5, meta={"paper": dict(intercepts=intercepts, beta=1.0)},
                     copy_overhead=1.0, link_share=1.0)
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.0)
    specfit.enable(model, cache_slots=15, drafter=drafter, cost_model=cost)
    runtime = model.specfit
    assert runtime.options.cost == "cache-aware"  # the default

    def winner():
        runtime.backoff = None  # a fresh generator that drafts this cycle, whatever the last one chose
        gen = SpecFitGenerator(model)
        gen.routes = lambda cycle, tree: (np.broadcast_to(shared, (len(tree), layers, experts)).copy(), root.copy())
        gen.start(torch.zeros(1, PROMPT.shape[1], 3 * 64), torch.cat([PROMPT[:, 1:], PROMPT[:, :1]], dim=1))
        cycle = Cycle(model, cache=None, base=PROMPT.shape[1], root=int(PROMPT[0, 0]))
        tree = gen.draft(cycle)
        assert len(tree) > 0  # it drafted
        assert gen.predicted_seconds == pytest.approx(gen.winner.predicted_time)  # the forecast of the cycle
        return gen.select(tree, cycle)

    runtime.prefetch(shared)
    assert (runtime.resident_mask() == shared).all()
    assert len(winner()) > 0  # the nodes' experts are resident: their compute only
    configure(model, cost="paper")
    assert winner() == ()  # the same residency, priced on full demand
    configure(model, cost="cache-aware")
    runtime.clear_cache()
    assert winner() == ()  # nothing resident: the nodes' experts are copies


def test_specfit_charges_exactly_the_levels_it_has_drafted():
    """After drafting level d, the selector's cost model includes the drafting of levels 1..d and no other: each
    intercept is the profile's (which includes every probed level) less the levels not drafted yet."""
    from specfit.decoding.assistants import SpecFitGenerator

    levels = (0.001, 0.002, 0.003, 0.004, 0.005)
    cost = CostModel(tuple(0.02 + 0.001 * n for n in range(8)), 4e-5, draft_level_seconds=levels,
                     copy_overhead=1.6e-4, link_share=1.0)
    model = tiny_moe()
    specfit.enable(model, cache_slots=5, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0])), cost_model=cost)
    gen = SpecFitGenerator(model)
    assert len(gen.level_costs) == model.specfit.options.depth == 5
    for depth, at in enumerate(gen.level_costs, start=1):
        assert at.draft_level_seconds == levels[:depth]
        assert at.intercepts == pytest.approx([a - sum(levels[depth:]) for a in cost.intercepts])
        assert at.copy == gen.cost.copy and at.beta == cost.beta


def test_the_forecast_of_every_specfit_cycle_is_in_the_stats():
    """SpecFit forecasts every cycle it runs (drafted ones: the winner's predicted time at the levels drafted; the
    ones that skip drafting: a root-only step), so the stats hold the forecast beside the clock; AR and EAGLE-3 make
    none."""
    model = tiny_moe()
    specfit.enable(model, cache_slots=5, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3),
                   cost_model=COST)
    model.specfit.stats.start_trace()
    model.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant="specfit")
    g = model.specfit.stats.last_generate
    rows = model.specfit.stats.trace.rows()
    assert g.forecast_cycles == g.cycles == len(rows) > 0
    assert g.predicted_seconds == pytest.approx(sum(r["predicted_seconds"] for r in rows))
    assert all(r["predicted_seconds"] >= COST.intercepts[0] - sum(COST.draft_level_seconds) for r in rows)
    assert g.forecast_over_real == pytest.approx(g.predicted_seconds / g.decode_seconds)
    for assistant in (None, "eagle3"):
        model.generate(PROMPT, max_new_tokens=8, do_sample=False, assistant=assistant)
        assert model.specfit.stats.last_generate.forecast_over_real is None
