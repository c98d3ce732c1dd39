"""The rows of a batch: one candidate generator per row (its own drafter state), their pools and chosen subtrees,
and the batch's output padded as plain ``generate()`` pads it."""

from __future__ import annotations

import numpy as np
import torch

from ..drafting.tree import DraftTree
from ..drafting.drafter import Eagle3Drafter
from ..selection.batch_rule import RowPool, select_batch
from .batch_drafting import draft_rows
from .batch_ways import BatchWays
from .learned_state import Backoff
from .specfit_generator import SpecFitGenerator
from .tree_generators import Eagle3Generator


class RowTrees:
    """One generator per prompt row (``assistant(model)``), each drafting from its own committed tokens; the
    drafter module is shared (its per-row state is the row's ``TreeDrafter`` cache). SpecFit's rows run every cycle
    one way, the batch's (``batch_ways.py``), and are priced together by the batch rule."""

    def __init__(self, model, assistant, rows: int):
        self.runtime = model.specfit
        self.gens = [assistant(model) for _ in range(rows)]
        # the rows draft together when the drafter's forward takes stacked rows (a custom drafter module keeps the
        # batch-1 protocol: each row drafts alone)
        # (and a generator that drafts by its three steps, not its own ``draft``)
        self.batched = isinstance(self.runtime.drafter, Eagle3Drafter) and all(
            isinstance(g, Eagle3Generator) and type(g).draft is Eagle3Generator.draft for g in self.gens)
        self.ways = None  # SpecFit's rows: the batch's way per cycle, its forecast and what its clock teaches
        if all(isinstance(g, SpecFitGenerator) for g in self.gens):
            for gen in self.gens:
                gen.guard = None  # the batch's guard picks every row's way (batch_ways.py)
                # each row its own backoff, for this call: rows sharing the runtime's would each call skip() once
                # per cycle (shortening its skips R-fold, rows disagreeing) and leave it wrong for batch-1 calls
                gen.backoff = Backoff()
                # a row's own winner is not what the batch verifies (the batch rule re-chooses): rows prefetching
                # their own winners would fight over the same slots
                gen.prefetch = False
                gen.together = self.batched  # drafted together: SpecFit's way at EAGLE-3's price (batch_drafting)
            first = self.gens[0]
            top_k = getattr(model.config.get_text_config(decoder=True), "num_experts_per_tok", None) or 1
            self.ways = BatchWays(self.runtime, first.refresh.base if first.refresh is not None else first.cost,
                                  first.cost, len(self.runtime.layers), int(top_k))
        self.pool, self.expected, self.predicted = 0, 0.0, None
        self.last = None  # the batch rule's last BatchSelection
        self.row_nodes: tuple[int, ...] = ()  # draft nodes each row in flight verifies this cycle
        self.row_levels: tuple[int, ...] = ()  # levels each row in flight drafted this cycle
        # a generator may bring its own batch rule and way (calibrate's batch probes: scheduled subtrees, SpecFit's
        # way every cycle); else the batch rule, and the guard's way
        self.rule = getattr(self.gens[0], "batch_rule", None) or select_batch
        self._priced = None  # (rows, nodes, levels, drafted, (demand, cold)): what this cycle's forecast priced

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
        or, with SpecFit's, the cycle runs the batch's way: plain (no row drafts), EAGLE-3's, or SpecFit's (the batch
        rule re-chooses every row's subtree against the batch's union)."""
        gens = [self.gens[b] for b in active]
        way = self.ways.choose(len(active), getattr(gens[0], "batch_way", None)) if self.ways is not None else None
        if way == "plain":  # no row drafts: their committed pairs wait for the next drafted cycle
            for gen in gens:
                gen.arm, gen.nodes, gen.levels, gen.expected_tokens = "plain", (), 0, 1.0
            chosen = [(DraftTree(), ()) for _ in gens]
        else:
            for gen in gens if way is not None else ():
                gen.way = way
            if self.batched:  # one drafter forward per step for every row
                trees = draft_rows(gens, cycles)
            else:
                trees = [gen.draft(cycle) for gen, cycle in zip(gens, cycles)]
            chosen = [(tree, tuple(sorted(gen.select(tree, cycle)))) for gen, tree, cycle in zip(gens, trees, cycles)]
        self.pool = sum(len(tree) for tree, _ in chosen)
        self.expected = sum(gen.expected_tokens for gen in gens)
        self.predicted = None
        self.row_levels = tuple(getattr(gen, "levels", 0) if len(tree) else 0 for gen, (tree, _) in zip(gens, chosen))
        if self.ways is None:
            self.row_nodes = tuple(len(nodes) for _, nodes in chosen)
            return chosen
        drafting = [gen for gen, (tree, _) in zip(gens, chosen) if len(tree)]
        levels, drafted = max((g.levels for g in drafting), default=0), sum(g.levels for g in drafting)
        if way == "specfit" and drafting:
            chosen = self._batch_rule(gens, cycles, chosen, levels, drafted)
            for gen, (tree, nodes) in zip(gens, chosen):
                if len(tree):  # the row's backoff learns whether the batch took its tree; its next depth follows
                    gen.backoff.record(paid=bool(nodes))
                    gen.batch_depth = max(1, min(gen.depth, 1 + max((tree.depths[v] for v in nodes), default=0)))
        else:
            nodes = sum(len(n) for _, n in chosen)
            self.predicted, demand, cold = self.ways.forecast(len(active), nodes, levels, drafted)
            self._priced = (len(active), nodes, levels, drafted, (demand, cold))
        self.row_nodes = tuple(len(nodes) for _, nodes in chosen)
        return chosen

    def _batch_rule(self, gens, cycles, chosen, levels: int, drafted: int):
        """Every row's pool, values and routes priced together (``selection/batch_rule.py``) by the batch cost
        model at the levels the rows drafted; the slot caches' forecast is every row's pool."""
        pools, values_all, routes_all = [], [], []
        for gen, cycle, (tree, _) in zip(gens, cycles, chosen):
            if not len(tree):  # this row drafted nothing (its backoff): it verifies its root alone
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
        cost, rows = self.ways.cost, len(gens)
        intercepts = cost.tokens_table(rows, sum(p.max_nodes for p in pools), levels, drafted)
        resident = self.runtime.resident_mask() if cost.miss else None
        self.last = pick = self.rule(pools, intercepts, cost.beta, cost.miss, resident)
        self.runtime.expect_tree(values_all, np.concatenate(routes_all))  # the forecast: every row's pool
        self.expected, self.predicted = pick.expected_tokens, pick.predicted_time
        self._priced = (rows, sum(len(n) for n in pick.nodes), levels, drafted, (pick.demand, pick.misses))
        return [(tree, nodes) for (tree, _), nodes in zip(chosen, pick.nodes)]

    def timed(self, active, seconds: float, forward, committed: list[int]) -> dict:
        """A batch cycle's clock belongs to every row at once: no row's cost model learns from it; the batch's guard
        learns it under the way it ran, and the batch cost model from what its forecast priced. Returns the
        ``Counters`` fields it counts."""
        counts = {"batch_row_cycles": len(active)}
        if self.ways is None:
            return counts
        rows, nodes, levels, drafted, priced = self._priced
        self.ways.learn(rows, nodes, levels, drafted, priced, forward, sum(committed), seconds)
        way = self.ways.way
        counts["guard_eagle_cycles" if way == "eagle3" else f"{way}_cycles"] = 1
        if way == "specfit":
            counts["plain_row_cycles"] = sum(1 for b in active if self.gens[b].arm == "plain")
        return counts


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


def new_tokens(sequences: torch.Tensor, prompt: int, config) -> int:
    """The new tokens of plain ``generate()``'s output ``sequences`` [B, prompt + N]: each row's through its first
    end-of-sequence token (transformers fills a row that stopped early with padding, which counts as no token), all
    N for a row that ran to the end. One transfer, after the call."""
    if sequences.shape[0] == 1:
        return sequences.shape[1] - prompt
    eos = config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else () if eos is None else (eos,))
    total = 0
    for row in sequences[:, prompt:].tolist():
        total += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return total
