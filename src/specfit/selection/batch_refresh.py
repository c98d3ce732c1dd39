"""The online refresh of the batch cycle-time model (``batch_cost.BatchCost``): it keeps learning from the clock of
every batch cycle, whichever way the cycle ran (SpecFit's, EAGLE-3's or plain), as ``cost_refresh`` does at batch 1.

A record is ``(rows, nodes, levels, drafted, demand, cold, seconds)``: what the cycle verified and drafted, the
experts its forecast priced (the union's demand and its cold experts) and its wall clock. The unknowns are the five
fixed coefficients, ``beta`` and a cold expert's two parts (its overhead, and its share of the path's own seconds
per expert: the link's copy, or the host lane's time, as ``learned_state.miss_path`` gives them), each with its
prior (the calibrated batch section, else ``BatchCost.prior``) and the host-time scale of ``prior_fit.PriorFit``.

>>> from specfit.selection.batch_cost import BatchCost
>>> truth = BatchCost(0.03, 0.01, 0.002, 0.004, 0.002, 1e-4, 2e-4)
>>> guess = BatchCost(0.02, 0.02, 0.0005, 0.004, 0.002, 1e-4, 2e-4)
>>> refresh = BatchRefresh(guess, lane_seconds=2e-4, miss_parts=(0.0, 1.0))
>>> for i in range(60):
...     rows, nodes, levels = 2 + i % 3, (5 * i) % 13, i % 4
...     args = (rows, nodes if levels else 0, levels, levels * rows, 200 + 7 * i, 10 + i % 9)
...     _ = refresh.record(*args, seconds=truth.predict(*args))
>>> args = (4, 8, 3, 12, 300, 15)
>>> round(guess.predict(*args) / truth.predict(*args), 2), abs(refresh.model.predict(*args) / truth.predict(*args) - 1) < 0.05
(1.12, True)
"""

from __future__ import annotations

import math

from .batch_cost import FIXED, BatchCost
from .prior_fit import PriorFit

__all__ = ["BatchRefresh", "DECAY", "EVERY"]

DECAY = 0.95  # weight of a record per later batch cycle: about the last 20 count
EVERY = 4  # records between refits
NOISE = 0.2  # a cycle time's noise, relative to the prior's plain step of 2 rows: weighs records against the priors


class BatchRefresh:
    """Learns a ``BatchCost`` from batch cycles (module docstring).

    Args:
        cost: the model to start from (its fixed coefficients and ``beta`` are the priors).
        lane_seconds: the own seconds per expert of the path a cold expert is priced by (the link's copy, or the
            host lane's time); ``miss_parts``: that path's (overhead, share).
        key: what the caller keeps this refresh for.
    """

    def __init__(self, cost: BatchCost, lane_seconds: float, miss_parts: tuple[float, float], key=None,
                 decay: float = DECAY, every: int = EVERY):
        self.base, self.lane, self.key, self.every = cost, float(lane_seconds), key, int(every)
        prior = [getattr(cost, name) for name in FIXED] + [cost.beta, *miss_parts]
        noise = NOISE * max(cost.fixed(2, 0), 1e-6)
        self.fit = PriorFit(prior, [True] * (len(FIXED) + 2) + [False], noise, decay)
        self.cycles = 0
        self.model = cost

    def record(self, rows: int, nodes: int, levels: int, drafted: int, demand: float, cold: float,
               seconds: float) -> bool:
        """Learn one batch cycle; returns True when it refitted the model."""
        if not (math.isfinite(seconds) and seconds > 0):
            return False
        self.fit.add([1.0, rows, nodes, levels, drafted, demand, cold, cold * self.lane], seconds)
        self.cycles += 1
        if self.cycles % self.every:
            return False
        coef = self.fit.solve()
        fixed, beta, (overhead, share) = coef[:len(FIXED)], coef[len(FIXED)], coef[len(FIXED) + 1:]
        self.model = BatchCost(*map(float, fixed), beta=float(beta), miss=float(overhead + share * self.lane))
        return True
