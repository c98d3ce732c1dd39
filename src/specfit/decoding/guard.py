"""The dominance guard: SpecFit runs each cycle its own way or EAGLE-3's, whichever the clock says pays more.

SpecFit's way (routes for every drafted node, the selector after every level, the stop rule) costs drafting work
that EAGLE-3's does not do: a route head per level, every node of a level processed, the selector. Where copies
are cheap (many slots, a fast link) its choice is close to EAGLE-3's own tree and that work is not repaid
(issue 38's counterfactual instrument, ``benchmarks/counterfactual.py``). Both ways are lossless, so SpecFit may run
a cycle either way.

The guard keeps, per way (*arm*), the tokens its cycles committed and the seconds they took, each earlier cycle
weighing ``decay`` times less per later cycle, and runs the arm with the most tokens per second. The other arm runs
again when its *optimistic* rate, its rate plus ``z`` standard errors, passes the better arm's rate. The standard
error is the ratio estimator's, from the arm's own cycles (``sum (t - rate x s)^2 / (sum s)^2``), and never below
``spread x rate / sqrt(weight)``: a cycle's tokens vary from one to the depth, so two ways a few percent apart are
mixed while their evidence cannot tell them apart (losing at most that few percent), one clearly slower is tried
again only once its evidence has aged (its weight decays with every cycle of the other), and a change of workload
or load is noticed. SpecFit's way runs ``warmup`` cycles before EAGLE-3's is first tried (its acceptance model and
online cost refresh settle meanwhile); then each other arm runs ``trials`` cycles before it is compared, so one
unlucky cycle (a burst of load) does not shut a way out.

Pure Python, no torch: a few running sums per arm, a few float operations per cycle.

>>> g = Guard(warmup=2, trials=1)
>>> g.choose()
'specfit'
>>> g.record("specfit", tokens=2, seconds=0.1); g.choose()     # still warming up
'specfit'
>>> g.record("specfit", tokens=2, seconds=0.1); g.choose()     # EAGLE-3's way was never tried
'eagle3'
>>> for _ in range(30):
...     g.record("eagle3", tokens=2, seconds=0.2)   # half the rate
...     g.record("specfit", tokens=2, seconds=0.1)
>>> [g.choose() for _ in range(3)]
['specfit', 'specfit', 'specfit']
"""

from __future__ import annotations

import math

__all__ = ["Guard", "ARMS", "DECAY", "SPREAD", "Z", "WARMUP", "TRIALS"]

ARMS = ("specfit", "eagle3")
DECAY = 0.99  # weight of a cycle per later cycle: about the last 100 cycles count
SPREAD = 0.3  # the least relative standard error of one cycle's tokens per second
Z = 1.0  # standard errors of optimism
WARMUP = 32  # cycles of the first arm (SpecFit's way) before another is tried
TRIALS = 4  # cycles every other arm runs before its rate is compared


class Guard:
    """Which arm runs the next cycle (module docstring)."""

    def __init__(self, decay: float = DECAY, spread: float = SPREAD, z: float = Z, warmup: int = WARMUP,
                 trials: int = TRIALS, arms=ARMS):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        if not (spread >= 0.0 and z >= 0.0):
            raise ValueError(f"spread and z must be >= 0, got {spread!r}, {z!r}")
        self.decay, self.spread, self.z, self.arms = float(decay), float(spread), float(z), tuple(arms)
        self.warmup, self.trials = int(warmup), max(int(trials), 1)
        # per arm, decayed sums over its cycles: weight (cycles), t, s, t^2, t s, s^2
        self.sums = {arm: [0.0] * 6 for arm in self.arms}
        self.cycles = {arm: 0 for arm in self.arms}  # cycles run, undiscounted

    def rate(self, arm: str) -> float | None:
        """Tokens per second of the arm's cycles (discounted); None before its first cycle."""
        _, t, s, *_ = self.sums[arm]
        return t / s if s > 0 else None

    def error(self, arm: str) -> float:
        """The standard error of the arm's rate (see the module docstring)."""
        w, t, s, tt, ts, ss = self.sums[arm]
        r = t / s
        spread = max(tt - 2 * r * ts + r * r * ss, 0.0) / (s * s)
        return max(math.sqrt(spread), self.spread * r / math.sqrt(w))

    def choose(self) -> str:
        """The arm for the next cycle."""
        if self.cycles[self.arms[0]] < self.warmup:
            return self.arms[0]
        fresh = [arm for arm in self.arms[1:] if self.cycles[arm] < self.trials] \
            or [arm for arm in self.arms if self.sums[arm][2] <= 0.0]
        if fresh:
            return fresh[0]
        rates = {arm: self.rate(arm) for arm in self.arms}
        best = max(self.arms, key=lambda arm: (rates[arm], -self.arms.index(arm)))
        for arm in self.arms:
            if arm != best and rates[arm] + self.z * self.error(arm) > rates[best]:
                return arm
        return best

    def record(self, arm: str, tokens: float, seconds: float) -> None:
        """One cycle of ``arm``: its committed tokens and wall clock; every earlier cycle decays."""
        if arm not in self.sums:
            raise ValueError(f"unknown arm {arm!r}; arms: {self.arms}")
        if not (math.isfinite(seconds) and seconds > 0):
            return
        d = self.decay
        for sums in self.sums.values():
            sums[:] = [d * x for x in sums]
        t, s = float(tokens), float(seconds)
        for i, x in enumerate((1.0, t, s, t * t, t * s, s * s)):
            self.sums[arm][i] += x
        self.cycles[arm] += 1
