"""The counterfactual instrument of issue 38 (``evaluation/counterfactual.py``) on a tiny model, and its pieces."""

import numpy as np
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.evaluation.counterfactual import Counterfactual, committed_within, join, report, subtrees, summarize
from specfit.selection.cost_model import CostModel
from specfit.selection.selector import select_subtree

PROMPT = torch.randint(2, 256, (1, 11), generator=torch.Generator().manual_seed(11))
COST = CostModel(tuple(0.010 + 0.0005 * n for n in range(8)), 4e-5, draft_level_seconds=(0.001,) * 5,
                 copy_overhead=1.6e-4, link_share=1.0)


def test_committed_within_follows_the_targets_choices_through_the_subtree_only():
    # root -> 0 (token 5) -> 2 (token 7); root -> 1 (token 6). The target chose 5 at the root, 7 after node 0.
    parents, tokens = [-1, -1, 0], [5, 6, 7]
    where = {0: 1, 2: 2, 1: 3}  # pool node -> tree index of the verify forward
    choices = [5, 7, 9, 4]  # the target's token after each tree position
    assert committed_within((0, 1, 2), parents, tokens, where, choices) == 3  # nodes 0 and 2, then the bonus
    assert committed_within((0, 1), parents, tokens, where, choices) == 2
    assert committed_within((1,), parents, tokens, where, choices) == 1  # the root's bonus token only


def test_subtrees_are_the_ones_the_selector_scores():
    parents = [-1, -1, 0, 0, 1, 2, 2, 4]
    for budget in (0, 1, 3, 7):
        found = subtrees(parents, budget)
        assert len(found) == len(set(found))
        assert all(all(parents[v] < 0 or parents[v] in s for v in s) for s in found)  # ancestor-closed
        routes = np.zeros((len(parents), 1, 4), bool)
        sel = select_subtree(parents, [0.5] * len(parents), routes, np.ones((1, 4), bool), COST, budget)
        assert sel.subtrees == len(found)


def test_the_instrument_alternates_turns_losslessly_and_accounts_both():
    """SpecFit and EAGLE-3's tree on alternate cycles: greedy output unchanged; every EAGLE-3 turn verifies EAGLE-3's
    tree of the full pool and records SpecFit's replayed choice; where that choice lies inside EAGLE-3's tree, the
    tokens it would have committed are at most what the whole tree committed."""
    expected = tiny_moe().generate(PROMPT, max_new_tokens=30, do_sample=False)
    model = tiny_moe()
    specfit.enable(model, cache_slots=5, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3),
                   cost_model=COST)
    log: list = []
    trace = model.specfit.stats.start_trace()
    out = model.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant=Counterfactual.factory(log))
    assert torch.equal(out, expected)
    rows = join(log, trace)
    kinds = [r["kind"] for r in rows]
    assert kinds[:4] == ["specfit", "eagle3", "specfit", "eagle3"]
    eagle = [r for r in rows if r["kind"] == "eagle3"]
    assert all(r["nodes"] == min(7, r["pool"]) and r["levels"] == 5 for r in eagle)
    covered = [r for r in eagle if r["sf_in_eagle"]]
    assert covered and all(1 <= r["sf_tokens"] <= r["tokens"] for r in covered)
    assert all(r["tokens"] == r["accepted"] + 1 for r in rows[:-1])  # the last may be cut by max_new_tokens
    s = summarize(rows)
    assert s["eagle3"]["cycles"] == len(eagle) and s["eagle3"]["nodes"] == 7
    assert s["specfit"]["cycles"] + s["eagle3"]["cycles"] == len(rows)
    text = report("tiny", s)
    assert "forecast tok/s" in text and "SpecFit / EAGLE-3 tok/s" in text


# issue 44, item 11: the instrument and the replay, by what they report ------------------------------------------

HOST_COST = CostModel(tuple(0.010 + 0.0005 * n for n in range(8)), 4e-5, draft_level_seconds=(0.001,) * 5,
                      copy=1e-3, host=2e-4, cold="auto")  # the lane 5x cheaper than a copy: the selector's price


def test_a_subtree_is_forecast_at_the_cost_models_price_of_a_cold_expert():
    """The instrument's forecast of a subtree is ``cost.predict`` at its demand and cold experts, a cold expert
    priced as the selector prices it (``cost.miss``: here the host lane, not a copy)."""
    from specfit.evaluation.counterfactual import _score

    rng = np.random.default_rng(0)
    routes = rng.random((5, 3, 8)) < 0.3  # [N, L, E]
    root = rng.random((3, 8)) < 0.3  # [L, E]
    resident = rng.random((3, 8)) < 0.5
    parents, values = [-1, -1, 0, 0, 2], [0.6, 0.3, 0.4, 0.2, 0.3]
    for nodes in [(), (0,), (0, 2), (0, 1, 2, 4)]:
        s = _score(nodes, values, routes, root, HOST_COST, resident)
        union = root | routes[list(nodes)].any(0) if nodes else root
        demand, misses = int(union.sum()), int((union & ~resident).sum())
        assert (s["demand"], s["misses"]) == (demand, misses) and misses > 0
        assert s["seconds"] == HOST_COST.predict(len(nodes), demand, misses=misses)
        assert s["seconds"] < HOST_COST.predict(len(nodes), demand) + 1e-3 * misses - 1e-9  # not a copy each
        assert s["tokens"] == __import__("pytest").approx(1.0 + sum(values[v] for v in nodes))
        sel = select_subtree(parents, values, routes, root, HOST_COST, 7, resident=resident)
    # the selector's own forecast of its winner is the instrument's forecast of the same subtree
    assert _score(sel.nodes, values, routes, root, HOST_COST, resident)["seconds"] == \
        __import__("pytest").approx(sel.predicted_time)


def counterfactual_run(cost, new_tokens=30):
    model = tiny_moe()
    specfit.enable(model, cache_slots=5, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3),
                   cost_model=cost)
    log: list = []
    trace = model.specfit.stats.start_trace()
    model.generate(PROMPT, max_new_tokens=new_tokens, do_sample=False, assistant=Counterfactual.factory(log))
    return model, join(log, trace)


def test_lambda_is_the_runs_tokens_per_second_so_far_and_eagle_turns_are_the_cost_models_forecast():
    model, rows = counterfactual_run(COST)
    eagle = [(i, r) for i, r in enumerate(rows) if r["kind"] == "eagle3"]
    assert len(eagle) >= 3
    for i, r in eagle:
        before = rows[:i]
        assert r["lam"] == __import__("pytest").approx(sum(x["tokens"] for x in before)
                                                       / sum(x["seconds"] for x in before), rel=1e-9)
    refreshed = model.specfit.cost_refresh is not None and model.specfit.cost_refresh.cycles > 0
    if not refreshed:  # the forecast is the profile's at the levels drafted, demand and misses
        for _, r in eagle:
            want = COST.at_levels(r["levels"]).predict(r["nodes"], r["fc_demand"], misses=r["fc_misses"])
            assert r["fc_seconds"] == __import__("pytest").approx(want)


def test_the_replayed_stop_rule_stops_where_specfits_draft_stops():
    """On the same pool, state and routes, the level where an EAGLE-3 turn says SpecFit's rule would stop, and its
    winner there, are those of SpecFit's own draft()."""
    from specfit.decoding.assistants import SpecFitGenerator
    from specfit.selection.route_sources import Cycle

    model = tiny_moe()
    specfit.enable(model, cache_slots=5, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), sharpen=0.5),
                   cost_model=COST, cost_refresh=False)  # a drafter without noise: the same pool when drafted again
    rng = np.random.default_rng(3)
    layers, experts = len(model.specfit.layers), model.specfit.num_experts
    table = rng.random((64, layers, experts)) < 0.25  # fixed routes per pool node
    root = rng.random((layers, experts)) < 0.25
    stops = set()
    for seed in range(6):
        gen = Counterfactual(model, [])
        gen.routes = lambda cycle, tree: (table[:len(tree)].copy(), root.copy())
        prompt = PROMPT[:, : 6 + seed]
        gen.start(torch.zeros(1, prompt.shape[1], 3 * 64), torch.cat([prompt[:, 1:], prompt[:, :1]], dim=1))
        cycle = Cycle(model, cache=None, base=prompt.shape[1], root=int(prompt[0, 0]))
        tree = SpecFitGenerator.draft(gen, cycle)
        level, nodes = tree.depth, gen.winner.nodes
        gen.backoff.left = gen.backoff.failures = 0
        gen._eagle_turn(cycle)
        assert (gen.row["sf_stop_level"], tuple(gen.row["sf_nodes"])) == (level, tuple(nodes))
        stops.add(level)
    assert stops  # (the pools differ by prompt)


def test_the_replay_gives_each_layer_its_own_forecast():
    """Two layers whose needed experts and forecasts are the same up to a relabelling of the experts: the replay
    counts each layer's misses as that layer alone would have them, and the forecasts change those counts."""
    from specfit.evaluation.cache_replay import Tape, replay

    rng = np.random.default_rng(1)
    experts, forwards = 8, 300
    perm = rng.permutation(experts)
    needed = [sorted(rng.choice(experts, size=2, replace=False).tolist()) for _ in range(forwards)]
    forecasts = []
    for t in range(forwards):
        f = np.zeros(experts)
        f[needed[min(t + 1, forwards - 1)]] = 3.0  # the forecast given before forward t names the next one's
        forecasts.append(f)

    def tape_of(layer_needed, layer_forecasts):
        tape = Tape(len(layer_needed), experts)
        for t in range(forwards):
            routes = np.zeros((1, len(layer_needed), experts), bool)
            for layer, seq in enumerate(layer_needed):
                routes[0, layer, seq[t]] = True
            tape.add(routes, counted=True, forecast=[fs[t].tolist() for fs in layer_forecasts])
        return tape

    needed1 = [sorted(perm[n].tolist()) for n in needed]
    forecasts1 = [f[np.argsort(perm)] for f in forecasts]  # forecast1[perm[e]] = forecast[e]
    both = tape_of([needed, needed1], [forecasts, forecasts1])
    alone0, alone1 = tape_of([needed], [forecasts]), tape_of([needed1], [forecasts1])
    assert replay(both, 3, "forecast") == replay(alone0, 3, "forecast") + replay(alone1, 3, "forecast")
    assert replay(alone0, 3, "forecast") < replay(alone0, 3, "forecast", forecasts=False)
