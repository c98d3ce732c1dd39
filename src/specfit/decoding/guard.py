"""The dominance guard: SpecFit runs each cycle its own way or EAGLE-3's, whichever the clock says pays more.

SpecFit's way (routes for every drafted node, the selector after every level, the stop rule) costs drafting work
that EAGLE-3's does not do: a route head per level, every node of a level processed, the selector. Where copies
are cheap (many slots, a fast link) its choice is close to EAGLE-3's own tree and that work is not repaid
(issue 38's counterfactual instrument, ``benchmarks/counterfactual.py``). Both ways are lossless, so SpecFit may run
a cycle either way. The guard keeps, per way (*arm*), the tokens its cycles committed and the seconds they took,
each earlier cycle weighing ``decay`` times less per later cycle, and picks the arm with the most tokens per second;
the other arm is tried again when its optimistic rate (its rate x ``1 + spread / sqrt(weight)``, an upper bound that
widens as its evidence ages) passes the better arm's rate, so a change of workload or load is noticed. SpecFit's
way runs ``warmup`` cycles before EAGLE-3's is first tried (its acceptance model and online cost refresh settle
meanwhile); then an arm with fewer than ``trials`` cycles comes next (one unlucky cycle, e.g. under a burst of load,
does not shut a way out).

Pure Python, no torch: two dicts of running sums, a few float operations per cycle.

>>> g = Guard(warmup=2)
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

__all__ = ["Guard", "ARMS", "DECAY", "SPREAD", "WARMUP", "TRIALS"]

ARMS = ("specfit", "eagle3")
DECAY = 0.99  # weight of a cycle per later cycle: about the last 100 cycles count
SPREAD = 0.5  # relative spread of one cycle's tokens per second (the optimistic bound's width at one cycle)
WARMUP = 32  # cycles of the first arm (SpecFit's way) before another is tried
TRIALS = 3  # cycles every arm runs before its rate is compared


class Guard:
    """Which arm runs the next cycle (module docstring)."""

    def __init__(self, decay: float = DECAY, spread: float = SPREAD, warmup: int = WARMUP, trials: int = TRIALS,
                 arms=ARMS):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        if not spread >= 0.0:
            raise ValueError(f"spread must be >= 0, got {spread!r}")
        self.decay, self.spread, self.warmup, self.arms = float(decay), float(spread), int(warmup), tuple(arms)
        self.trials = max(int(trials), 1)
        self.tokens = {arm: 0.0 for arm in self.arms}
        self.seconds = {arm: 0.0 for arm in self.arms}
        self.weight = {arm: 0.0 for arm in self.arms}  # discounted cycles of each arm
        self.cycles = {arm: 0 for arm in self.arms}  # cycles run, undiscounted

    def rate(self, arm: str) -> float | None:
        """Tokens per second of the arm's cycles (discounted); None before its first cycle."""
        return self.tokens[arm] / self.seconds[arm] if self.seconds[arm] > 0 else None

    def choose(self) -> str:
        """The arm for the next cycle."""
        if self.cycles[self.arms[0]] < self.warmup:
            return self.arms[0]
        fresh = [arm for arm in self.arms[1:] if self.cycles[arm] < self.trials] \
            or [arm for arm in self.arms if self.weight[arm] <= 0.0]
        if fresh:
            return fresh[0]
        rates = {arm: self.rate(arm) for arm in self.arms}
        best = max(self.arms, key=lambda arm: (rates[arm], -self.arms.index(arm)))
        for arm in self.arms:
            if arm != best and rates[arm] * (1.0 + self.spread / math.sqrt(self.weight[arm])) > rates[best]:
                return arm
        return best

    def record(self, arm: str, tokens: float, seconds: float) -> None:
        """One cycle of ``arm``: its committed tokens and wall clock; every earlier cycle decays."""
        if arm not in self.tokens:
            raise ValueError(f"unknown arm {arm!r}; arms: {self.arms}")
        if not (math.isfinite(seconds) and seconds > 0):
            return
        d = self.decay
        for a in self.arms:
            self.tokens[a] *= d
            self.seconds[a] *= d
            self.weight[a] *= d
        self.tokens[arm] += float(tokens)
        self.seconds[arm] += float(seconds)
        self.weight[arm] += 1.0
        self.cycles[arm] += 1
