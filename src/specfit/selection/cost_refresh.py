"""The online refresh of the cycle-time model: the cost model keeps learning from the cycles it forecast.

A calibrated profile (``specfit calibrate``) is the warm start and the quality gate; a reference profile of another
machine is a start too. Each decoding cycle SpecFit forecast adds one record, ``(n_nodes, demand, misses, levels
drafted, seconds)``, where demand and misses are what the verify forward really computed and copied and seconds the
cycle's wall clock. Every ``every`` records the model is refitted on all of them, older ones weighing ``decay``
times less per cycle, so a change of load moves the model within a few tens of cycles.

The fit is the profile's own model with drafting per level as unknowns of their own:
``seconds = base + sum(increments up to n_nodes) + sum(drafting of levels 1..levels) + beta x demand +
copy_overhead x misses + link_share x misses x link_seconds``, every unknown >= 0, so the intercepts never fall
with the node count and nothing is negative (the profile's constraints). Online records rarely vary every unknown
(SpecFit may never verify 7 nodes or draft 5 levels), so each unknown also has a prior: the profile's value, times
a *scale* learned from the same records for the parts that run on the host (the whole cycle time but the link's own
share), with a relative width of ``PRIOR_WIDTH``. A machine that is uniformly 1.5x slower than the profile's moves
the unknowns the records do not reach by the same 1.5x; the link's time per copy, which load does not change,
stays.

The columns are generic: ``columns(cost)`` names them from the model and ``features(...)`` fills them, so another
term of the cost model joins as one more column with its prior. A cold expert (a miss) is priced as the selector
prices it, ``cost.miss``: its copy, its time on the host lane, or (``cold="auto"``) the cheaper; the caller gives
that path's own seconds per expert (``link_seconds``: the link's, or the lane's) and its fitted parts (``miss_parts``:
``(copy_overhead, link_share)`` or ``(host_overhead, host_share)``), and the refit learns what one cold expert
really adds, whichever way the engine computed it.

Pure NumPy (and SciPy's ``nnls``) on a few normal-equation sums: a record is one rank-one update (a dozen columns)
and a refit one small Cholesky factorisation and NNLS, tens of microseconds; no torch.
"""

from __future__ import annotations

import math
import numpy as np

from .cost_model import CostModel
from .prior_fit import PRIOR_WIDTH, PriorFit

__all__ = ["CostRefresh", "PRIOR_WIDTH", "DECAY"]

DECAY = 0.9  # weight of a record per later cycle: about the last 10 cycles count (a change of load shows in 20)
NOISE = 0.2  # a cycle time's noise, relative to the profile's root-only cycle: weighs records against the priors
EVERY = 4  # records between refits


class CostRefresh:
    """The online refresh of one priced cost model (module docstring).

    Args:
        cost: the priced profile to start from (``copy_overhead``, ``link_share`` and ``draft_level_seconds``
            required: a version-3 profile).
        link_seconds: the link's own time per expert copy, as ``cost`` was priced for.
        depth: the deepest level drafting can reach (drafting unknowns: one per level).
        decay, every: see ``DECAY``, ``EVERY``.
        key: what the caller keeps this refresh for (the profile and setup it belongs to).

    ``model`` is the current model (the profile itself until the first refit); ``cycles`` the records learned from.

    >>> base = CostModel((0.10, 0.11, 0.12), 1e-4, draft_level_seconds=(0.01, 0.01), copy_overhead=1e-5,
    ...                  link_share=1.0).priced(1e-3)
    >>> refresh = CostRefresh(base, link_seconds=1e-3, depth=2)
    >>> for i in range(40):   # a machine 1.5x slower than the profile (its link as the profile says)
    ...     n, levels, demand, misses = i % 3, 1 + i % 2, 200 + 10 * i, 5 + i % 7
    ...     seconds = 1.5 * (base.predict(n, demand, levels=levels, misses=misses) - 1e-3 * misses) + 1e-3 * misses
    ...     _ = refresh.record(n, demand, misses, levels, seconds)
    >>> m = refresh.model
    >>> round(m.predict(2, 300, levels=2, misses=10) / (1.5 * (base.predict(2, 300, levels=2, misses=10) - 0.01)
    ...                                                 + 0.01), 2)
    1.0
    """

    def __init__(self, cost: CostModel, link_seconds: float, depth: int, decay: float = DECAY, every: int = EVERY,
                 key=None, miss_parts: tuple[float, float] | None = None):
        if not cost.prices_copies or not cost.draft_level_seconds:
            raise ValueError("the online refresh needs a version-3 profile (copies priced, drafting per level): "
                             "recalibrate with `specfit calibrate`")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.base, self.link, self.depth = cost, float(link_seconds), max(int(depth), 1)
        self.every, self.key = every, key
        self.names = columns(cost, self.depth)
        self._row = _row_builder(self.names, self.link)
        noise = NOISE * max(cost.intercepts[0] - sum(cost.draft_level_seconds), cost.intercepts[0] * 0.1, 1e-6)
        self.fit = PriorFit(prior_coefficients(cost, self.depth, miss_parts),
                            [name != "link_share" for name in self.names], noise, decay)
        self.cycles = 0
        self.model = cost

    @property
    def scale(self) -> float:
        """The learned host-time scale (``prior_fit.PriorFit``)."""
        return self.fit.scale

    def record(self, n_nodes: int, demand: float, misses: float, levels: int, seconds: float) -> bool:
        """Learn one forecast cycle; returns True when it refitted the model."""
        if not (math.isfinite(seconds) and seconds > 0):
            return False
        self.fit.add(self._row(n_nodes, demand, misses, levels), seconds)
        self.cycles += 1
        if self.cycles % self.every:
            return False
        self.model = self.refit()
        return True

    def refit(self) -> CostModel:
        """The model fitted on the records so far and the priors (module docstring)."""
        return self._model(self.fit.solve())

    def _model(self, coef: np.ndarray) -> CostModel:
        k = len(self.names)
        n = self.base.max_nodes
        base, increments = coef[0], coef[1 : n + 1]
        drafting = coef[n + 1 : n + 1 + self.depth]
        beta, overhead, share = coef[n + 1 + self.depth : k]
        intercepts = base + float(drafting.sum()) + np.concatenate([[0.0], np.cumsum(increments)])
        meta = {"refreshed_from": self.base.meta.get("device", self.base.meta.get("source", "the model given")),
                "refresh_cycles": self.cycles, "host_scale": self.scale}
        model = CostModel(tuple(intercepts.tolist()), float(beta), meta, tuple(drafting.tolist()),
                          copy_overhead=float(overhead), link_share=float(share))
        return model.priced(self.link)


def columns(cost: CostModel, depth: int) -> list[str]:
    """The unknowns of the online fit, in order: the base of a cycle that drafts and verifies nothing, one increment
    per node count, one drafting time per level, then beta, the copy overhead and the link's share."""
    return (["base"] + [f"increment_{n}" for n in range(1, cost.max_nodes + 1)]
            + [f"drafting_{level}" for level in range(1, depth + 1)] + ["beta", "copy_overhead", "link_share"])


def features(names: list[str], n_nodes: int, demand: float, misses: float, levels: int, link: float) -> np.ndarray:
    """One record's row of the fit, column by column (``columns``)."""
    values = {"base": 1.0, "beta": float(demand), "copy_overhead": float(misses),
              "link_share": float(misses) * link}
    out = np.empty(len(names))
    for i, name in enumerate(names):
        if name.startswith("increment_"):
            out[i] = 1.0 if n_nodes >= int(name[10:]) else 0.0
        elif name.startswith("drafting_"):
            out[i] = 1.0 if levels >= int(name[9:]) else 0.0
        else:
            out[i] = values[name]
    return out


def _row_builder(names: list[str], link: float):
    """``features`` for fixed columns, as a few NumPy operations: (n_nodes, demand, misses, levels) -> row [K]."""
    k = len(names)
    inc = np.array([int(c[10:]) if c.startswith("increment_") else 10**9 for c in names])  # [K] n >= this
    lev = np.array([int(c[9:]) if c.startswith("drafting_") else 10**9 for c in names])  # [K] levels >= this
    base = np.array([c == "base" for c in names], float)
    per = {c: np.array([name == c for name in names], float) for c in ("beta", "copy_overhead", "link_share")}
    assert all(c in ("base", *per) or c.startswith(("increment_", "drafting_")) for c in names) and k

    def row(n_nodes, demand, misses, levels) -> np.ndarray:
        return (base + (inc <= n_nodes) + (lev <= levels) + per["beta"] * float(demand)
                + per["copy_overhead"] * float(misses) + per["link_share"] * (float(misses) * link))
    return row


def prior_coefficients(cost: CostModel, depth: int, miss_parts: tuple[float, float] | None = None) -> np.ndarray:
    """The profile's values of the unknowns (``columns``): drafting beyond its measured levels as its last level; a
    miss's overhead and share: ``miss_parts``, else the copy's."""
    drafting = [cost.drafting_seconds(level) - cost.drafting_seconds(level - 1) for level in range(1, depth + 1)]
    base = cost.intercepts[0] - sum(cost.draft_level_seconds)
    increments = np.diff(cost.intercepts)
    overhead, share = miss_parts if miss_parts is not None else (cost.copy_overhead, cost.link_share)
    return np.array([max(base, 0.0), *np.maximum(increments, 0.0), *drafting, cost.beta, overhead, share], float)

