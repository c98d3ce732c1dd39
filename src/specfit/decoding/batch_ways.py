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
tokens. ``guard=False`` runs SpecFit's way every cycle.

Every cycle, whichever way it runs, is forecast by the batch cost model (``selection/batch_cost.py``) and its clock
refreshes that model online (``selection/batch_refresh.py``, kept on the runtime across calls while the profile and
the way a cold expert is priced stay the same). A way's forecast prices what the rule knows: SpecFit's, the batch
rule's own union; plain and EAGLE-3's, the demand and cold experts of that way's last cycle, per token verified.
"""

from __future__ import annotations

from ..selection.batch_cost import BatchCost
from ..selection.batch_refresh import BatchRefresh
from .guard import Guard
from .learned_state import miss_path

__all__ = ["BatchWays", "batch_guard", "batch_refresh", "WARMUP", "TRIALS"]

WARMUP = 4  # cycles of SpecFit's way before a batch guard tries another
TRIALS = 2  # cycles each other way runs before its rate is compared


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
        guards[rows] = Guard(warmup=WARMUP, trials=TRIALS)
    return guards[rows]


def batch_refresh(runtime, profile, options) -> BatchRefresh | None:
    """The runtime's online refresh of the batch model of ``profile`` (the rows' priced profile), made on first use
    and kept while the profile, the pricing of a cold expert and the depth stay; None where the batch-1 refresh does
    not apply either (the option off, ``cost="paper"``, a profile without copies or drafting per level)."""
    if not options.cost_refresh or options.cost != "cache-aware" or not profile.prices_copies \
            or not profile.draft_levels:
        return None
    lane, parts = miss_path(runtime, profile)
    key = (profile.intercepts, profile.beta, str(profile.meta.get("batch")), profile.cold, lane, parts,
           options.depth)
    refresh = runtime.batch_refresh
    if refresh is None or refresh.key != key:
        refresh = runtime.batch_refresh = BatchRefresh(BatchCost.of(profile), lane, parts, key=key)
    return refresh


class BatchWays:
    """One batch call's way per cycle, its forecast, and what the clock teaches the guard and the cost model."""

    def __init__(self, runtime, profile, layers: int, top_k: int):
        self.runtime, self.options = runtime, runtime.options
        self.refresh = batch_refresh(runtime, profile, self.options)
        self.cost = self.refresh.model if self.refresh is not None else BatchCost.of(profile)
        self.guard = None
        self.way = "specfit"
        self.per_token = layers * top_k  # experts a token routes to, summed over layers (the first guess)
        self._seen: dict[str, tuple[float, float]] = {}  # way -> (demand, cold) per token of its last cycle

    def choose(self, rows: int) -> str:
        """The way of this cycle of ``rows`` rows in flight."""
        self.guard = batch_guard(self.runtime, self.options, rows)
        self.way = self.guard.choose() if self.guard is not None else "specfit"
        return self.way

    def forecast(self, rows: int, nodes: int, levels: int, drafted: int) -> tuple[float, float, float]:
        """(seconds, demand, cold) of a cycle whose experts the batch rule did not price (plain, EAGLE-3's way, or
        SpecFit's with every row plain): that way's last demand and cold experts per token verified."""
        tokens = rows + nodes
        demand, cold = self._seen.get(self.way, (self.per_token, self.per_token))
        demand, cold = demand * tokens, cold * tokens
        return self.cost.predict(rows, nodes, levels, drafted, demand, cold), demand, cold

    def learn(self, rows: int, nodes: int, levels: int, drafted: int, priced: tuple[float, float], forward,
              committed: int, seconds: float) -> None:
        """One batch cycle's clock: the guard learns it under the way it ran, the cost model on the experts its
        forecast ``priced`` (demand, cold); the forward's own figures forecast the way's next cycle."""
        if self.guard is not None:
            self.guard.record(self.way, committed, seconds)
        tokens = rows + nodes
        self._seen[self.way] = (forward.demand / tokens, (forward.misses + forward.host_experts) / tokens)
        if self.refresh is not None and self.refresh.record(rows, nodes, levels, drafted, *priced, seconds):
            self.cost = self.refresh.model
