"""What SpecFit learns and keeps on the runtime across ``generate()`` calls: the dominance guard, the online cost
refresh (and the path a cold expert is priced by), the acceptance models, and the drafting backoff. Each is made on
first use and made anew when what it belongs to changes."""

from __future__ import annotations

from ..selection.acceptance_model import AcceptanceModel, AcceptanceTables
from ..selection.cost_refresh import CostRefresh
from ..selection.profiles import link_seconds
from .guard import Guard


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

