"""SpecFit's candidate generator (``assistant="specfit"``): drafts level by level, runs the SpecFit selector on the
pool after each level and stops when the winner takes nothing from the newest level; verifies exactly the winner.
Each cycle runs one of three ways, as the dominance guard says (``guard.py``): SpecFit's, EAGLE-3's, or plain."""

from __future__ import annotations

from ..drafting.tree import DraftTree
from ..selection.acceptance_model import AcceptanceModel
from ..selection.cost_refresh import DECAY
from ..selection.profiles import profile_source, resolve_cost_model
from ..selection.route_sources import resolve_route_source
from ..selection.selector import select_subtree, takes_from_level
from .acceptance import child_labels
from .learned_state import Backoff, acceptance_model, dominance_guard, online_refresh
from .tree_generators import Eagle3Generator, eagle_tree


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
        self.way = None  # a batch row: the way the batch runs this cycle (decoding/batch_rows.py); None alone
        self._head = None  # the route head, set aside while a batch row drafts EAGLE-3's way
        self._sampling = False  # ... and whether its cycle samples
        # a batch row drafting in one drafter forward per step with the others (decoding/batch_rows.py sets it):
        # SpecFit's way drafts at EAGLE-3's price, to ``batch_depth`` levels (the batch rule sets it, cycle by cycle:
        # one deeper than the deepest node it took from the row), no selector per level; the route head, set aside
        # as ``route_after``, routes the whole pool after the levels, for every row in one forward
        self.together = False
        self.batch_depth = opts.depth
        self.route_after = None

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
        self.arm = self._next_way()
        self._skipped = self.arm == "plain"
        if self.arm == "eagle3":
            if self.way is None:  # alone: drafted here; in a batch, level by level with the other rows
                return self._draft_as_eagle(cycle)
            self._head, self.drafter.route_head = self.drafter.route_head, None  # EAGLE-3 drafts without routes
            self._sampling = cycle.sampling
            return None
        if self._skipped:
            self.predicted_seconds = self._predict_root_only()
            self._forecast_on = self._root
            return DraftTree()
        cycle.drafter = self.drafter
        self.values, self.estimates = [], []
        if self.calibrated:
            self.acceptance = acceptance_model(self.runtime, cycle.sampling)
        if self.together:  # a batch row drafting with the others: levels at EAGLE-3's price, routes after them
            self.route_after, self.drafter.route_head = self.drafter.route_head, None
            return None
        self._resident = self.runtime.resident_mask() if self.cost.miss else None  # [L, E], as this cycle starts
        return None

    def _next_way(self) -> str:
        """This cycle's way: a batch row's is the batch's (``way``; inside SpecFit's, the row's own backoff may
        leave it plain: no drafting for a row whose trees the batch rule has not been taking); else the guard's;
        without a guard, SpecFit's unless the backoff skips drafting."""
        if self.way is not None:
            return "plain" if self.way == "specfit" and self.backoff.skip() else self.way
        if self.guard is not None:  # the guard picks the way; its "plain" arm replaces the backoff
            return self.guard.choose()
        return "plain" if self.backoff.skip() else "specfit"

    def level_drafted(self, tree, cycle):
        if self.arm == "eagle3":  # a batch row drafting EAGLE-3's way: every level, no routes, no selector
            return True
        if self.together:  # a batch row: to its depth (one deeper than the batch last took), no selector per level
            return tree.depth < self.batch_depth
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
        if self.arm == "eagle3":
            self.drafter.route_head = self._head
            return self._verify_as_eagle(tree, self._sampling)
        if self.together:  # the batch rule chooses; its pool's routes came after the levels (batch_drafting.py)
            self.drafter.route_head, self.route_after = self.route_after, None
            self.levels = tree.depth
            if self.calibrated:
                self._path_values(tree)
            return tree
        values, node_routes, root_routes = self._level
        resident = self._resident
        self.levels = tree.depth
        self.runtime.expect_tree(values, node_routes)  # the pool: a forecast for the slot caches (offload/policies.py)
        root_demand = int(root_routes.sum())
        self._root = (root_demand, root_demand if resident is None else int((root_routes & ~resident).sum()))
        if self.guard is None and self.way is None:  # a batch row's backoff is the batch rule's to record
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
        return self._verify_as_eagle(tree, cycle.sampling)

    def _verify_as_eagle(self, tree, sampling: bool) -> DraftTree:
        """EAGLE-3's tree of a pool drafted its way, with its expected tokens and forecast (``_draft_as_eagle``)."""
        self.nodes = eagle_tree(tree.path_probs, self.max_nodes)
        self.levels = tree.depth
        if self.calibrated:
            self.acceptance = acceptance_model(self.runtime, sampling)
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
        counts = {f"{self.arm}_cycles": 1}  # plain_cycles or specfit_cycles
        if self.refresh is None or self.predicted_seconds is None:
            return counts
        demand, misses = self._forecast_on  # what the forecast saw: the refit learns the clock of the selector's view
        if self.refresh.record(len(self.nodes), demand, misses, self.levels, seconds):
            self._use(self.refresh.model)
        return {**counts, "cost_refresh_cycles": 1}

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

