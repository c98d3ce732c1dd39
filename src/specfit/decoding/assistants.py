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
  compute and a copy, or their time on the host lane, as ``cold=`` computes them), or the paper's demand alone
  (``cost="paper"``). Options: where draft-node routes come from
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
from ..selection.cost_refresh import DECAY, CostRefresh
from ..selection.profiles import link_seconds, profile_source, resolve_cost_model
from ..selection.route_sources import Cycle, resolve_route_source
from ..selection.selector import select_subtree, takes_from_level
from .acceptance import Acceptance, child_labels
from .guard import Guard


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


class SpecFitGenerator(Eagle3Generator):
    def __init__(self, model):
        super().__init__(model)
        runtime = self.runtime = model.specfit
        opts = runtime.options
        self.depth = opts.depth
        cost = resolve_cost_model(model)  # priced for this model's link and the option's cost
        if cost.max_nodes < self.max_nodes:
            raise ValueError(f"the cost model predicts up to {cost.max_nodes} nodes but max_nodes is "
                             f"{self.max_nodes}; recalibrate or lower max_nodes")
        # refreshed online from the cycles it forecasts, kept on the runtime across calls (selection/cost_refresh.py)
        self.refresh = online_refresh(runtime, cost, opts)
        self.source = profile_source(model) or "given"
        self._use(self.refresh.model if self.refresh is not None else cost)
        self.levels = 0  # levels drafted this cycle
        # which way each cycle runs, SpecFit's, EAGLE-3's or plain, by the clock (decoding/guard.py); on the runtime
        self.guard = dominance_guard(runtime, opts)
        self.arm = "specfit"  # the way this cycle runs: "specfit", "eagle3" or "plain" (drafting skipped)
        self.nodes: tuple[int, ...] = ()  # the subtree this cycle verifies
        self._eagle = [0.0, 0.0, None]  # EAGLE-3's way: decayed real and forecast seconds, last (demand, misses)
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
        self.calibrated = opts.acceptance == "calibrated"
        self.acceptance: AcceptanceModel | None = None  # this cycle's (per decoding mode, kept on the runtime)
        self.values: list[float] = []  # path value of each pool node this cycle
        self.estimates: list[float] = []  # acceptance estimate of each pool node this cycle
        # the root's (demand, misses) for forecasting a cycle that drafts nothing: from the last drafted cycle's
        # routes, or the last root-only forward; first guess: top-k experts per layer, none resident
        top_k = getattr(model.config.get_text_config(decoder=True), "num_experts_per_tok", None) or 1
        self._root = (len(runtime.layers) * int(top_k),) * 2
        self._skipped = False
        self._resident, self._level = None, None  # this cycle's resident mask and its newest level's pricing
        self._forecast_on = self._root  # (demand, misses) the cycle's forecast priced: the refresh learns on them

    def start(self, features, next_tokens):
        """The prompt waits with the committed pairs until the next cycle drafts (``_catch_up``)."""
        self.drafter.reset()
        self._pending = [(features, next_tokens)]

    def observe(self, features, next_tokens):
        """Committed pairs wait here and reach the drafter in one forward when the next cycle drafts: a cycle that
        drafts pays exactly one drafter forward for what was committed before it, however many plain cycles (drafting
        skipped) ran since, and a plain cycle pays none. So the clock of each way is its own: the cost refresh and
        the guard never charge a drafted cycle for the plain cycles before it."""
        self._pending.append((features, next_tokens))

    def begin_draft(self, cycle):
        """Draft level by level; stop when the best subtree takes nothing from the newest level. When drafting has
        not paid for itself lately (the winner verified the root alone), skip it for a while: such a cycle is one
        target forward on the root, as in plain decoding. When the guard says EAGLE-3's way pays more now, draft
        and verify as EAGLE-3 does (``_draft_as_eagle``)."""
        self.winner, self.nodes = None, ()
        self.expected_tokens = 1.0  # a cycle that verifies the root alone commits exactly its bonus token
        if self._skipped:  # the last cycle verified the root alone: its forward's figures are the root's
            last = self.runtime.stats.last_forward
            self._root = (last.demand, last.misses + last.host_experts)  # its cold experts: copied or on the host
        self.levels = 0
        if self.guard is not None:  # the guard picks the way; its "plain" arm replaces the backoff
            self.arm = self.guard.choose()
        else:
            self.arm = "plain" if self.backoff.skip() else "specfit"
        self._skipped = self.arm == "plain"
        if self.arm == "eagle3":
            return self._draft_as_eagle(cycle)
        if self._skipped:
            self.predicted_seconds = self._predict_root_only()
            self._forecast_on = self._root
            return DraftTree()
        cycle.drafter = self.drafter
        self.values, self.estimates = [], []
        if self.calibrated:
            self.acceptance = acceptance_model(self.runtime, cycle.sampling)
        self._resident = self.runtime.resident_mask() if self.cost.miss else None  # [L, E], as this cycle starts
        return None

    def level_drafted(self, tree, cycle):
        node_routes, root_routes = self.routes(cycle, tree)  # [N, L, E], [L, E]
        cost = self.level_costs[tree.depth - 1] if self.level_costs else self.cost
        values = self._path_values(tree) if self.calibrated else tree.path_probs
        self.winner = select_subtree(tree.parents, values, node_routes, root_routes, cost, self.max_nodes,
                                     resident=self._resident)
        self._level = (values, node_routes, root_routes)
        if self.prefetch:  # copy what the winner needs while the next level is drafted (residents: kept fresh)
            self.runtime.prefetch(root_routes | node_routes[list(self.winner.nodes)].any(0))
        return takes_from_level(self.winner, tree.depths, tree.depth)

    def end_draft(self, tree):
        values, node_routes, root_routes = self._level
        resident = self._resident
        self.levels = tree.depth
        self.runtime.expect_tree(values, node_routes)  # the pool: a forecast for the slot caches (offload/policies.py)
        root_demand = int(root_routes.sum())
        self._root = (root_demand, root_demand if resident is None else int((root_routes & ~resident).sum()))
        if self.guard is None:
            self.backoff.record(paid=self._paid())
        self.nodes = self.winner.nodes
        self._forecast_on = (self.winner.demand, self.winner.misses)
        self.expected_tokens = self.winner.expected_tokens
        self.predicted_seconds = self.winner.predicted_time  # at the levels drafted (level_costs)
        return tree

    def _draft_as_eagle(self, cycle) -> DraftTree:
        """EAGLE-3's way: the full pool drafted without routes (the nodes the next level expands only), its
        ``max_nodes`` nodes of highest path probability verified. Path values still feed the acceptance model; the
        forecast is the cost model's at the node count and levels, with the demand and misses of the last such
        cycle, scaled by how such cycles' forecasts met the clock."""
        self._catch_up()
        head, self.drafter.route_head = self.drafter.route_head, None
        try:
            tree = DraftTree()
            for tree in self.drafter.levels():
                pass
        finally:
            self.drafter.route_head = head
        self.nodes = eagle_tree(tree.path_probs, self.max_nodes)
        self.levels = tree.depth
        if self.calibrated:
            self.acceptance = acceptance_model(self.runtime, cycle.sampling)
            self.values, self.estimates = [], []
            values = self._path_values(tree)
        else:
            values = tree.path_probs
        self.expected_tokens = 1.0 + sum(values[v] for v in self.nodes)
        real, forecast, seen = self._eagle
        demand, misses = seen if seen is not None else (self._root[0] * (1 + len(self.nodes) // 2),
                                                         self._root[1] * (1 + len(self.nodes) // 2))
        cost = self.level_costs[self.levels - 1] if self.level_costs and self.levels else self.cost
        raw = cost.predict(len(self.nodes), demand, misses=misses)
        self._eagle_raw = raw
        self.predicted_seconds = raw * (real / forecast if forecast > 0 else 1.0)
        return tree

    def _use(self, cost) -> None:
        """Price with ``cost``: drafting paid per level actually drafted, when the model has it (the model at each
        depth); the stats name the profile and how far it was refreshed."""
        self.cost = cost
        self.level_costs = [cost.at_levels(level) for level in range(1, self.depth + 1)] \
            if cost.draft_levels else None
        self.runtime.stats.cost_profile = self.source + (
            f"; refreshed online by {self.refresh.cycles} cycles" if self.refresh is not None
            else "; frozen (no online refresh)")

    def timed(self, seconds, forward, committed) -> dict:
        """The guard learns what this cycle committed and took under the way it ran (SpecFit's, EAGLE-3's or plain).
        A cycle run SpecFit's way or plain refreshes the cost model online: its node count, levels drafted (0 for
        plain) and wall clock, and the demand and misses its forecast priced (from the routes the selector saw, so
        the refit also absorbs how the route source errs); a refit re-prices the selector from the next cycle on. A
        cycle run EAGLE-3's way corrects that way's forecast."""
        if self.guard is not None:
            self.guard.record(self.arm, committed, seconds)
        if self.arm == "eagle3":
            real, forecast, _ = self._eagle
            self._eagle = [DECAY * real + seconds, DECAY * forecast + self._eagle_raw,
                           (forward.demand, forward.misses)]
            return {"guard_eagle_cycles": 1}
        if self.refresh is None or self.predicted_seconds is None:
            return {}
        demand, misses = self._forecast_on  # what the forecast saw: the refit learns the clock of the selector's view
        if self.refresh.record(len(self.nodes), demand, misses, self.levels, seconds):
            self._use(self.refresh.model)
        return {"cost_refresh_cycles": 1}

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
        return self.nodes


def eagle_tree(path_probs, max_nodes: int) -> tuple[int, ...]:
    """EAGLE-3's verified tree: the ``max_nodes`` pool nodes of highest path probability (ancestor-closed: a child's
    path probability never exceeds its parent's, and ties go to the earlier node, a parent), sorted."""
    return tuple(sorted(sorted(range(len(path_probs)), key=lambda v: (-path_probs[v], v))[:max_nodes]))


def dominance_guard(runtime, options) -> Guard | None:
    """The runtime's dominance guard for these options, made on first use and kept across generate() calls (made
    anew when the options change); None when ``guard=False``."""
    if not options.guard:
        return None
    kept = runtime.guard
    if kept is None or kept[0] is not options:
        kept = runtime.guard = (options, Guard())
    return kept[1]


def online_refresh(runtime, cost, options) -> CostRefresh | None:
    """The runtime's online refresh of ``cost`` (a priced profile), made on first use and kept across generate()
    calls while the profile, its pricing of a cold expert and the drafting depth stay the same; None where it does
    not apply: the option is off, ``cost="paper"`` (the paper's frozen model), or a profile without copies or
    drafting per level. A cold expert is refreshed along the path the selector prices it by (``miss_path``)."""
    if not options.cost_refresh or options.cost != "cache-aware" or not cost.prices_copies \
            or not cost.draft_levels:
        return None
    lane, parts = miss_path(runtime, cost)
    key = (cost.intercepts, cost.beta, cost.copy_overhead, cost.link_share, cost.draft_level_seconds, cost.cold,
           cost.host_overhead, cost.host_share, lane, options.depth)
    refresh = runtime.cost_refresh
    if refresh is None or refresh.key != key:
        refresh = runtime.cost_refresh = CostRefresh(cost, lane, options.depth, key=key, miss_parts=parts)
    return refresh


def miss_path(runtime, cost) -> tuple[float, tuple[float, float]]:
    """(the own seconds per expert, (overhead, share)) of the way ``cost`` prices a cold expert (``cost.miss``): the
    link's copy, or the host lane's time (an unfitted lane: overhead 0, share 1)."""
    on_host = cost.cold == "host" or (cost.cold == "auto" and cost.host is not None and cost.host < cost.copy)
    if not on_host:
        return link_seconds(runtime), (cost.copy_overhead, cost.link_share)
    parts = (cost.host_overhead, cost.host_share) if cost.prices_host else (0.0, 1.0)
    return runtime.host_seconds(), parts


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
# "acceptance-oracle" is registered by decoding/oracle.py, which decoding/strategy.py imports


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
