"""A batch's rows drafted together (one drafter forward per step for every row) draft exactly the trees each row
drafts alone: same tokens, parents and routes, probabilities equal to float rounding."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_moe

from specfit.decoding.batch_drafting import catch_up, draft_rows
from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter
from specfit.drafting.levels import TreeDrafter
from specfit.selection.route_predictor import RoutePredictor

LENGTHS = (3, 9, 6)  # committed pairs per row: ragged drafter caches


def rows(head, depth=4, max_pool=12, seed=0):
    """Two sets of drafters over the same rows (one to draft alone, one to draft together), fed the same pairs."""
    torch.manual_seed(seed)
    model = tiny_moe()
    module = Eagle3Drafter(Eagle3Config.from_target(model.config, draft_vocab_size=256, intermediate_size=32))
    module.set_embedding(model.get_input_embeddings())
    routes = RoutePredictor.from_gates(model).routes if head else None
    g = torch.Generator().manual_seed(seed)
    pairs = [[(torch.randn(1, n, 3 * 64, generator=g), torch.randint(2, 256, (1, n), generator=g))
              for n in (m, 2)] for m in LENGTHS]  # a prompt, then a cycle's committed pair of tokens
    sets = []
    for _ in range(2):
        drafters = [TreeDrafter(module, topk=2, depth=depth, max_pool=max_pool) for _ in LENGTHS]
        for d in drafters:
            d.route_head = routes
        sets.append(drafters)
    return sets, pairs


class Row:
    """A row's generator as ``draft_rows`` sees it: drafts its levels, never stops early unless told."""

    def __init__(self, drafter, pairs, stop_at=None):
        self.drafter, self._pending, self.stop_at = drafter, list(pairs), stop_at

    def begin_draft(self, cycle):
        return None

    def level_drafted(self, tree, cycle):
        return self.stop_at is None or tree.depth < self.stop_at

    def end_draft(self, tree):
        return tree


def alone(drafter, pairs, stop_at=None):
    for f, t in pairs:
        drafter.extend(f, t)
    tree = None
    for tree in drafter.levels():
        if stop_at is not None and tree.depth >= stop_at:
            break
    return tree


def assert_same(a, b, da, db, head):
    assert a.parents == b.parents and a.tokens == b.tokens and a.depths == b.depths and a.ranks == b.ranks
    assert np.allclose(a.path_probs, b.path_probs, rtol=1e-4, atol=1e-6)
    if head:
        na, ra = da.routes()
        nb, rb = db.routes()
        assert np.array_equal(na, nb) and np.array_equal(ra, rb)


@pytest.mark.parametrize("head", [False, True])
def test_rows_drafted_together_draft_what_each_drafts_alone(head):
    (single, together), pairs = rows(head)
    stops = [None, 2, None]  # row 1 stops after level 2, the others draft to the depth
    expected = [alone(d, p, s) for d, p, s in zip(single, pairs, stops)]
    gens = [Row(d, p[:1], s) for d, p, s in zip(together, pairs, stops)]
    catch_up(gens)  # the prompts, ragged, in one forward
    for gen, p in zip(gens, pairs):
        gen._pending.append(p[1])
    trees = draft_rows(gens, [None] * len(gens))  # the cycle's pairs, then the levels
    for a, b, da, db in zip(expected, trees, single, together):
        assert_same(a, b, da, db, head)
        assert da.stable == db.stable and len(da.cache) == len(db.cache)
        assert torch.allclose(da.cache.keys, db.cache.keys, atol=1e-5)
    assert [t.depth for t in trees] == [4, 2, 4]


def test_rows_drafted_together_keep_drafting_next_cycle():
    """A second cycle after the first (the drafted tree's entries dropped, new pairs read) still matches."""
    (single, together), pairs = rows(head=False, depth=3, max_pool=8, seed=1)
    gens = [Row(d, p) for d, p in zip(together, pairs)]
    draft_rows(gens, [None] * 3)
    for d, p in zip(single, pairs):
        alone(d, p)
    more = [(torch.randn(1, 3, 3 * 64), torch.randint(2, 256, (1, 3))) for _ in LENGTHS]
    for gen, pair in zip(gens, more):
        gen._pending.append(pair)
    trees = draft_rows(gens, [None] * 3)
    for a, b, da, db in zip([alone(d, [p]) for d, p in zip(single, more)], trees, single, together):
        assert_same(a, b, da, db, False)


LENGTHS_E2E = (3, 9, 14)  # test_batch_decoding.padded_batch's


@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_left_padded_rows_draft_their_own_prompts_as_alone(monkeypatch, assistant):
    """End to end: each row of a left-padded batch drafts, cycle after cycle, the pool its prompt drafts alone (so
    padding never reaches its drafter), and its drafter cache holds exactly the positions of its own tokens."""
    import specfit
    from test_batch_decoding import padded_batch
    from test_batch_ways import COST, drafter_for

    from specfit.decoding.tree_generators import Eagle3Generator

    pools = {}
    real_end = Eagle3Generator.end_draft

    def end_draft(self, tree):
        pools.setdefault(id(self), []).append((tuple(tree.tokens), tuple(tree.parents), self.drafter.stable,
                                              len(self.drafter.cache)))
        return real_end(self, tree)
    monkeypatch.setattr(Eagle3Generator, "end_draft", end_draft)
    from specfit.decoding.specfit_generator import SpecFitGenerator
    real_sf_end = SpecFitGenerator.end_draft
    monkeypatch.setattr(SpecFitGenerator, "end_draft", lambda self, tree: end_draft(self, tree) and
                        real_sf_end(self, tree))

    def run(ids, mask=None):
        pools.clear()
        model = tiny_moe()
        specfit.enable(model, cache_slots=4, drafter=drafter_for(model), cost_model=COST, route_source="gate",
                       guard=False)
        model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant=assistant)
        # per generator (row), its first three cycles; rows told apart by their drafter's first length
        return {p[0][2]: p[:3] for p in pools.values()}

    ids, mask = padded_batch()
    together = run(ids, mask)
    assert sorted(together) == sorted(LENGTHS_E2E)  # each row's cache: its prompt's pairs (token, next) only
    for b in range(3):
        tokens = int(mask[b].sum())
        alone = run(ids[b:b + 1, mask[b].bool()])[tokens]
        if assistant == "eagle3":
            assert together[tokens] == alone, f"row {b}"
        else:  # SpecFit's rows draft deeper in a batch (levels are cheap there): the levels alone drafted agree, and
            # the subtrees differ from then on (the batch rule chooses), so the first cycle is compared
            (t_tokens, t_parents, t_stable, _), (a_tokens, a_parents, a_stable, _) = together[tokens][0], alone[0]
            n = len(a_tokens)
            assert (t_tokens[:n], t_parents[:n], t_stable) == (a_tokens, a_parents, a_stable), f"row {b}"
