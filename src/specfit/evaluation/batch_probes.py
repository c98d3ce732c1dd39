"""The batch probes of ``specfit calibrate``: a batch cycle's fixed time (``selection/batch_cost.py``), measured, so
that a batch is not priced by extrapolating batch-1 intercepts.

After the batch-1 probes (``probes.py``) have fitted ``beta`` and the price of a cold expert, these rounds decode
left-padded batches of the calibration prompts (``rows``: 2 and 4 by default) with SpecFit's way every cycle: each row
drafts under its own stop rule (so rows draft different numbers of levels), and the subtrees verified are chosen by a
schedule, not by the batch rule: every row a random ancestor-closed subtree of a random size, so rows, nodes and
levels vary independently. Each batch runs ``repeats`` times from an empty slot cache; greedy decoding replays the same
cycles, and each cycle's fastest repeat is kept (interference only adds time, as in ``probes.py``). A record is a
cycle's ``(rows, nodes, levels, drafted)`` and its *fixed seconds*: its clock less its experts at the fitted prices
(``beta`` per expert of demand, the fitted copy per copied expert, the fitted host time per host expert). NNLS over the
five fixed coefficients gives ``meta["batch"]`` of the profile, with its fit figures.
"""

from __future__ import annotations

import random

import numpy as np

from ..decoding.specfit_generator import SpecFitGenerator
from ..drafting.tree import random_subtree
from ..selection.batch_cost import FIXED
from ..selection.batch_rule import price_batch
from ..selection.cost_model import CostModel

__all__ = ["probe_batches", "fit_batch", "with_batches", "BATCH_ROWS"]

BATCH_ROWS = (2, 4)  # the batch sizes probed
BATCH_TOKENS = 24  # new tokens per row in each probe batch


class _Schedule:
    """The scheduled batch rule: each row a random ancestor-closed subtree of a random size; seeded per call, so a
    repeat of the same batch chooses the same subtrees."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def __call__(self, pools, intercepts, beta, miss, resident):
        picks = [random_subtree(p.parents, self.rng.randint(0, min(p.max_nodes, len(p.parents))), self.rng)
                 for p in pools]
        return price_batch(pools, picks, intercepts, beta, miss, resident)


class _BatchProbe(SpecFitGenerator):
    """A SpecFit row that always drafts SpecFit's way (no backoff, no guard) under the scheduled rule."""

    batch_way = "specfit"

    def __init__(self, model, rule):
        super().__init__(model)
        self.batch_rule = rule

    def _next_way(self) -> str:
        return "specfit"


def probe_batches(model, prompts, rows=BATCH_ROWS, repeats: int = 2, max_new_tokens: int = BATCH_TOKENS,
                  seed: int = 0) -> list[dict]:
    """Timed batch cycles of ``model`` (enabled, with a drafter) over left-padded batches of ``prompts`` ([1, P]
    ids): per cycle its features and the fastest of ``repeats`` clocks (dicts with ``rows``, ``nodes``, ``levels``,
    ``drafted``, ``demand``, ``misses``, ``host``, ``seconds``); cycles that did not replay alike are left out."""
    from .batches import left_padded, pad_id

    runtime = model.specfit
    records = []
    for size in rows:
        if size < 2 or not prompts:
            continue
        chosen = [prompts[i % len(prompts)] for i in range(size)]
        (ids, mask), = left_padded(chosen, size, pad_id(model))
        runs = []
        for _ in range(repeats):
            rule = _Schedule(seed + size)
            runtime.clear_cache()
            runtime.stats.trace = []
            try:
                model.generate(ids.to(runtime.device), attention_mask=mask.to(runtime.device),
                               max_new_tokens=max_new_tokens, do_sample=False,
                               assistant=lambda m, rule=rule: _BatchProbe(m, rule))
                runs.append(list(runtime.stats.trace))
            finally:
                runtime.stats.trace = None
        for cycle in zip(*runs):
            seen = {(c.n_nodes, c.demand, c.misses, c.host_experts, c.row_nodes, c.row_levels) for c in cycle}
            if len(seen) != 1 or len(cycle[0].row_nodes) < 2:
                continue
            c = cycle[0]
            records.append(dict(rows=len(c.row_nodes), nodes=c.n_nodes, levels=max(c.row_levels),
                                drafted=sum(c.row_levels), demand=c.demand, misses=c.misses, host=c.host_experts,
                                seconds=min(r.seconds - r.measurement_seconds for r in cycle)))
    return records


def fit_batch(records: list[dict], cost) -> dict | None:
    """``meta["batch"]``: the five fixed coefficients fitted by NNLS on ``records`` (``probe_batches``), their
    experts priced by ``cost`` (the batch-1 fit, priced at the link and lane the batches ran on), with ``records``
    and ``r2``; None with fewer records than twice the coefficients."""
    from scipy.optimize import nnls

    if len(records) < 2 * len(FIXED):
        return None
    x = np.array([[1.0, r["rows"], r["nodes"], r["levels"], r["drafted"]] for r in records])  # [n, 5]
    y = np.array([r["seconds"] - cost.beta * r["demand"] - cost.copy * r["misses"] - cost.host * r["host"]
                  for r in records])  # [n]
    coef, _ = nnls(x, y)
    residual = y - x @ coef
    spread = float(((y - y.mean()) ** 2).sum())
    return {**{name: float(v) for name, v in zip(FIXED, coef)}, "records": len(records),
            "rows": sorted({r["rows"] for r in records}),
            "r2": 1.0 - float(residual @ residual) / spread if spread > 0 else None}


def with_batches(model, prompts, cost: CostModel, rows, repeats: int, seed: int, max_new_tokens: int) -> CostModel:
    """``cost`` (``probes.calibrate``'s fit) with a batch's fixed time measured by the batch probes in
    ``meta["batch"]``, when ``rows`` names batch sizes and enough cycles replayed alike."""
    from dataclasses import replace

    if not rows:
        return cost
    fit = fit_batch(probe_batches(model, prompts, tuple(rows), repeats=repeats, seed=seed,
                                  max_new_tokens=min(BATCH_TOKENS, max_new_tokens)), cost)
    return cost if fit is None else replace(cost, meta={**cost.meta, "batch": fit})
