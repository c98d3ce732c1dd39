"""The rows of a batch: one candidate generator per row (its own drafter state), their pools and chosen subtrees,
and the batch's output padded as plain ``generate()`` pads it."""

from __future__ import annotations

import numpy as np
import torch

from ..drafting.tree import DraftTree
from ..selection.batch_rule import RowPool, fixed_time, select_batch
from ..drafting.drafter import Eagle3Drafter
from .assistants import Backoff, Eagle3Generator, SpecFitGenerator
from .batch_drafting import draft_rows


EXTRA_RATE = 0.3  # weight of the newest cycle in the learned unexplained seconds


class RowTrees:
    """One generator per prompt row (``assistant(model)``), each drafting from its own committed tokens; the
    drafter module is shared (its per-row state is the row's ``TreeDrafter`` cache)."""

    def __init__(self, model, assistant, rows: int):
        self.runtime = model.specfit
        self.gens = [assistant(model) for _ in range(rows)]
        # the rows draft together when the drafter's forward takes stacked rows (a custom drafter module keeps the
        # batch-1 protocol: each row drafts alone)
        # (and a generator that drafts by its three steps, not its own ``draft``)
        self.batched = isinstance(self.runtime.drafter, Eagle3Drafter) and all(
            isinstance(g, Eagle3Generator) and type(g).draft is Eagle3Generator.draft for g in self.gens)
        self.batch_rule = all(isinstance(g, SpecFitGenerator) for g in self.gens)
        for gen in self.gens:
            if isinstance(gen, SpecFitGenerator):
                gen.guard = None  # the guard learns one row's clock; a batch cycle's clock is every row's
                # each row its own backoff, for this call: rows sharing the runtime's would each call skip() once
                # per cycle (shortening its skips R-fold, rows disagreeing) and leave it wrong for batch-1 calls
                gen.backoff = Backoff()
                # a row's own winner is not what the batch verifies (the batch rule re-chooses): rows prefetching
                # their own winners would fight over the same slots
                gen.prefetch = False
        self.pool, self.expected, self.predicted = 0, 0.0, None
        self.last = None  # the batch rule's last BatchSelection
        # seconds per batch cycle the profile does not explain (every row's drafting, selection and bookkeeping in
        # Python), learned from the clock of the cycles the batch rule priced and charged as fixed time
        self.extra, self._priced = 0.0, None

    def start(self, b: int, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Row b's prompt pairs: drafted together, they wait for the next cycle's one catch-up forward for every
        row; else the row's generator reads them."""
        if self.batched:
            self.gens[b].drafter.reset()
            self.gens[b]._pending = [(features, next_tokens)]
        else:
            self.gens[b].start(features, next_tokens)

    def observe(self, b: int, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        if self.batched:
            self.gens[b]._pending.append((features, next_tokens))
        else:
            self.gens[b].observe(features, next_tokens)

    def draft_and_select(self, active: list[int], cycles) -> list[tuple[DraftTree, tuple[int, ...]]]:
        """Every active row's pool and the subtree of it to verify: each row's generator decides alone (EAGLE-3),
        or, with SpecFit's, the batch rule re-chooses every row's subtree against the batch's union."""
        gens = [self.gens[b] for b in active]
        if self.batched:  # one drafter forward per step for every row
            trees = draft_rows(gens, cycles)
        else:
            trees = [gen.draft(cycle) for gen, cycle in zip(gens, cycles)]
        chosen = [(tree, tuple(sorted(gen.select(tree, cycle)))) for gen, tree, cycle in zip(gens, trees, cycles)]
        self.pool = sum(len(tree) for tree, _ in chosen)
        self.expected = sum(self.gens[b].expected_tokens for b in active)
        self.predicted = None
        if self.batch_rule and len(active) > 1 and any(len(tree) for tree, _ in chosen):
            chosen = self._batch_rule(active, cycles, chosen)
        elif self.batch_rule:
            self.predicted = self._predict_roots(active)
        return chosen

    def _predict_roots(self, active) -> float | None:
        """The forecast of a cycle the batch rule did not price: one row left (its own forecast), or every row
        verifying its root alone (a plain batch step: the roots' fixed time, with the demand and cold experts of the
        batch's last forward, which each row's generator keeps as its root's)."""
        gen = self.gens[active[0]]
        if len(active) == 1:
            return gen.predicted_seconds
        cost = gen.cost
        intercepts = cost.at_levels(0).intercepts if cost.draft_levels else cost.intercepts
        demand, misses = gen._root
        return fixed_time(intercepts, len(active)) + cost.beta * demand + cost.miss * misses

    def _batch_rule(self, active, cycles, chosen):
        """Every row's pool, values and routes priced together (``selection/batch_rule.py``); the slot caches'
        forecast is every row's pool."""
        pools, values_all, routes_all = [], [], []
        gens = [self.gens[b] for b in active]
        levels = max(g.levels for g in gens)
        for gen, cycle, (tree, _) in zip(gens, cycles, chosen):
            if not len(tree):  # this row skipped drafting (its backoff): it verifies its root alone
                pools.append(None)
                continue
            node_routes, root_routes = gen.routes(cycle, tree)  # [N, L, E], [L, E] (host, kept by the drafter)
            values = list(gen.values) if gen.calibrated else list(tree.path_probs)
            pools.append(RowPool(tree.parents, values, node_routes, root_routes, gen.max_nodes))
            values_all += values
            routes_all.append(node_routes)
        shape = next(p.root_routes.shape for p in pools if p is not None)
        pools = [p if p is not None else RowPool([], [], np.zeros((0, *shape), bool), np.zeros(shape, bool), 0)
                 for p in pools]
        cost = gens[0].cost
        drafting = cost.drafting_seconds(levels) if cost.draft_levels and levels else 0.0
        base = cost.at_levels(levels).intercepts if cost.draft_levels and levels else cost.intercepts
        intercepts = [a + (0 if self.batched else (len(active) - 1) * drafting) + self.extra
                      for a in base]  # drafted together: one drafter forward per level for every row
        resident = self.runtime.resident_mask() if cost.miss else None
        self.last = pick = select_batch(pools, intercepts, cost.beta, cost.miss, resident)
        self.runtime.expect_tree(values_all, np.concatenate(routes_all))  # the forecast: every row's pool
        self.expected, self.predicted = pick.expected_tokens, pick.predicted_time
        self._priced = pick.predicted_time - self.extra  # the profile's part, which the residual is learned against
        return [(tree, nodes) for (tree, _), nodes in zip(chosen, pick.nodes)]

    def timed(self, active, seconds, forward, committed) -> None:
        """A batch cycle's clock belongs to every row at once: no row's cost model learns from it; the batch rule
        learns what its forecast left out, per cycle (a decayed mean of clock minus forecast, at least 0)."""
        if self._priced is not None:
            residual = seconds - self._priced
            self.extra = max(0.0, residual if self.extra == 0.0 else (1 - EXTRA_RATE) * self.extra +
                             EXTRA_RATE * residual)
        self._priced = None


def pad_token(config) -> int:
    """The token padding fills with: the generation config's pad token, else its first EOS token, else 0."""
    for value in (getattr(config, "_pad_token_tensor", None), config.pad_token_id, config.eos_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, torch.Tensor):
            value = value.reshape(-1)[0].item() if value.numel() else None
        if value is not None:
            return int(value)
    return 0


def padded_sequences(runs, config, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, longest] every row's tokens, the shorter rows filled with the pad token after they stopped (as plain
    ``generate()`` fills a finished row)."""
    longest = max(run.length for run in runs)
    fill = pad_token(config)
    rows = [run.tokens + [fill] * (longest - run.length) for run in runs]
    return torch.tensor(rows, dtype=input_ids.dtype, device=input_ids.device)
