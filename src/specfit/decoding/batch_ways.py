"""Which way each batch cycle runs, and what it costs: the batch's guard and its cost model.

A batch cycle of SpecFit rows runs one of three ways, as a cycle at batch 1 does (``guard.py``), all lossless:

- ``"specfit"``: every row drafts under its own stop rule, unless its backoff leaves it plain (no drafting spent on
  a row whose trees the batch rule has not been taking), then the batch rule re-chooses every row's subtree against
  the union of the rows' experts (``selection/batch_rule.py``);
- ``"eagle3"``: every row drafts the full pool without routes and verifies its ``max_nodes`` most probable nodes;
- ``"plain"``: no row drafts, every root is verified: a plain batch step.

The guard that chooses is a ``Guard`` per number of rows in flight (a batch of 4 is not a batch of 1, and a batch
whose rows finish moves to the guard of its new size), kept on the runtime across calls and made anew when the
options change. Its warm-up is shorter than batch 1's (``WARMUP``, ``TRIALS``): a batch cycle carries every row's
tokens, and a short call cannot afford long exploration. A guard made for a new size starts from what the guard of
the nearest size learned (``Guard.seeded``: a few cycles' worth of evidence, soon outweighed by its own clock).
``guard=False`` runs SpecFit's way every cycle.

Every cycle, whichever way it runs, is forecast by the batch cost model (``selection/batch_cost.py``) and its clock
refreshes that model online (``selection/batch_refresh.py``, kept on the runtime across calls while the profile and
the depth stay the same): its fixed time, one model per way that drafts, while an expert is priced as the rows'
batch-1 model prices it (``selection/batch_refresh.py`` says why). A way's forecast prices what the rule knows:
SpecFit's, the batch rule's own union; plain and EAGLE-3's, the demand and cold experts of that way's last cycle,
per token verified.
"""

from __future__ import annotations

from ..selection.batch_cost import BatchCost
from ..selection.batch_refresh import BatchRefresh
from .guard import Guard

__all__ = ["BatchWays", "batch_guard", "batch_refresh", "WARMUP", "TRIALS"]

WARMUP = 2  # cycles of SpecFit's way before a batch guard tries another
TRIALS = 3  # cycles each other way runs before its rate is compared


def batch_guard(runtime, options, rows: int) -> Guard | None:
    """The runtime's guard for batch cycles of ``rows`` rows in flight (module docstring); None with
    ``guard=False``."""
    if not options.guard:
        return None
    kept = runtime.batch_guards
    if kept is None or kept[0] is not options:
        kept = runtime.batch_guards = (options, {})
    guards = kept[1]
    if rows not in guards:
        guard = Guard(warmup=WARMUP, trials=TRIALS)
        if guards:  # what the nearest size learned, as a start (a batch whose rows finish changes size every cycle)
            guard.seeded(guards[min(guards, key=lambda size: (abs(size - rows), size))])
        guards[rows] = guard
    return guards[rows]


def batch_refresh(runtime, profile, options) -> dict | None:
    """The runtime's online refreshes of the batch fixed time of ``profile`` (the rows' priced profile), one per way
    that drafts (``"specfit"``, ``"eagle3"``: their drafting differs; plain cycles teach both), made on first use and
    kept while the profile and the depth stay; None where the batch-1 refresh does not apply either (the option off,
    ``cost="paper"``, a profile without copies or drafting per level)."""
    if not options.cost_refresh or options.cost != "cache-aware" or not profile.prices_copies \
            or not profile.draft_levels:
        return None
    key = (profile.intercepts, profile.beta, str(profile.meta.get("batch")), options.depth)
    kept = runtime.batch_refresh
    if kept is None or kept[0] != key:
        start = BatchCost.of(profile)
        kept = runtime.batch_refresh = (key, {way: BatchRefresh(start, key=key) for way in DRAFTED})
    return kept[1]


DRAFTED = ("specfit", "eagle3")  # the ways that draft, each with its own fixed time (plain: SpecFit's, no drafting)


class BatchWays:
    """One batch call's way per cycle, its forecast, and what the clock teaches the guard and the cost model.

    ``cost`` is the model of the way this cycle runs (plain: SpecFit's), its experts priced as the rows' batch-1
    model prices them now (``beta``, ``miss``)."""

    def __init__(self, runtime, profile, rows_cost, layers: int, top_k: int):
        self.runtime, self.options = runtime, runtime.options
        self.refresh = batch_refresh(runtime, profile, self.options)
        self.start = BatchCost.of(profile)
        self.rows_cost = rows_cost  # the rows' batch-1 model: the prices of an expert of demand and a cold one
        self.guard = None
        self.way = "specfit"
        self.per_token = layers * top_k  # experts a token routes to, summed over layers (the first guess)
        self._seen: dict[str, tuple[float, float]] = {}  # way -> (demand, cold) per token of its last cycle

    @property
    def cost(self) -> BatchCost:
        model = self.refresh[self.way if self.way in DRAFTED else "specfit"].model if self.refresh else self.start
        return model.with_experts(self.rows_cost.beta, self.rows_cost.miss)

    def choose(self, rows: int, fixed: str | None = None) -> str:
        """The way of this cycle of ``rows`` rows in flight (``fixed``: this way, the guard not asked)."""
        self.guard = batch_guard(self.runtime, self.options, rows) if fixed is None else None
        self.way = fixed or (self.guard.choose() if self.guard is not None else "specfit")
        return self.way

    def forecast(self, rows: int, nodes: int, levels: int, drafted: int) -> tuple[float, float, float]:
        """(seconds, demand, cold) of a cycle whose experts the batch rule did not price (plain, EAGLE-3's way, or
        SpecFit's with every row plain): that way's last demand and cold experts per token verified."""
        tokens = rows + nodes
        demand, cold = self._seen.get(self.way if nodes else "plain", (self.per_token, self.per_token))
        demand, cold = demand * tokens, cold * tokens
        return self.cost.predict(rows, nodes, levels, drafted, demand, cold), demand, cold

    def learn(self, rows: int, nodes: int, levels: int, drafted: int, priced: tuple[float, float], forward,
              committed: int, seconds: float) -> None:
        """One batch cycle's clock: the guard learns it under the way it ran; the way's fixed time learns the clock
        less the experts its forecast ``priced`` (demand, cold) at their prices (a plain cycle teaches every way's);
        the forward's own figures forecast the way's next cycle."""
        if self.guard is not None:
            self.guard.record(self.way, committed, seconds)
        tokens = rows + nodes
        self._seen[self.way if nodes else "plain"] = (forward.demand / tokens,
                                                      (forward.misses + forward.host_experts) / tokens)
        if self.refresh is None:
            return
        demand, cold = priced
        fixed = seconds - self.rows_cost.beta * demand - self.rows_cost.miss * cold
        for way in (DRAFTED if not nodes and not levels else (self.way,)):
            self.refresh[way].record(rows, nodes, levels, drafted, fixed)
