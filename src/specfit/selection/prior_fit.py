"""The core of an online refresh: decayed least squares over non-negative unknowns, each with a prior, and a learned
scale for the parts of a cycle that run on the host.

A cycle time is a sum of unknown coefficients times known features (``seconds = x . c``, every ``c >= 0``). Online
records rarely vary every unknown, so each has a prior: its profile value, times a *scale* learned from the same
records for the parts that run on the host (``host[k]``: every part but a link's own share), with a relative width
of ``PRIOR_WIDTH``. A machine uniformly 1.5x slower than the profile's moves the unknowns the records do not reach
by the same 1.5x; a link's time per copy, which load does not change, stays. Records weigh ``decay`` times less per
later record. The solve is one small Cholesky factorisation and an NNLS (tens of microseconds); no torch.

>>> fit = PriorFit(prior=[1.0, 0.5], host=[True, True], noise=0.1, decay=1.0)
>>> for x in ([1.0, 1.0], [1.0, 2.0], [1.0, 0.0]) * 10:   # a machine twice as slow as the prior says
...     fit.add(x, 2.0 * (1.0 + 0.5 * x[1]))
>>> [round(float(c), 2) for c in fit.solve()], round(fit.scale, 2)
([2.0, 1.0], 2.0)
"""

from __future__ import annotations

import numpy as np

__all__ = ["PriorFit", "PRIOR_WIDTH", "SCALE_RANGE"]

PRIOR_WIDTH = 0.5  # the prior's standard deviation, relative to the prior's value (the scale included)
SCALE_RANGE = (0.2, 5.0)  # the host-time scale is clamped to this range


class PriorFit:
    """Decayed normal equations of ``seconds = x . c`` (``c >= 0``) with a prior per unknown (module docstring).

    Args:
        prior: [K] the unknowns' prior values (e.g. a calibrated profile's).
        host: [K] bool, the unknowns the host-time scale applies to (False: a link's own share).
        noise: a record's noise in seconds (weighs the records against the priors).
        decay: weight of a record per later record.
    """

    def __init__(self, prior, host, noise: float, decay: float):
        self.prior = np.asarray(prior, float)  # [K]
        self.host = np.asarray(host, float)  # [K] 1: scaled with the host's speed
        positive = self.prior[self.prior > 0]
        floor = np.where(self.host > 0, 1e-3 * (positive.mean() if len(positive) else 1.0), 0.05)
        self.units = np.maximum(self.prior, floor)  # [K] the unknowns are fitted in these units
        self.noise, self.decay = float(noise), float(decay)
        k = len(self.prior)
        self._h = np.zeros((k, k))  # decayed sum of x x^T (x in units, over noise)
        self._g = np.zeros(k)  # decayed sum of x y
        self._pp = self._py = 0.0  # decayed sums for the scale: p^2 and p (y - link part)
        self.scale = 1.0
        self.records = 0

    def add(self, x, seconds: float) -> None:
        """One record: features ``x`` [K] and the cycle's ``seconds``."""
        x = np.asarray(x, float)
        link_part = float(self.prior[~(self.host > 0)] @ x[~(self.host > 0)])
        p = float((self.prior * self.host) @ x)  # the prior's host part of this cycle
        d = self.decay
        self._pp = d * self._pp + p * p
        self._py = d * self._py + p * (seconds - link_part)
        xs = x * self.units / self.noise
        self._h *= d
        self._h += np.outer(xs, xs)
        self._g *= d
        self._g += xs * (seconds / self.noise)
        self.records += 1

    def solve(self) -> np.ndarray:
        """[K] the unknowns fitted on the records so far and the priors (all >= 0)."""
        from scipy.linalg import cholesky, solve_triangular
        from scipy.optimize import nnls

        lo, hi = SCALE_RANGE
        self.scale = min(max(self._py / self._pp, lo), hi) if self._pp > 0 else 1.0
        center = self.prior * np.where(self.host > 0, self.scale, 1.0) / self.units  # [K] the priors, in units
        width = PRIOR_WIDTH * np.maximum(center, 1e-3)  # [K]
        h = self._h + np.diag(1.0 / width**2)
        g = self._g + center / width**2
        r = cholesky(h, lower=False)  # h = r^T r
        u, _ = nnls(r, solve_triangular(r, g, trans="T"))
        return u * self.units
