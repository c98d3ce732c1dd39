"""The decoding options: the draft pool, the verified-subtree budget, where routes come from, prefetch, cost and the
acceptance estimate."""

from __future__ import annotations

from dataclasses import dataclass

from ..selection.route_sources import AUTO, ROUTE_SOURCES


@dataclass(frozen=True)
class DecodingOptions:
    """Draft pool and selection settings; defaults are the paper's."""

    topk: int = 2  # children per expanded node, and nodes expanded per level
    depth: int = 5  # deepest draft level
    pool_nodes: int = 18  # draft pool node budget
    max_nodes: int = 7  # draft nodes verified per cycle at most (EAGLE-3 verifies exactly this many)
    route_source: str = AUTO  # where SpecFit's selector gets draft-node routes (see selection/route_sources.py)
    prefetch: bool = False  # copy the current winner's (predicted) experts while the next level is drafted
    # "cache-aware": an expert costs its compute, and a copy when it is not resident in the slot cache (one profile
    # prices every slot count and link); "paper": the paper's beta per expert of demand, resident or not
    cost: str = "cache-aware"
    # what SpecFit's selector counts as expected tokens: "calibrated", path values from the acceptance model
    # (selection/acceptance_model.py); "paper", the paper's 1 + sum of drafted path probabilities
    acceptance: str = "calibrated"
    # refit the cost model online from the cycles it forecast, starting from the profile (selection/cost_refresh.py);
    # False: the profile as calibrated, frozen (the paper's practice). Only for cost="cache-aware" with a v3 profile.
    cost_refresh: bool = True
    # run each cycle SpecFit's way or EAGLE-3's, whichever the clock says commits more tokens per second
    # (decoding/guard.py); False: SpecFit's rule alone, every cycle (the paper's)
    guard: bool = True

    def __post_init__(self):
        if self.route_source != AUTO and self.route_source not in ROUTE_SOURCES:
            raise ValueError(f"unknown route_source {self.route_source!r}; choose {AUTO!r} (the default: a trained "
                             f"predictor, else the target's gates) or one of {sorted(ROUTE_SOURCES)}")
        if self.cost not in ("cache-aware", "paper"):
            raise ValueError(f"cost must be 'cache-aware' (compute and copies, the default) or 'paper' (demand "
                             f"alone), got {self.cost!r}")
        if self.acceptance not in ("calibrated", "paper"):
            raise ValueError(f"acceptance must be 'calibrated' (the acceptance model's path values, the default) or "
                             f"'paper' (1 + sum of path probabilities), got {self.acceptance!r}")
        for name in ("topk", "depth", "pool_nodes", "max_nodes"):
            value, low = getattr(self, name), 0 if name == "max_nodes" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("prefetch", "cost_refresh", "guard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
