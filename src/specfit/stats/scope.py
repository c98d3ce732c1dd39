"""``Stats``, every counter of an enabled model by span, and ``GenerateScope``, which accounts one ``generate()``
call (prefill, cycles, decode) into them. The spans and the clocks are described in ``specfit.stats``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Callable

from .counters import Counters
from .display import spans_html, spans_line
from .trace import CycleRecord, Trace

__all__ = ["Stats", "GenerateScope"]


@dataclass
class Stats:
    """``model.specfit.stats``: every counter of an enabled model, by span.

    - ``last_generate``: the last ``generate()`` call (its decode phase; the call's ``prefill_seconds`` rides along,
      so end-to-end tok/s needs nothing else). Replaced by each call.
    - ``total``: the running sum since ``reset()`` (or ``enable``): every forward, every call.
    - ``last_prefill``: the last call's prompt forward. ``last_forward``: the last target forward.
    - ``trace``: ``None`` (off), or a list that receives one ``CycleRecord`` per decoding cycle of an assistant
      (plain decoding records none); turn it on with ``start_trace()``.

    ``repr`` labels both spans on two lines; in a notebook the object shows as a table of both.
    """

    total: Counters = field(default_factory=Counters)
    last_forward: Counters = field(default_factory=Counters)
    last_prefill: Counters = field(default_factory=Counters)
    last_generate: Counters = field(default_factory=Counters)
    scope: "GenerateScope | None" = field(default=None, repr=False)
    trace: list | None = field(default=None, repr=False)  # set to [] to record one CycleRecord per decoding cycle
    call_started: float | None = field(default=None, repr=False)  # perf_counter() at generate()'s entry
    call_waited: float = field(default=0.0, repr=False)  # seconds that call waited for another thread's call
    # set by the runtime on a device with queued work (CUDA): waits for all of it and counts the copies' time; a
    # generate() scope calls it before it reads the clock or the counters, so no queued work is missed or misplaced
    settle: Callable[[], None] | None = field(default=None, repr=False)
    last_method: str | None = None  # the decoding path of the last generate() call (see the module docstring)
    # the cost profile SpecFit's selector started from and whether it is refreshed online (set by SpecFit)
    cost_profile: str | None = None
    # new tokens of each row of the last generate() call that decoded a batch with an assistant (None otherwise)
    last_rows: list[int] | None = None

    def reset(self) -> None:
        """Zero ``total`` and the ``last_*`` spans (a running trace is kept)."""
        self.total, self.last_forward = Counters(), Counters()
        self.last_prefill, self.last_generate, self.last_method = Counters(), Counters(), None

    def start_trace(self) -> "Trace":
        """Record one ``CycleRecord`` per decoding cycle from now on (an earlier trace is dropped); returns the
        ``Trace``, also at ``stats.trace``. ``stats.trace = None`` stops recording."""
        self.trace = Trace()
        return self.trace

    def generate_called(self, started: float | None = None, waited: float = 0.0) -> None:
        """Start the clock of a ``generate()`` call (its preparation counts as prefill time; ``started``: the call's
        entry, before ``waited`` seconds spent waiting for another thread's call) and clear the previous call's
        figures, so a call that fails or takes another path never shows them as its own."""
        self.call_started = time.perf_counter() if started is None else started
        self.call_waited = waited
        self.last_prefill, self.last_generate, self.last_method = Counters(), Counters(), None
        self.last_rows = None

    def begin_generate(self) -> "GenerateScope":
        self.scope = GenerateScope(self, self.call_started, self.call_waited)
        self.call_started, self.call_waited = None, 0.0
        return self.scope

    def forward_done(self, counters: Counters) -> None:
        self.last_forward = counters
        self.total += counters
        if self.scope is not None and self.scope.after_prefill is None:
            self.scope.prefill_done()  # the first forward of a generate() call is its prefill

    def _last_label(self) -> str:
        method = getattr(self, "last_method", None)  # which path the last call ran, where the runtime records it
        return "the last generate() call" + (f", {method}" if method else "")

    def __repr__(self) -> str:
        line = spans_line(self.last_generate, self.total, self._last_label(), self.last_generate != Counters())
        return line if self.cost_profile is None else f"{line[:-1]}\n      cost profile: {self.cost_profile})"

    def _repr_html_(self) -> str:
        return spans_html(self.last_generate, self.total, self._last_label())


_ADDITIVE = {f.name for f in fields(Counters)}


def _seconds(value) -> bool:
    """A finite number of seconds >= 0 (bools are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


class GenerateScope:
    """Accounts one ``generate()`` call: prefill counters and wall clock, then the decode phase (cycles, tokens, wall
    clock until ``end``)."""

    def __init__(self, stats: Stats, started: float | None = None, waited: float = 0.0):
        self.stats, self.waited = stats, waited
        self.start = stats.total.copy()
        self.after_prefill: Counters | None = None
        self.t_prefill = started if started is not None else time.perf_counter()  # the prefill's clock starts here
        self.prefill_seconds = 0.0

    def prefill_done(self) -> None:
        """The prefill has been issued: wait until it has run (on CUDA), then start the decode clock. Counters are
        taken at the first call (the prefill's forward); a later call (after the prefill's lm_head, from the decode
        loop) moves the boundary, so prefill and decode together still cover the whole call."""
        self._settle()
        if self.after_prefill is None:
            self.after_prefill = self.stats.total.copy()
        now = time.perf_counter()
        self.prefill_seconds += now - self.t_prefill  # a later call moves the boundary: the time between is prefill
        self.t_prefill = now

    def _settle(self) -> None:
        if self.stats.settle is not None:
            self.stats.settle()

    def cycle(self, pool: int, verified: int, committed: int, seconds: float, measurement: float, demand: int,
              misses: int, draft_seconds: float, expected: float = 0.0, predicted: float | None = None,
              host: int = 0, counts: dict | None = None, way: str = "", row_nodes=(),
              row_levels=()) -> None:
        """One decoding cycle; ``seconds`` is its wall clock, ``measurement`` the part of it spent measuring,
        ``expected`` the tokens the assistant expected it to commit, ``predicted`` the seconds its cost model
        predicted for it, drafting included (None: the cycle was not forecast, and adds nothing); ``misses`` the
        experts its verify forward copied, ``host`` those it computed on the host lane; ``counts``: more
        ``Counters`` fields the assistant counted in it (e.g. ``{"cost_refresh_cycles": 1}``), added; ``way``,
        ``row_nodes`` and ``row_levels`` go to the trace (``CycleRecord``)."""
        if predicted is not None and not _seconds(predicted):
            raise ValueError(f"predicted= is the cost model's forecast of the cycle in seconds, a finite number >= 0 "
                             f"(None: not forecast), got {predicted!r}")
        if self.stats.trace is not None:
            self.stats.trace.append(CycleRecord(verified, demand, seconds, pool, committed, misses, draft_seconds,
                                                measurement, None if predicted is None else float(predicted), host,
                                                way, tuple(row_nodes), tuple(row_levels)))
        t = self.stats.total
        if predicted is not None:
            t.predicted_seconds += float(predicted)
            t.forecast_cycles += 1
        for name, value in (counts or {}).items():
            if name not in _ADDITIVE:
                raise ValueError(f"counts= names Counters fields to add to, got {name!r}")
            setattr(t, name, getattr(t, name) + value)
        t.cycles += 1
        t.nodes_drafted += pool
        t.nodes_verified += verified
        t.tokens_committed += committed
        t.expected_tokens += expected
        t.measurement_seconds += measurement

    def end(self, new_tokens: int, autoregressive: bool = False) -> None:
        """Close the call: decode time is the wall clock since the prefill ended. ``autoregressive``: plain
        decoding, one token per forward."""
        t = self.stats.total
        if self.after_prefill is None:
            self.prefill_done()
        self._settle()
        t.decode_seconds += time.perf_counter() - self.t_prefill
        if autoregressive:
            steps = t.forwards - self.after_prefill.forwards
            t.cycles += steps
            t.tokens_committed += steps
            t.expected_tokens += steps
        t.new_tokens += new_tokens
        t.prefill_seconds += self.prefill_seconds
        t.lock_wait_seconds += self.waited
        self.stats.last_prefill = self.after_prefill - self.start
        self.stats.last_prefill.prefill_seconds = self.prefill_seconds
        self.stats.last_generate = t - self.after_prefill
        self.stats.last_generate.new_tokens = new_tokens
        # the call's own prefill time rides along, so last_generate alone gives end-to-end tok/s
        self.stats.last_generate.prefill_seconds = self.prefill_seconds
        self.stats.scope = None
