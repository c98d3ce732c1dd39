"""The tree candidate generators' protocol (``TreeCandidateGenerator``) and EAGLE-3's generator: it drafts the whole
pool (top-k expansion to the full depth and node budget) and verifies the tree EAGLE-3 itself would verify, the
``max_nodes`` pool nodes with the highest path probability (EAGLE-2's reranking; always ancestor-closed)."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..drafting.levels import TreeDrafter
from ..drafting.tree import DraftTree, VerifyLayout
from ..selection.route_sources import Cycle
from .acceptance import Acceptance


class TreeCandidateGenerator(CandidateGenerator):
    """A transformers ``CandidateGenerator`` that proposes a *tree* and the subtree of it to verify.

    transformers' own ``get_candidates`` returns one linear continuation for its chain-only assisted decoding; a tree
    does not fit that shape, so SpecFit's loop calls ``start``/``draft``/``select``/``learn``/``observe`` instead
    and ``get_candidates`` is not provided.
    """

    expected_tokens: float = 0.0  # tokens the cycle just selected is expected to commit (0.0: no estimate)
    predicted_seconds: float | None = None  # the cost model's forecast of the cycle just selected (None: none)

    def start(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """After prefill: target features [1, P, 3H] of the prompt and the token after each ([1, P])."""
        raise NotImplementedError

    def draft(self, cycle: Cycle) -> DraftTree:
        raise NotImplementedError

    def select(self, tree: DraftTree, cycle: Cycle) -> tuple[int, ...]:
        raise NotImplementedError

    def learn(self, tree: DraftTree, layout: VerifyLayout, acc: Acceptance, choices: list[int] | None,
              sampling: bool) -> None:
        """After acceptance: what the target did at the tree positions it scored (see ``child_labels``).
        ``choices``: the target's token at every tree position when the loop has them on the host (plain greedy),
        else None. Does nothing unless a generator learns from it."""

    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """After acceptance: features [1, m, 3H] of the committed tokens newly in the KV cache and the token after
        each ([1, m]; the last is the bonus token, the next root)."""
        raise NotImplementedError

    def timed(self, seconds: float, forward, committed: int) -> dict:
        """At the end of a cycle: its wall clock, its verify forward's ``Counters`` (demand, misses) and the tokens it
        committed. Returns ``Counters`` fields to add for it (SpecFit: ``{"cost_refresh_cycles": 1}`` when its cost
        model learned from the cycle); the default learns nothing."""
        return {}

    def update_candidate_strategy(self, input_ids, scores, num_matches):  # transformers' hook; trees adapt in draft()
        pass


class Eagle3Generator(TreeCandidateGenerator):
    def __init__(self, model):
        runtime = model.specfit
        if runtime.drafter is None:
            raise ValueError("no drafter attached: pass drafter=PATH_OR_MODULE to specfit.enable(...)")
        opts = runtime.options
        self.max_nodes = opts.max_nodes
        self.drafter = TreeDrafter(runtime.drafter, opts.topk, opts.depth, opts.pool_nodes)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # committed pairs the drafter has not read yet

    def start(self, features, next_tokens):
        self.drafter.reset()
        self.drafter.extend(features, next_tokens)

    def observe(self, features, next_tokens):
        self.drafter.extend(features, next_tokens)

    def _catch_up(self) -> None:
        """The committed pairs waiting in ``_pending`` (SpecFit's way, and a batch's rows: ``batch_drafting.py``)
        reach the drafter in one forward."""
        if len(self._pending) == 1:  # the usual case (the last cycle drafted): no copy
            features, tokens = self._pending.pop()
            self.drafter.extend(features, tokens)
        elif self._pending:
            features = torch.cat([f for f, _ in self._pending], dim=1)  # [1, m, 3H]
            tokens = torch.cat([t for _, t in self._pending], dim=1)  # [1, m]
            self._pending.clear()
            self.drafter.extend(features, tokens)

    def draft(self, cycle):
        tree = self.begin_draft(cycle)
        if tree is not None:
            return tree
        self._catch_up()
        tree = DraftTree()
        for tree in self.drafter.levels():
            if not self.level_drafted(tree, cycle):
                break
        return self.end_draft(tree)

    # a cycle's drafting in three steps, so that a batch drafts every row's levels in one forward each
    # (``decoding/batch_drafting.py``): begin (None: levels follow, after ``_catch_up``; else the cycle's tree),
    # one call per drafted level (False: stop drafting), end
    def begin_draft(self, cycle) -> DraftTree | None:
        return None

    def level_drafted(self, tree: DraftTree, cycle) -> bool:
        return True

    def end_draft(self, tree: DraftTree) -> DraftTree:
        return tree

    def select(self, tree, cycle):
        best = eagle_tree(tree.path_probs, self.max_nodes)
        self.expected_tokens = 1.0 + sum(tree.path_probs[v] for v in best)  # EAGLE's own belief: path probabilities
        return best



def eagle_tree(path_probs, max_nodes: int) -> tuple[int, ...]:
    """EAGLE-3's verified tree: the ``max_nodes`` pool nodes of highest path probability (ancestor-closed: a child's
    path probability never exceeds its parent's, and ties go to the earlier node, a parent), sorted."""
    return tuple(sorted(sorted(range(len(path_probs)), key=lambda v: (-path_probs[v], v))[:max_nodes]))

