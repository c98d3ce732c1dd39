"""The dominance guard: each cycle runs SpecFit's way, EAGLE-3's, or plain decoding, whichever the clock says pays.

Every way is lossless, so SpecFit may run a cycle any of them:

- ``"specfit"``: routes for the drafted nodes, the selector after each level, the stop rule (the paper's rule);
- ``"eagle3"``: EAGLE-3's drafting and tree (no routes, no selector), cheaper to draft where copies are cheap;
- ``"plain"``: drafting skipped, the root alone verified: one target forward, as plain decoding (the committed pairs
  wait and reach the drafter in one forward when drafting resumes).

The guard keeps, per way (*arm*), the tokens its cycles committed and the seconds they took, each earlier cycle
weighing ``decay`` times less per later cycle, and runs the arm with the most tokens per second. Each cycle is
learned under the way it *ran* (the caller's ``record(arm, ...)``): its per-arm counts, ``cycles``, equal the
stats' per-way counts, and crediting one way with another's cycles would leave an arm without evidence, which the
guard would then run on every cycle.

Exploration is budgeted in time, the user's currency. After the warm-up (``warmup`` cycles of SpecFit's way, so its
acceptance model and cost refresh settle) and ``trials`` cycles of each other arm, a cycle runs an arm other than the
best only when that arm's *optimistic* rate (its rate plus ``z`` standard errors) passes the best's rate, and only
while the wall clock of such cycles, this one included at the arm's mean cycle time, stays within ``budget`` of all
the recorded cycles' (``explored_seconds <= budget x seconds``; 2% by default). A budget in cycles would let a way
whose cycles take longer (a drafted cycle beside plain ones) take more than its share of the time. The standard error is
the ratio estimator's from the arm's own cycles, never below ``spread x rate / sqrt(weight)``: a way a few percent
slower is retried as soon as the budget allows, a clearly slower one only once its evidence has aged (its weight
decays with every cycle of the others), so a change of workload or load is still noticed.

Pure Python, no torch: a few running sums per arm, a few float operations per cycle.

>>> g = Guard(warmup=2, trials=1)
>>> g.choose()
'specfit'
>>> g.record("specfit", tokens=2, seconds=0.1); g.choose()     # still warming up
'specfit'
>>> g.record("specfit", tokens=2, seconds=0.1); g.choose()     # EAGLE-3's way was never tried
'eagle3'
>>> g.record("eagle3", tokens=2, seconds=0.2); g.choose()      # nor plain decoding
'plain'
>>> g.record("plain", tokens=1, seconds=0.08)
>>> for _ in range(100):
...     g.record(g.choose(), tokens=2, seconds=0.1)
>>> g.choose(), g.explored_seconds <= g.budget * g.seconds
('specfit', True)
"""

from __future__ import annotations

import math

__all__ = ["Guard", "ARMS", "DECAY", "SPREAD", "Z", "WARMUP", "TRIALS", "BUDGET"]

ARMS = ("specfit", "eagle3", "plain")
DECAY = 0.99  # weight of a cycle per later cycle: about the last 100 cycles count
SPREAD = 0.3  # the least relative standard error of one cycle's tokens per second
Z = 1.0  # standard errors of optimism
WARMUP = 8  # cycles of the first arm (SpecFit's way) before another is tried
TRIALS = 3  # cycles every other arm runs before its rate is compared
BUDGET = 0.02  # the most wall clock, as a share of all cycles', spent on an arm the clock says is slower than the best


class Guard:
    """Which arm runs the next cycle (module docstring)."""

    def __init__(self, decay: float = DECAY, spread: float = SPREAD, z: float = Z, warmup: int = WARMUP,
                 trials: int = TRIALS, arms=ARMS, budget: float = BUDGET):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        if not (spread >= 0.0 and z >= 0.0):
            raise ValueError(f"spread and z must be >= 0, got {spread!r}, {z!r}")
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"budget is a share of the cycles' time in [0, 1], got {budget!r}")
        self.decay, self.spread, self.z, self.arms = float(decay), float(spread), float(z), tuple(arms)
        self.warmup, self.trials, self.budget = int(warmup), max(int(trials), 1), float(budget)
        # per arm, decayed sums over its cycles: weight (cycles), t, s, t^2, t s, s^2
        self.sums = {arm: [0.0] * 6 for arm in self.arms}
        self.cycles = {arm: 0 for arm in self.arms}  # cycles run, undiscounted
        self.warmed = False  # warm-up and trials done elsewhere (``seeded``): this guard compares from its first cycle
        self.explored = 0  # cycles recorded on an arm slower than the best, after every arm's trials
        self.explored_seconds = 0.0  # their wall clock
        self.seconds = 0.0  # wall clock of every recorded cycle, undiscounted

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

    def best(self) -> str | None:
        """The arm of the highest rate, once every arm has run its trials (None before)."""
        if not self.warmed and (self.cycles[self.arms[0]] < self.warmup
                                or any(self.cycles[a] < self.trials for a in self.arms[1:])):
            return None
        if any(self.sums[a][2] <= 0.0 for a in self.arms):
            return None
        return max(self.arms, key=lambda arm: (self.rate(arm), -self.arms.index(arm)))

    def choose(self) -> str:
        """The arm for the next cycle."""
        if not self.warmed and self.cycles[self.arms[0]] < self.warmup:
            return self.arms[0]
        fresh = ([] if self.warmed else [arm for arm in self.arms[1:] if self.cycles[arm] < self.trials]) \
            or [arm for arm in self.arms if self.sums[arm][2] <= 0.0]
        if fresh:
            return fresh[0]
        best = self.best()
        top = rates_best = self.rate(best)
        chosen = best
        for arm in self.arms:
            if arm == best:
                continue
            w, _, s, *_ = self.sums[arm]
            cycle = s / w  # the arm's mean cycle time
            if self.explored_seconds + cycle > self.budget * (self.seconds + cycle):
                continue  # over the budget with this cycle
            optimistic = self.rate(arm) + self.z * self.error(arm)
            if optimistic > rates_best and optimistic > top:
                chosen, top = arm, optimistic
        return chosen

    def seeded(self, other: "Guard", weight: float = 2.0) -> "Guard":
        """This guard, starting from what ``other`` learned (each arm's rate, at most ``weight`` cycles' worth of
        evidence; once ``other`` was past its warm-up and trials, this one is too, while ``cycles`` still counts the
        cycles it ran): a batch that changes size starts from the guard of its nearest size, and its own clock soon
        outweighs the seed.

        >>> a = Guard(warmup=1, trials=1)
        >>> for arm, rate in (("specfit", 1.0), ("eagle3", 1.0), ("plain", 3.0)):
        ...     a.record(arm, tokens=rate, seconds=1.0)
        >>> b = Guard(warmup=1, trials=1).seeded(a)
        >>> b.choose(), round(b.rate("plain"), 6), b.sums["plain"][0] <= 2.0, b.cycles["plain"]
        ('plain', 3.0, True, 0)
        """
        for arm in self.arms:
            sums = other.sums[arm]
            scale = min(1.0, weight / sums[0]) if sums[0] > 0 else 0.0
            self.sums[arm] = [scale * x for x in sums]
        self.warmed = other.warmed or other.best() is not None
        return self

    def record(self, arm: str, tokens: float, seconds: float) -> None:
        """One cycle run ``arm``'s way: its committed tokens and wall clock; every earlier cycle decays."""
        if arm not in self.sums:
            raise ValueError(f"unknown arm {arm!r}; arms: {self.arms}")
        if not (math.isfinite(seconds) and seconds > 0):
            return
        best = self.best()
        if best is not None and arm != best:
            self.explored += 1
            self.explored_seconds += float(seconds)
        self.seconds += float(seconds)
        d = self.decay
        for sums in self.sums.values():
            sums[:] = [d * x for x in sums]
        t, s = float(tokens), float(seconds)
        for i, x in enumerate((1.0, t, s, t * t, t * s, s * s)):
            self.sums[arm][i] += x
        self.cycles[arm] += 1
