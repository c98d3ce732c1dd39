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
