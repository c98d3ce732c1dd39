"""Assistants: the candidate generators that ``generate(..., assistant=NAME)`` looks up by name.

A tree candidate generator owns phases 1 (draft), 2 (select) and 6 (observe) of the decoding loop:

- ``"eagle3"``: drafts the whole pool (top-k expansion to the full depth and node budget) and verifies the tree
  EAGLE-3 itself would verify: the ``max_nodes`` pool nodes with the highest path probability (EAGLE-2's reranking;
  always ancestor-closed). The paper's baseline.
- ``"specfit"``: after each drafted level, runs the SpecFit selector on the pool so far and stops drafting when the
  winning subtree takes no node of the newest level; verifies exactly the winner. The selector's expected tokens
  are path values from the acceptance model (``acceptance="calibrated"``, the default: per-node acceptance
  estimates, learned online from what the target did with every drafted child it scored), or the paper's path
  probabilities (``acceptance="paper"``). The cost of a subtree is what its verify forward computes and copies
  (``cost="cache-aware"``, the default: experts resident in the slot cache cost their compute, the others their
  compute and a copy), or the paper's demand alone (``cost="paper"``). Options: where draft-node routes come from
  (``route_source``), prefetching the winner's experts while the next level is drafted (``prefetch``).

Register your own with ``register_assistant(name, factory)``; ``factory(model)`` returns a ``TreeCandidateGenerator``.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..drafting.levels import TreeDrafter
from ..drafting.tree import DraftTree, VerifyLayout
from ..selection.acceptance_model import AcceptanceModel, AcceptanceTables
from ..selection.profiles import resolve_cost_model
from ..selection.route_sources import Cycle, resolve_route_source
from ..selection.selector import select_subtree, takes_from_level
from .acceptance import Acceptance, child_labels


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

    def start(self, features, next_tokens):
        self.drafter.reset()
        self.drafter.extend(features, next_tokens)

    def observe(self, features, next_tokens):
        self.drafter.extend(features, next_tokens)

    def draft(self, cycle):
        tree = DraftTree()
        for tree in self.drafter.levels():
            pass
        return tree

    def select(self, tree, cycle):
        best = sorted(range(len(tree)), key=lambda v: (-tree.path_probs[v], v))[: self.max_nodes]
        self.expected_tokens = 1.0 + sum(tree.path_probs[v] for v in best)  # EAGLE's own belief: path probabilities
        return tuple(sorted(best))


class SpecFitGenerator(Eagle3Generator):
    def __init__(self, model):
        super().__init__(model)
        runtime = self.runtime = model.specfit
        opts = runtime.options
        self.cost = resolve_cost_model(model)  # priced for this model's link and the option's cost
        if self.cost.max_nodes < self.max_nodes:
            raise ValueError(f"the cost model predicts up to {self.cost.max_nodes} nodes but max_nodes is "
                             f"{self.max_nodes}; recalibrate or lower max_nodes")
        # drafting paid per level actually drafted, when the profile measured it: the model at each depth
        self.level_costs = [self.cost.at_levels(level) for level in range(1, opts.depth + 1)] \
            if self.cost.draft_levels else None
        self.routes = resolve_route_source(model, opts.route_source)
        if hasattr(self.routes, "attach"):  # a predictor runs inside the drafter's levels
            self.routes.attach(self.drafter)
        self.prefetch = opts.prefetch
        self.winner = None
        # kept on the runtime across generate() calls: whether drafting pays is a property of the model, the cache
        # and the workload, not of one call
        if runtime.backoff is None:
            runtime.backoff = Backoff()
        self.backoff = runtime.backoff
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # committed pairs the drafter has not read yet
        self.calibrated = opts.acceptance == "calibrated"
        self.acceptance: AcceptanceModel | None = None  # this cycle's (per decoding mode, kept on the runtime)
        self.values: list[float] = []  # path value of each pool node this cycle
        self.estimates: list[float] = []  # acceptance estimate of each pool node this cycle
        # the root's (demand, misses) for forecasting a cycle that drafts nothing: from the last drafted cycle's
        # routes, or the last root-only forward; first guess: top-k experts per layer, none resident
        top_k = getattr(model.config.get_text_config(decoder=True), "num_experts_per_tok", None) or 1
        self._root = (len(runtime.layers) * int(top_k),) * 2
        self._skipped = False

    def start(self, features, next_tokens):
        """The prompt waits with the committed pairs while drafting is skipped (the backoff carries over from the
        previous call): a call in which drafting never pays runs the drafter only when it probes."""
        self.drafter.reset()
        self._pending = [(features, next_tokens)]
        if not self.backoff.skipping:
            self._catch_up()

    def observe(self, features, next_tokens):
        """While drafting is skipped, committed pairs wait here and reach the drafter in one forward later."""
        self._pending.append((features, next_tokens))
        if not self.backoff.skipping:
            self._catch_up()

    def _catch_up(self) -> None:
        if self._pending:
            features = torch.cat([f for f, _ in self._pending], dim=1)  # [1, m, 3H]
            tokens = torch.cat([t for _, t in self._pending], dim=1)  # [1, m]
            self._pending.clear()
            self.drafter.extend(features, tokens)

    def draft(self, cycle):
        """Draft level by level; stop when the best subtree takes nothing from the newest level. When drafting has
        not paid for itself lately (the winner verified the root alone), skip it for a while: such a cycle is one
        target forward on the root, as in plain decoding."""
        self.winner = None
        self.expected_tokens = 1.0  # a cycle that verifies the root alone commits exactly its bonus token
        if self._skipped:  # the last cycle verified the root alone: its forward's figures are the root's
            last = self.runtime.stats.last_forward
            self._root = (last.demand, last.misses)
        self._skipped = self.backoff.skip()
        if self._skipped:
            self.predicted_seconds = self._predict_root_only()
            return DraftTree()
        self._catch_up()
        cycle.drafter = self.drafter
        self.values, self.estimates = [], []
        if self.calibrated:
            self.acceptance = acceptance_model(self.runtime, cycle.sampling)
        tree = DraftTree()
        resident = self.runtime.resident_mask() if self.cost.copy else None  # [L, E], as this cycle starts
        for tree in self.drafter.levels():
            node_routes, root_routes = self.routes(cycle, tree)  # [N, L, E], [L, E]
            cost = self.level_costs[tree.depth - 1] if self.level_costs else self.cost
            values = self._path_values(tree) if self.calibrated else tree.path_probs
            self.winner = select_subtree(tree.parents, values, node_routes, root_routes, cost, self.max_nodes,
                                         resident=resident)
            if self.prefetch:  # copy what the winner needs while the next level is drafted (residents: kept fresh)
                self.runtime.prefetch(root_routes | node_routes[list(self.winner.nodes)].any(0))
            if not takes_from_level(self.winner, tree.depths, tree.depth):
                break
        self.runtime.expect_tree(values, node_routes)  # the pool: a forecast for the slot caches (offload/policies.py)
        root_demand = int(root_routes.sum())
        self._root = (root_demand, root_demand if resident is None else int((root_routes & ~resident).sum()))
        self.backoff.record(paid=self._paid())
        self.expected_tokens = self.winner.expected_tokens
        self.predicted_seconds = self.winner.predicted_time  # at the levels drafted (level_costs)
        return tree

    def _predict_root_only(self) -> float:
        """The forecast of a cycle that drafts nothing and verifies the root alone (a plain decoding step)."""
        demand, misses = self._root
        if self.level_costs is None:
            return self.cost.predict(0, demand, misses=misses)
        return self.cost.predict(0, demand, levels=0, misses=misses)

    def _path_values(self, tree) -> list[float]:
        """Path values of the pool (the newest level's nodes estimated now): each node's is the product of the
        acceptance estimates of every node on its path, from the root's child down to itself."""
        values, estimates, predict = self.values, self.estimates, self.acceptance.predict
        parents, depths, ranks, qs = tree.parents, tree.depths, tree.ranks, tree.qs
        for v in range(len(values), len(tree)):
            a = predict(depths[v], ranks[v], qs[v])
            estimates.append(a)
            values.append(a if parents[v] < 0 else values[parents[v]] * a)
        return values

    def learn(self, tree, layout, acc, choices, sampling):
        """Feed the acceptance model this cycle's labels (and the runtime's ``acceptance_log``, when it is a list:
        ``(depth, rank, q, estimate, label)`` per labelled child, the estimate made before the label was known)."""
        if not self.calibrated or not len(tree):
            return
        nodes, labels = child_labels(tree, layout, acc, choices, sampling)
        if not nodes:
            return
        depths, ranks, qs = tree.depths, tree.ranks, tree.qs
        self.acceptance.update([(depths[v], ranks[v], qs[v], y) for v, y in zip(nodes, labels)])
        log = self.runtime.acceptance_log
        if log is not None:
            log += [(depths[v], ranks[v], qs[v], self.estimates[v], y) for v, y in zip(nodes, labels)]

    def _paid(self) -> bool:
        """Whether this cycle's drafting paid for itself: its winner verifies draft nodes and, when the profile
        prices drafting per level, predicts more tokens per second than a cycle that drafts nothing."""
        if not self.winner.nodes:
            return False
        if self.level_costs is None:
            return True
        return self.winner.ratio * self._predict_root_only() > 1.0

    def select(self, tree, cycle):
        return self.winner.nodes if self.winner is not None else ()


def acceptance_model(runtime, sampling: bool) -> AcceptanceModel:
    """The runtime's online acceptance model for a decoding mode, made from its tables on first use (the tables of
    the drafter, ``runtime.acceptance_tables``, else the default prior) and kept across generate() calls, so what
    it learned carries over; made anew when the tables are replaced."""
    mode = "sampling" if sampling else "greedy"
    tables = runtime.acceptance_tables
    if tables is None:
        tables = runtime.acceptance_tables = AcceptanceTables.default()
    model = runtime.acceptance_models.get(mode)
    if model is None or model.table is not tables[mode]:
        model = runtime.acceptance_models[mode] = AcceptanceModel(tables[mode])
    return model


class Backoff:
    """When to skip drafting: after ``k`` drafted cycles in a row that did not pay (the winner was the root alone, or
    predicted fewer tokens per second than not drafting at all), the next ``2**(k-1)`` cycles skip drafting (at most
    ``most``); then drafting is probed again. A cycle that pays halves ``k`` (so a run of them resets it)."""

    def __init__(self, most: int = 32):
        self.most, self.failures, self.left = most, 0, 0

    @property
    def skipping(self) -> bool:
        return self.left > 0

    def skip(self) -> bool:
        """Called once per cycle: True when this cycle skips drafting."""
        if self.left > 0:
            self.left -= 1
            return True
        return False

    def record(self, paid: bool) -> None:
        if paid:  # one paying cycle halves the ladder: a lone success amid failures does not restart it
            self.failures //= 2
        else:
            self.failures += 1
            self.left = min(2 ** (self.failures - 1), self.most)


ASSISTANTS: dict[str, Callable] = {"eagle3": Eagle3Generator, "specfit": SpecFitGenerator}


def register_assistant(name: str, factory: Callable, *, replace: bool = False) -> None:
    """Make ``generate(..., assistant=name)`` use ``factory(model) -> TreeCandidateGenerator``."""
    if not isinstance(name, str) or not name or name != name.lower() or not name.replace("-", "_").isidentifier():
        raise ValueError(f"assistant names are lowercase identifiers (dashes allowed), got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory for assistant {name!r} must be callable: factory(model) -> generator")
    if name in ASSISTANTS and not replace:
        raise ValueError(f"assistant {name!r} is already registered; pass replace=True to override it")
    ASSISTANTS[name] = factory


def resolve_assistant(name) -> Callable:
    """A registered name, or a factory itself: ``factory(model) -> TreeCandidateGenerator``."""
    if callable(name):
        return name
    if name not in ASSISTANTS:
        raise ValueError(f"unknown assistant {name!r}; registered: {sorted(ASSISTANTS)}")
    return ASSISTANTS[name]
