"""Replacement policies for a layer's expert slots: which resident expert a load evicts, and whether a miss is worth a
slot at all. Pure Python, no torch: ``slots.SlotBook`` keeps the slots and asks its policy.

The seam (``Policy``): per plan, ``observe`` the forward's needed experts (and how many tokens use each), offer the
misses in ``admission`` order, name the ``victims`` of those that find no free slot (None: stream the miss through
scratch, keeping every resident), then ``planned``. ``score(e)`` is how likely expert e is to be needed soon, in
the policy's own units: what it evicts the lowest of. ``expect`` hands it a forecast for the next plan.

A forward's use of an expert weighs ``1 + 0.1 x (tokens routed to it - 1)``: a long prompt ranks the experts it uses
most, a verify forward counts hardly more than a decode step. ``admits(e)`` says whether a miss of ``e`` would
outscore the weakest resident: whether a slot pays for it (a host lane may compute the others where they are). The
frequency policies can also *bypass* (``bypass=True``): stream such a miss through scratch instead of evicting the
weakest resident. Off by default: on the embedded model it saves 1-12% of the misses, but streams 14-60 experts per
token for it, and a streamed expert computes alone, after the scratch ring's copies, so plain decoding and EAGLE-3
ran slower with it at 12 slots (``python benchmarks/run.py cache``, BENCHMARKS.md).

- ``"lru"``: evict the least recently used expert; every miss that finds an evictable slot takes it.
- ``"frequency"``: decayed frequency, ``score = sum of the weights of past uses x 0.9 ** (the layer's plans since
  each)``. Its order changes only when experts are used, so a victim is one ``min`` at C speed.
- ``"frequency-age"``: frequency over age, the rule a study of expert caching found best of the causal policies:
  ``score = f / (age + 1)``, ``f`` the summed weights, ``age`` the plans since the last use.
- ``"forecast"`` (the default): ``"frequency"`` plus a forecast where the decoding method publishes one (SpecFit:
  its drafted pool's predicted routes weighted by their path values, ``tree_forecast``): ``score += 1.0 x`` the
  pool tokens expected to route to the expert. Without one (plain decoding, EAGLE-3, skipped drafting) it is
  ``"frequency"``.
"""

from __future__ import annotations

import difflib
from typing import Callable, Sequence


class Policy:
    """The replacement-policy seam: how one layer's ``SlotBook`` ranks experts (see the module docstring)."""

    name = ""
    reads_forecasts = False  # whether ``expect`` changes anything (else nobody need compute a forecast)

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        """Forget everything learned (the slots were emptied)."""

    def observe(self, needed: list[int], uses: Sequence[int] | None) -> None:
        """A plan starts: ``needed`` are the forward's experts, ``uses`` the tokens routed to each (None: one)."""

    def admission(self, misses: list[int]) -> list[int]:
        """The misses in the order they are offered slots (the likeliest to be needed again first)."""
        return misses

    def victims(self, order, in_use: set[int], incoming: list[int]) -> list[int | None]:
        """For each of ``incoming`` (misses without a free slot, in admission order) the resident of ``order``
        (expert -> slot, least recently used first) it evicts, distinct and never one of ``in_use``; None: it is
        streamed instead."""
        raise NotImplementedError

    def planned(self) -> None:
        """The plan is done (a forecast given by ``expect`` is consumed)."""

    def expect(self, forecast: Sequence[float] | None) -> None:
        """Per expert, the tokens of the coming forwards expected to route to it, for the next plan (None: none)."""

    def score(self, expert: int, order) -> float:
        raise NotImplementedError

    def admits(self, expert: int, order) -> bool:
        """Whether a miss of ``expert``, its use counted, would outrank the weakest resident of ``order`` (all
        slots full, none of them needed by the forward): whether a slot pays for it."""
        raise NotImplementedError


class LRU(Policy):
    """Least recently used first (``SlotBook`` keeps the order); every miss that finds an evictable slot takes it."""

    name = "lru"

    def victims(self, order, in_use, incoming):
        out, n = [], len(incoming)
        for e in order:  # least recently used first
            if e not in in_use:
                out.append(e)
                if len(out) == n:
                    return out
        return out + [None] * (n - len(out))

    def score(self, expert, order):
        """1.0 for the most recently used resident, down to 1/len for the least; 0.0 when not resident."""
        if expert not in order:
            return 0.0
        return (list(order).index(expert) + 1) / len(order)

    def admits(self, expert, order):
        return True


class _Counting(Policy):
    """What the frequency policies share: the weight of a forward's use of an expert, ``1 + extra_use x (tokens -
    1)``; victims by the lowest ``_key`` (the score in the policy's own scale); and ``bypass`` (a miss keyed no
    higher than every evictable resident is streamed)."""

    def __init__(self, num_experts: int, extra_use: float = 0.1, bypass: bool = False, name: str = ""):
        self.extra_use, self.bypass, self.name = extra_use, bypass, name or self.name
        super().__init__(num_experts)

    def _weights(self, needed, uses):
        """(expert, weight) of this forward's uses."""
        if uses is None:
            return ((e, 1.0) for e in needed)
        extra = self.extra_use
        return ((e, 1.0 if n == 1 else 1.0 + extra * (n - 1)) for e, n in zip(needed, uses))

    def _key(self, e: int) -> float:
        raise NotImplementedError

    def _keys(self):
        """The key function for ``min`` and ``sorted`` (a bound method of a list where it can: C speed)."""
        return self._key

    def admission(self, misses):
        return misses if len(misses) < 2 else sorted(misses, key=self._keys(), reverse=True)

    def victims(self, order, in_use, incoming):
        """The weakest evictable residents (ties: the least recently used first), the weakest for the strongest
        miss; from the first miss that does not outscore its victim on (and so every weaker one after it),
        streamed when ``bypass``."""
        key, n = self._keys(), len(incoming)
        if not self.bypass:  # the n weakest (sorted is stable: LRU order on ties)
            out: list[int | None] = [v for v in sorted(order, key=key) if v not in in_use][:n]
            return out + [None] * (n - len(out))
        ranked = (v for v in sorted(order, key=key) if v not in in_use)
        out = []
        for e in incoming:
            v = next(ranked, None)
            if v is None or key(v) >= key(e):
                break
            out.append(v)
        return out + [None] * (n - len(out))

    def admits(self, expert, order):
        return not order or self._key_if_used(expert) > min(map(self._keys(), order))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, extra_use={self.extra_use}, bypass={self.bypass})"


class DecayedFrequency(_Counting):
    """``score = sum over the forwards that used the expert of weight x decay ** (plans since)``, plus
    ``forecast_weight x forecast`` when one is given (``forecast_weight`` 0: forecasts are ignored).

    Kept as ``g = score / decay ** ticks`` (``scale = 1 / decay ** ticks``; a tick per plan), which a tick leaves
    unchanged: the order of experts changes only when they are used, so a victim is one ``min`` over the residents
    by ``g``, at C speed (rescaled before it overflows)."""

    name = "frequency"

    def __init__(self, num_experts: int, decay: float = 0.9, forecast_weight: float = 0.0, **kw):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay, self.forecast_weight = decay, forecast_weight
        self.reads_forecasts = forecast_weight > 0
        super().__init__(num_experts, **kw)

    def reset(self) -> None:
        self.g = [0.0] * self.num_experts  # score x scale
        self.scale = 1.0
        self.forecast: Sequence[float] | None = None

    def observe(self, needed, uses):
        self.scale = scale = self.scale / self.decay
        if scale > 1e200:  # rescale: every score keeps its value
            self.g = [x / scale for x in self.g]
            self.scale = scale = 1.0
        g = self.g
        if uses is None:
            for e in needed:
                g[e] += scale
            return
        extra = self.extra_use * scale
        for e, n in zip(needed, uses):  # a use weighs 1 + extra_use x (tokens - 1), inlined: this runs per layer
            g[e] += scale if n == 1 else scale + extra * (n - 1)

    def victims(self, order, in_use, incoming):
        if self.forecast is not None or len(incoming) > 1 or not order:
            return super().victims(order, in_use, incoming)
        g = self.g  # one miss, no forecast: the keys are g itself, read inline (this runs per layer and forward)
        weakest = min(order, key=g.__getitem__)  # the first of the weakest in LRU order: the LRU one on ties
        if weakest in in_use:  # rare: the experts in use were just counted
            free = [e for e in order if e not in in_use]
            if not free:
                return [None]
            weakest = min(free, key=g.__getitem__)
        return [None] if self.bypass and g[weakest] >= g[incoming[0]] else [weakest]

    def _key(self, e: int) -> float:
        if self.forecast is None:
            return self.g[e]
        return self.g[e] + self.forecast_weight * self.forecast[e] * self.scale

    def _keys(self):
        return self.g.__getitem__ if self.forecast is None else self._key

    def _key_if_used(self, e: int) -> float:
        return self._key(e) + self.scale / self.decay  # one more tick: a use's weight, scaled as the plan will

    def planned(self):
        self.forecast = None

    def expect(self, forecast):
        if self.forecast_weight:
            self.forecast = forecast

    def score(self, expert, order):
        return self._key(expert) / self.scale

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", decay={self.decay}, forecast_weight={self.forecast_weight})"


class FrequencyOverAge(_Counting):
    """The caching study's rule: ``score = f / (age + 1)``, ``f`` the expert's weighted uses, ``age`` the plans since
    its last use. The order changes with every tick, so every victim scores the residents anew."""

    name = "frequency-age"

    def reset(self) -> None:
        self.clock = 0
        self.freq = [0.0] * self.num_experts
        self.last = [0] * self.num_experts  # the clock of each expert's last use

    def observe(self, needed, uses):
        self.clock = clock = self.clock + 1
        freq, last = self.freq, self.last
        for e, w in self._weights(needed, uses):
            freq[e] += w
            last[e] = clock

    def _key(self, e: int) -> float:
        return self.freq[e] / (self.clock - self.last[e] + 1)

    def _key_if_used(self, e: int) -> float:
        return self.freq[e] + 1.0

    def score(self, expert, order):
        return self._key(expert)


FORECAST = "forecast"
DEFAULT = FORECAST
# name -> factory(num_experts) -> Policy
POLICIES: dict[str, Callable[[int], Policy]] = {
    "lru": LRU,
    "frequency-age": FrequencyOverAge,
    "frequency": DecayedFrequency,
    FORECAST: lambda num_experts: DecayedFrequency(num_experts, forecast_weight=1.0, name=FORECAST),
}


def check_policy(name) -> str:
    """``name`` if it names a policy, else a ValueError naming the ones that do (and the closest)."""
    if not isinstance(name, str) or name not in POLICIES:
        close = difflib.get_close_matches(name.lower(), POLICIES, n=1) if isinstance(name, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"cache_policy must be one of {', '.join(repr(n) for n in POLICIES)} (default {DEFAULT!r}: "
                         f"decayed frequency, with the drafted tree's forecast where SpecFit drafts one), got "
                         f"{name!r}{hint}")
    return name


def make_policy(name: str, num_experts: int) -> Policy:
    return POLICIES[check_policy(name)](num_experts)


def tree_forecast(weights: Sequence[float], routes) -> list[list[float]]:
    """Per layer and expert, the tokens of a drafted pool expected to route there: ``sum_v weights[v] x
    routes[v]`` over pool nodes ``v`` (``routes``: bool ``[nodes, layers, experts]``, e.g. a route predictor's;
    ``weights``: each node's chance of being accepted, its path value). Lists of floats, one per layer, as
    ``SlotBook.expect`` takes them.

    >>> import numpy as np
    >>> routes = np.zeros((2, 1, 4), dtype=bool); routes[0, 0, [0, 1]] = True; routes[1, 0, [1, 3]] = True
    >>> tree_forecast([0.5, 0.25], routes)
    [[0.5, 0.75, 0.0, 0.25]]
    """
    import numpy as np

    weights = np.asarray(weights, dtype=np.float64)
    return np.tensordot(weights, np.asarray(routes, dtype=np.float64), axes=1).tolist() if len(weights) else \
        np.zeros(np.shape(routes)[1:]).tolist()
