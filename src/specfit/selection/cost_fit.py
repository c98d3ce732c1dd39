"""The monotone NNLS fit of the cycle-time model (see ``specfit.selection.cost_model``): timed cycles in, the
intercepts, ``beta``, the copy coefficient's two parts and (where the records computed experts on the host lane) the
host coefficient's two parts out, with intercepts that never fall with the node count.

Pure NumPy (and SciPy's ``nnls``), no import of the model: ``CostModel.fit`` calls ``fit_coefficients``, and
``specfit.selection.fit_quality`` refits it hundreds of times (bootstrap, cross-validation).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Coefficients", "KINDS", "as_rows", "fit_coefficients"]

KINDS = ("cache-aware", "paper")  # what a fit prices: demand and copies, or demand alone (the paper's model)


class Coefficients(NamedTuple):
    """A fit's numbers (see ``fit_coefficients``)."""

    intercepts: list  # seconds for n = 0..max_nodes
    beta: float  # seconds per expert computed
    copy_overhead: float  # seconds per expert copied, beside the link's own time (0 for the paper's model)
    link_share: float  # share of the link's time per copy a cycle waits for (1 when it cannot be told apart)
    observed: list  # node counts with records
    host_overhead: float | None = None  # seconds per host expert beside the lane's own time (None: no host records)
    host_share: float | None = None  # share of the lane's time per host expert a cycle waits for

    def predict(self, rows: np.ndarray) -> np.ndarray:
        """Seconds for ``[R, 7]`` rows of (n_nodes, demand, seconds, misses, link_seconds, host, host_seconds)."""
        n, demand, _, misses, link, host, lane = as_rows(rows).T
        seconds = (np.asarray(self.intercepts)[n.astype(int)] + self.beta * demand
                   + misses * (self.copy_overhead + self.link_share * link))
        if self.host_overhead is not None:
            seconds = seconds + host * (self.host_overhead + self.host_share * lane)
        return seconds


FIELDS = 7  # (n_nodes, demand, seconds, misses, link_seconds, host, host_seconds)


def as_rows(records) -> np.ndarray:
    """Records as float ``[R, 7]`` rows of (n_nodes, demand, seconds, misses, link_seconds, host, host_seconds):
    ``misses`` experts copied over a link whose own time per copy was ``link_seconds``, ``host`` experts computed on
    a host lane whose own time per expert was ``host_seconds``. 3- and 5-field records get what they lack as 0."""
    if isinstance(records, np.ndarray) and records.ndim == 2 and records.shape[1] == FIELDS:
        return records.astype(float, copy=False)
    rows = [tuple(r) for r in records]
    out = np.zeros((len(rows), FIELDS))
    for i, r in enumerate(rows):
        if len(r) not in (3, 5, FIELDS):
            raise ValueError(f"record {i} has {len(r)} fields; give (n_nodes, demand, seconds), (n_nodes, demand, "
                             f"seconds, misses, link_seconds) or those and (host, host_seconds)")
        out[i, : len(r)] = r
    return out


def fit_coefficients(rows: np.ndarray, max_nodes: int | None = None, floor: float = 0.0,
                     kind: str = "paper") -> Coefficients:
    """The monotone NNLS fit behind ``CostModel.fit`` on ``[R, 5]`` rows (``as_rows``). Pure numpy + scipy, fast
    enough to refit hundreds of times (bootstrap, cross-validation).

    The unknowns are ``intercepts[n0] - floor`` (``n0`` the smallest observed count, ``floor`` the drafting sum),
    the increments between consecutive observed counts, ``beta`` and, for ``kind="cache-aware"``, the copy
    coefficient's two parts, all >= 0 (``scipy.optimize.nnls``): a record at count ``n`` has a 1 for the base, for
    every increment up to ``n``, then its demand, its misses and its misses x link seconds. Fitting increments
    instead of one free intercept per count keeps NNLS from trading intercepts against beta when demand grows with
    the count. When the records' copies ran over one link only (a GPU, or a CPU run with one emulated link),
    ``link_share`` cannot be told from ``copy_overhead``: it is held at 1 (a copy waits for all of the link's time)
    and the link's time is taken off the seconds before the fit. Records that computed experts on a host lane add
    the host coefficient's two parts the same way: ``host_overhead`` per host expert and ``host_share`` of the
    lane's own time per expert (held at 1 when the records ran on one lane only); without such records both are
    None. A count with no record has no data for its
    intercept: it is filled by linear interpolation between the nearest observed counts, or beyond the observed
    range by extending the line through the two nearest observed counts (clamped at ``floor``; flat if only one
    count was observed).
    """
    from scipy.optimize import nnls

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    rows = as_rows(rows)
    n_nodes, demand, seconds, misses, link, host, lane = rows.T
    if not np.all(np.isfinite(rows)) or np.any(rows < 0) or np.any(n_nodes != np.round(n_nodes)):
        raise ValueError("records must be (n_nodes >= 0 integer, demand >= 0, seconds >= 0, misses >= 0, "
                         "link_seconds >= 0, host >= 0, host_seconds >= 0), all finite")
    observed = sorted({int(n) for n in n_nodes})
    if len(rows) < len(observed) + 2:
        raise ValueError(
            f"{len(rows)} records are too few to fit {len(observed)} intercepts and beta; "
            f"give at least {len(observed) + 2}"
        )
    if all(np.ptp(demand[n_nodes == n]) == 0 for n in observed):
        raise ValueError("demand never varies at a fixed node count, so beta cannot be told from the intercepts")
    top = observed[-1] if max_nodes is None else int(max_nodes)
    if top < observed[-1]:
        raise ValueError(f"max_nodes={top} is below the largest node count in the records ({observed[-1]})")
    aware = kind == "cache-aware"
    if aware and np.ptp(misses) == 0:
        raise ValueError("misses never vary in the records (every expert resident, or every one copied), so the "
                         "copy coefficient cannot be told from beta; probe with fewer slots or colder caches")
    links = np.unique(link[misses > 0]) if aware else np.zeros(0)
    share = len(links) >= 2  # the link's share is fitted only where the records ran over two links or more
    hosted = aware and bool(np.any(host > 0))  # records with host experts: the host term is fitted
    host_share = hosted and len(np.unique(lane[host > 0])) >= 2

    # columns: base, increment to observed[1], .., increment to observed[-1], demand[, misses[, misses x link]]
    # [, host[, host x host_seconds]]
    rank = np.searchsorted(observed, n_nodes)
    columns = [np.arange(len(observed))[None, :] <= rank[:, None], demand[:, None]]
    target = seconds - floor
    if aware:
        columns.append(misses[:, None])
        if share:
            columns.append((misses * link)[:, None])
        else:
            target = target - misses * link
    if hosted:
        columns.append(host[:, None])
        if host_share:
            columns.append((host * lane)[:, None])
        else:
            target = target - host * lane
    features = np.hstack(columns).astype(float)
    scale = np.linalg.norm(features, axis=0)  # demand is ~1e3 times the indicator columns; equalise for NNLS
    scale[scale == 0] = 1.0
    coef, _ = nnls(features / scale, target)
    coef = coef / scale
    k = len(observed)
    values = floor + np.cumsum(coef[:k])
    overhead = float(coef[k + 1]) if aware else 0.0
    link_share = float(coef[k + 2]) if share else 1.0
    at = k + 2 + share  # the host columns, after the copy columns
    host_overhead = float(coef[at]) if hosted else None
    host_part = (float(coef[at + 1]) if host_share else 1.0) if hosted else None
    return Coefficients(_fill(observed, values.tolist(), top, floor), float(coef[k]), overhead,
                        link_share if aware else 0.0, observed, host_overhead, host_part)


def _fill(observed: list[int], values: list[float], top: int, floor: float = 0.0) -> list[float]:
    """Intercepts for n = 0..top from the observed counts: interpolate inside, extend the end lines outside (never
    below ``floor``). Non-decreasing values stay non-decreasing."""
    xs, ys = np.array(observed, float), np.array(values, float)
    grid = np.arange(top + 1, dtype=float)
    out = np.interp(grid, xs, ys)
    if len(xs) >= 2:
        lo, hi = grid < xs[0], grid > xs[-1]
        out[lo] = ys[0] + (grid[lo] - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0])
        out[hi] = ys[-1] + (grid[hi] - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return np.maximum(out, floor).tolist()
