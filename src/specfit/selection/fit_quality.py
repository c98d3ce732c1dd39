"""Is a fitted cost model good enough to steer the selector? The checks ``specfit calibrate`` runs before it installs
a profile, and the gate they feed.

- **Held-out error**: k-fold cross-validation over the probe configurations; every record is predicted once by a fit
  that did not see it. ``heldout_r2`` is ``1 - SSE(held out) / SST``, so it cannot flatter an over-fitted model.
- **Bootstrap intervals**: the configurations resampled with replacement and refitted; the 2.5 and 97.5
  percentiles of beta and of every intercept.
- **Selector stability**: on pools recorded during the probes (with their true routes), how often the selector's
  choice under a bootstrap fit differs from its choice under the fit itself, and what the differing choices lose:
  ``choice_loss``, the mean share of the predicted ratio (tokens per second) they give up, scored with the fit.
- **The gate**: a fit is ``"poor"`` when
  1. its held-out R^2 is below ``min_heldout_r2`` (0.5), or
  2. beta's interval is wider than ``max_beta_halfwidth`` (+-25%) of beta either side, unless pools were recorded
     and the choices that uncertainty moves lose at most ``max_choice_loss`` (1%): a small beta (no link, every
     expert resident) is hard to pin down in relative terms and changes nothing the selector does, or
  3. the choices under the bootstrap fits lose more than ``max_choice_loss`` on average;
  otherwise ``"good"``. Rules 1 and 2 are the issue's "R^2 < 0.5 or beta's interval wider than +-25%"; rule 3 and the
  exception in rule 2 judge the fit by what it is for. A bare change rate is reported, not gated: changes between
  near-equal subtrees cost nothing.

Pure numpy and scipy; no torch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .cost_fit import as_rows, fit_coefficients
from .cost_model import CostModel

GATE = {"min_heldout_r2": 0.5, "max_beta_halfwidth": 0.25, "max_choice_loss": 0.01}
# what to do about a poor fit, in the words of where calibration was called: the command's flags, or the keyword
# arguments of specfit.calibrate(model, prompts, ...)
REMEDY = ("take more probes (--probes, --repeats), keep one CPU thread (--threads 1, the default on a CPU), and "
          "calibrate on a quiet machine (no other jobs running)")
REMEDY_PYTHON = ("take more probes (probes=, repeats=), keep one CPU thread (torch.set_num_threads(1) before the "
                 "call), and calibrate on a quiet machine (no other jobs running)")
CHOICE_FITS = 100  # bootstrap fits the choice-stability check runs the selector with (each costs one call per pool)


class Pool(NamedTuple):
    """A draft pool recorded during the probes, with the routes the selector saw for its nodes."""

    parents: tuple[int, ...]
    path_probs: tuple[float, ...]
    routes: np.ndarray  # bool [N, layers, experts]
    root_routes: np.ndarray  # bool [layers, experts]
    resident: np.ndarray | None = None  # bool [layers, experts]: the slot cache when the pool was drafted


class Assessment(NamedTuple):
    quality: dict  # JSON-ready; stored as the profile's meta["quality"]
    heldout_seconds: np.ndarray  # [records] each record's prediction by the fold that held it out


def assess(records, max_nodes: int, draft_level_seconds=(), *, kind: str = "paper", folds: int = 5,
           bootstrap: int = 200, seed: int = 0, pools=(), gate: dict | None = None) -> Assessment:
    """Cross-validate, bootstrap and gate the monotone fit of ``records`` (one per probe configuration) as
    ``CostModel.fit(records, max_nodes, draft_level_seconds, kind=kind)`` makes it.

    The coefficient the gate's interval rule reads is the one that prices experts for the selector: ``beta`` for
    the paper's demand-only fit, the copy coefficient at the probes' link for a cache-aware fit (``beta`` is
    reported beside it)."""
    gate = {**GATE, **(gate or {})}
    unknown = set(gate) - set(GATE)
    if unknown:
        raise ValueError(f"unknown gate setting(s) {sorted(unknown)}; known: {sorted(GATE)}")
    for name, value, low in (("folds", folds, 2), ("bootstrap", bootstrap, 20)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    rows = as_rows(records)
    if len(rows) < 2 * folds:
        raise ValueError(f"{len(rows)} records are too few for {folds}-fold cross-validation; give at least "
                         f"{2 * folds}")
    floor = float(sum(draft_level_seconds))
    coef = fit_coefficients(rows, max_nodes, floor, kind)
    link = _probe_link(rows)
    rng = np.random.default_rng(seed)

    heldout = _cross_validate(rows, max_nodes, floor, folds, rng, kind)
    spread = float(np.sum((rows[:, 2] - rows[:, 2].mean()) ** 2))
    sse = float(np.sum((rows[:, 2] - heldout) ** 2))
    fits = _bootstrap(rows, max_nodes, floor, bootstrap, rng, kind)
    quality = {
        "kind": kind,
        "heldout_r2": 1.0 - sse / spread if spread > 0 else None,
        "heldout_rms_s": float(np.sqrt(sse / len(rows))),
        "folds": folds,
        **_interval("beta", coef.beta, [f.beta for f in fits]),
        "intercept_intervals_s": np.percentile(np.array([f.intercepts for f in fits]), [2.5, 97.5], axis=0).T.tolist(),
        "bootstrap": len(fits),
        "choice_change_rate": None,
        "choice_loss": None,
        "pools": len(pools),
        "gate": gate,
    }
    if kind == "cache-aware":
        quality.update(_interval("copy", _copy(coef, link), [_copy(f, link) for f in fits]))
        quality["copy_link_seconds"] = link
    if coef.host_overhead is not None:  # reported beside the copy's, not gated: the copy carries the selector's gate
        lane = float(rows[rows[:, 5] > 0][:, 6].max())
        quality.update(_interval("host", _host(coef, lane), [_host(f, lane) for f in fits if f.host_overhead
                                                               is not None]))
        quality["host_lane_seconds"] = lane
    if pools:
        full = _model(coef, draft_level_seconds, link)
        rate, loss = choice_stability(pools, full, [_model(f, draft_level_seconds, link) for f in fits[:CHOICE_FITS]],
                                      max_nodes)
        quality["choice_change_rate"], quality["choice_loss"] = rate, loss
    reasons = gate_reasons(quality, _copy(coef, link) if kind == "cache-aware" else coef.beta)
    quality["verdict"] = "poor" if reasons else "good"
    quality["reasons"] = reasons
    return Assessment(quality, heldout)


def gate_reasons(quality: dict, value: float) -> list[str]:
    """Why a fit fails the gate (empty when it passes); see the module docstring for the rules. ``value`` is the
    gated coefficient (beta, or a cache-aware fit's copy coefficient)."""
    gate, reasons = quality["gate"], []
    r2 = quality["heldout_r2"]
    if r2 is None or r2 < gate["min_heldout_r2"]:
        shown = "undefined (the probes' times do not vary)" if r2 is None else f"{r2:.3f}"
        reasons.append(f"held-out R^2 {shown} < {gate['min_heldout_r2']}: the model predicts probes it did not see "
                       f"little better than their mean")
    loss = quality.get("choice_loss")
    name = "copy" if quality.get("kind") == "cache-aware" else "beta"
    width = quality[f"{name}_halfwidth"]
    if (width is None or width > gate["max_beta_halfwidth"]) and (loss is None or loss > gate["max_choice_loss"]):
        lo, hi = (x * 1e3 for x in quality[f"{name}_interval_s"])
        shown = "unbounded" if width is None else f"+-{100 * width:.0f}%"
        what = "the copy coefficient" if name == "copy" else "beta"
        reasons.append(f"{what} {value * 1e3:.4f} ms has a 95% bootstrap interval [{lo:.4f}, {hi:.4f}] ms, {shown} "
                       f"of it (limit +-{100 * gate['max_beta_halfwidth']:.0f}%)")
    if loss is not None and loss > gate["max_choice_loss"]:
        reasons.append(f"under the bootstrap fits the selector's choices on the recorded pools lose {100 * loss:.1f}% "
                       f"of the predicted tokens per second on average (limit {100 * gate['max_choice_loss']:.1f}%)")
    return reasons


def choice_stability(pools, full: CostModel, fits, max_nodes: int) -> tuple[float, float]:
    """On the recorded pools, run the selector under each bootstrap fit (``CostModel``s) and compare with its choice
    under ``full``: returns (share of (pool, fit) pairs where the choice differs, mean share of the predicted ratio
    the differing choices lose, both scored with ``full``). Changes between near-equal subtrees lose almost
    nothing."""
    from .selector import select_subtree

    def choose(pool, cost):
        return select_subtree(pool.parents, pool.path_probs, pool.routes, pool.root_routes, cost, max_nodes,
                              resident=pool.resident)

    baseline = [choose(pool, full) for pool in pools]
    changed, loss, total = 0, 0.0, 0
    for cost in fits:
        for pool, best in zip(pools, baseline):
            got = choose(pool, cost)
            total += 1
            if got.nodes != best.nodes:
                changed += 1
                loss += 1.0 - got.expected_tokens / full.predict(len(got.nodes), got.demand,
                                                                 misses=got.misses) / best.ratio
    return (changed / total, loss / total) if total else (0.0, 0.0)


def _probe_link(rows) -> float:
    """The link seconds per copy the gate prices copies at: the largest the probes ran over (the user's link)."""
    copied = rows[rows[:, 3] > 0]
    return float(copied[:, 4].max()) if len(copied) else 0.0


def _copy(coef, link: float) -> float:
    return coef.copy_overhead + coef.link_share * link


def _host(coef, lane: float) -> float:
    return coef.host_overhead + coef.host_share * lane


def _model(coef, draft_level_seconds, link: float) -> CostModel:
    return CostModel(tuple(coef.intercepts), coef.beta, {}, tuple(draft_level_seconds), copy=_copy(coef, link))


def _interval(name: str, value: float, samples) -> dict:
    lo, hi = np.percentile(np.asarray(samples, float), [2.5, 97.5])
    halfwidth = (hi - lo) / 2
    relative = halfwidth / value if value > 0 else (0.0 if halfwidth == 0 else None)  # None: infinitely wide
    return {f"{name}_interval_s": [float(lo), float(hi)], f"{name}_halfwidth": None if relative is None else
            float(relative)}


def _cross_validate(rows, max_nodes, floor, folds, rng, kind) -> np.ndarray:
    fold_of = rng.permutation(len(rows)) % folds
    heldout = np.empty(len(rows))
    for k in range(folds):
        test = fold_of == k
        try:
            coef = fit_coefficients(rows[~test], max_nodes, floor, kind)
        except ValueError as err:
            raise ValueError(f"cross-validation fold {k + 1} of {folds} cannot be fitted ({err}); take more probes")
        heldout[test] = coef.predict(rows[test])
    return heldout


def _bootstrap(rows, max_nodes, floor, times, rng, kind) -> list:
    fits = []
    for _ in range(times):
        try:
            fits.append(fit_coefficients(rows[rng.integers(0, len(rows), len(rows))], max_nodes, floor, kind))
        except ValueError:  # a resample with no demand (or misses) variation: no fit, skip it
            continue
    if len(fits) < times // 2:
        raise ValueError(f"only {len(fits)} of {times} bootstrap resamples could be fitted; take more probes")
    return fits
