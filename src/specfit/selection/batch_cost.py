"""The cycle-time model of a batch: what one decoding cycle of ``R`` rows costs.

    seconds = base + per_row x R + per_node x N + level x L + level_row x D + beta x demand + miss x cold

``R`` rows verified (each its root), ``N`` draft nodes verified over all rows, ``L`` levels drafted (one drafter
forward per level for every row that drafts), ``D`` the levels each row drafted, summed over rows (a row's own work
per level: its route-head rows, its selector, its bookkeeping), ``demand`` the experts of the rows' union summed over
layers, ``cold`` those of the union not resident in the slot cache (each copied or computed on the host lane,
priced ``miss`` as the batch-1 model prices a cold expert). A plain batch step is ``N = L = D = 0``.

The batch-1 model (``cost_model.CostModel``) prices one row: its intercepts per node count do not say what another
row or a node of another row costs, and beyond its table a batch's verify forward (``R + N`` tokens) would be priced
by extrapolation. So a batch has coefficients of its own:

- ``specfit calibrate`` probes batches (``evaluation/batch_probes.py``) and stores the fitted five in the profile's
  ``meta["batch"]``; ``beta`` and ``miss`` stay the profile's (the batch-1 probes tell them apart best);
- without them, ``BatchCost.prior(cost)`` derives them from the batch-1 profile by stated rules (``ROW_SHARE``);
- either way the online refresh (``batch_refresh.py``) refits them from the clock of the batch cycles.

No torch here.

>>> c = BatchCost(base=0.02, per_row=0.005, per_node=0.001, level=0.002, level_row=0.001, beta=1e-4, miss=1e-3)
>>> round(c.predict(rows=4, nodes=6, levels=2, drafted=8, demand=300, cold=20), 6)
0.108
>>> round(c.fixed(4, 0), 6)   # a plain batch step of 4 rows, before its experts
0.04
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

__all__ = ["BatchCost", "FIXED", "ROW_SHARE"]

FIXED = ("base", "per_row", "per_node", "level", "level_row")  # the coefficients a batch fits (beta, miss: the profile's)
# Without a calibrated batch section: the share of a batch-1 root-only cycle (its drafting left out) charged per row
# (its own root's tokens, acceptance and commit), the rest per forward; and of a drafted level, per drafting row
ROW_SHARE = 0.25
LEVEL_ROW_SHARE = 0.5


@dataclass(frozen=True)
class BatchCost:
    base: float  # a batch cycle's fixed time, whatever its rows
    per_row: float  # each row verified
    per_node: float  # each draft node verified, over all rows
    level: float  # each drafted level (one drafter forward for every drafting row)
    level_row: float  # each level a row drafted, summed over rows
    beta: float  # each expert of the union's demand
    miss: float  # each cold expert of the union (copied, or computed on the host lane)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and value >= 0 and value == value and value != float("inf")):
                raise ValueError(f"BatchCost.{f.name} must be a finite number >= 0, got {value!r}")

    def fixed(self, rows: int, nodes: int, levels: int = 0, drafted: int = 0) -> float:
        """Everything but the experts: ``rows`` verified, ``nodes`` draft nodes over them, ``levels`` drafted,
        ``drafted`` levels summed over the drafting rows."""
        return (self.base + self.per_row * rows + self.per_node * nodes + self.level * levels
                + self.level_row * drafted)

    def predict(self, rows: int, nodes: int, levels: int, drafted: int, demand: float, cold: float) -> float:
        """Predicted seconds of a batch cycle (module docstring)."""
        return self.fixed(rows, nodes, levels, drafted) + self.beta * demand + self.miss * cold

    def tokens_table(self, rows: int, most_nodes: int, levels: int, drafted: int) -> list[float]:
        """The fixed time by tokens verified, as the batch rule takes it: entry ``t - 1`` for ``t = rows + N``
        tokens (entries below ``rows`` tokens are never read and repeat the root-only step)."""
        root = self.fixed(rows, 0, levels, drafted)
        return [root] * (rows - 1) + [self.fixed(rows, n, levels, drafted) for n in range(most_nodes + 1)]

    def to_json(self) -> dict:
        """The five fitted coefficients, as ``meta["batch"]`` of a profile keeps them."""
        return {name: getattr(self, name) for name in FIXED}

    @classmethod
    def of(cls, cost, batch: dict | None = None) -> "BatchCost":
        """The batch model of a priced batch-1 ``cost`` (``CostModel``): the five coefficients from ``batch`` (a
        calibrated ``meta["batch"]``), else from the profile's own ``meta["batch"]``, else ``prior(cost)``."""
        found = batch if batch is not None else cost.meta.get("batch")
        if isinstance(found, dict) and all(name in found for name in FIXED):
            return cls(**{name: float(found[name]) for name in FIXED}, beta=cost.beta, miss=cost.miss)
        return cls.prior(cost)

    @classmethod
    def prior(cls, cost) -> "BatchCost":
        """Derived from a batch-1 model: a root-only cycle (drafting left out) split ``ROW_SHARE`` per row and the
        rest per forward; a node at the mean of the intercepts' increments; a level at the mean of the measured
        levels, ``LEVEL_ROW_SHARE`` of it per drafting row.

        >>> from specfit.selection.cost_model import CostModel
        >>> c = BatchCost.prior(CostModel((0.05, 0.06, 0.07), 1e-5, draft_level_seconds=(0.004, 0.002)))
        >>> [round(getattr(c, n), 4) for n in FIXED]
        [0.033, 0.011, 0.01, 0.0015, 0.0015]
        """
        levels = tuple(cost.draft_level_seconds)
        root = max(cost.intercepts[0] - sum(levels), 0.0)
        per_node = (cost.intercepts[-1] - cost.intercepts[0]) / max(len(cost.intercepts) - 1, 1)
        level = sum(levels) / len(levels) if levels else 0.0
        return cls(base=(1 - ROW_SHARE) * root, per_row=ROW_SHARE * root, per_node=max(per_node, 0.0),
                   level=(1 - LEVEL_ROW_SHARE) * level, level_row=LEVEL_ROW_SHARE * level, beta=cost.beta,
                   miss=cost.miss)

    def with_fixed(self, values) -> "BatchCost":
        """The same model with the five fixed coefficients replaced (in ``FIXED`` order)."""
        return replace(self, **{name: float(v) for name, v in zip(FIXED, values)})

    def with_experts(self, beta: float, miss: float) -> "BatchCost":
        """The same fixed time with the experts priced at ``beta`` and ``miss`` (the batch-1 model's current ones)."""
        return replace(self, beta=float(beta), miss=float(miss))
