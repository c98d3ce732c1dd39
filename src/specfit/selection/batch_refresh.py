"""The online refresh of a batch's fixed time (``batch_cost.BatchCost``): it keeps learning from the clock of the
batch cycles, as ``cost_refresh`` does at batch 1.

A record is ``(rows, nodes, levels, drafted)`` and the cycle's *fixed seconds*: its wall clock less what its
experts cost at the prices the batch-1 model gives them (``beta`` per expert of the union's demand, ``miss`` per
cold expert). Those two stay the batch-1 model's: a batch's demand and cold experts grow with its tokens, so its
own records cannot tell them from the per-node time, while the batch-1 probes (cold cycles among them) and refresh
do. The unknowns are the five fixed coefficients, each with its prior (the calibrated batch section, else
``BatchCost.prior``) and the host-time scale of ``prior_fit.PriorFit``.

>>> from specfit.selection.batch_cost import BatchCost
>>> truth = BatchCost(0.03, 0.01, 0.002, 0.004, 0.002, 1e-4, 2e-4)
>>> guess = BatchCost(0.02, 0.02, 0.0005, 0.004, 0.002, 1e-4, 2e-4)
>>> refresh = BatchRefresh(guess)
>>> for i in range(60):
...     rows, nodes, levels = 2 + i % 3, (5 * i) % 13, i % 4
...     args = (rows, nodes if levels else 0, levels, levels * rows)
...     _ = refresh.record(*args, seconds=truth.fixed(*args))
>>> args = (4, 8, 3, 12)
>>> round(guess.fixed(*args) / truth.fixed(*args), 2), round(refresh.model.fixed(*args) / truth.fixed(*args), 2)
(1.15, 0.99)
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
    """Learns the fixed coefficients of a ``BatchCost`` from batch cycles (module docstring); ``model`` keeps the
    ``beta`` and ``miss`` of the model it started from (the caller sets the current ones: ``BatchCost.with_experts``).
    ``key``: what the caller keeps this refresh for."""

    def __init__(self, cost: BatchCost, key=None, decay: float = DECAY, every: int = EVERY):
        self.base, self.key, self.every = cost, key, int(every)
        noise = NOISE * max(cost.fixed(2, 0), 1e-6)
        self.fit = PriorFit([getattr(cost, name) for name in FIXED], [True] * len(FIXED), noise, decay)
        self.cycles = 0
        self.model = cost

    def record(self, rows: int, nodes: int, levels: int, drafted: int, seconds: float) -> bool:
        """Learn one batch cycle's fixed ``seconds``; returns True when it refitted the model."""
        if not math.isfinite(seconds):
            return False
        self.fit.add([1.0, rows, nodes, levels, drafted], seconds)
        self.cycles += 1
        if self.cycles % self.every:
            return False
        self.model = self.model.with_fixed(self.fit.solve())
        return True
