"""SpecFit's counters as the server reports them, the same on every transformers release: each request's (the
``specfit`` field of a non-streaming response, ``GET /v1/specfit/stats/{id}``) and the totals since start
(``GET /v1/specfit/stats``). Read from the call's ``runtime.stats.last_generate`` (``specfit.stats.Counters``);
tokens are the requests' own (a batched row's through its end token: padding is never counted). No torch."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict

STATS_KEPT = 1024  # per-request counters kept for GET /v1/specfit/stats/{id}, oldest dropped first
WAYS = ("specfit", "eagle3", "plain")


def ways_of(counters, method: str) -> dict[str, int]:
    """The cycles of one call by the way they ran: SpecFit's (its drafting and selector), EAGLE-3's (the guard's
    EAGLE-3 cycles, or the eagle3 assistant) and plain decoding's (one token per cycle); another registered assistant
    under its own name."""
    cycles = counters.cycles
    eagle = getattr(counters, "guard_eagle_cycles", 0)
    plain = getattr(counters, "plain_cycles", 0)  # counted by the batch guard where it exists
    if method == "specfit":
        return {"specfit": cycles - eagle - plain, "eagle3": eagle, "plain": plain}
    if method == "eagle3":
        return {"specfit": 0, "eagle3": cycles - plain, "plain": plain}
    if method == "ar":
        return {"specfit": 0, "eagle3": 0, "plain": cycles}
    return {"specfit": 0, "eagle3": 0, "plain": plain, method: cycles - plain}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _finite(figures: dict) -> dict:
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in figures.items()}


class Ledger:
    """Per-request counters (the last ``STATS_KEPT``) and totals since start; written by the model's thread."""

    def __init__(self):
        self.started = time.monotonic()
        self._requests: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()
        self.totals = {"requests": 0, "tokens": 0, "prompt_tokens": 0, "calls": 0, "batched_calls": 0,
                       "busy_seconds": 0.0, "demand": 0, "hits": 0, "copies": 0, "host_experts": 0,
                       "copy_busy_seconds": 0.0, "left_waiting": 0, "ways": {w: 0 for w in WAYS}}

    def record(self, runtime, requests: list[tuple[str, str | None, int, int]]) -> None:
        """One finished call: ``requests`` its rows as (request id, assistant, prompt tokens, own new tokens)."""
        c = runtime.stats.last_generate
        method = runtime.stats.last_method
        tokens = sum(r[3] for r in requests)
        seconds = c.prefill_seconds + c.decode_seconds
        ways = ways_of(c, method)
        with self._lock:
            t = self.totals
            t["calls"] += 1
            t["batched_calls"] += len(requests) > 1
            call = t["calls"]
            figures = _finite({
                "method": method, "batch": len(requests), "call": call, "call_tokens": tokens,
                "tokens_per_second": _ratio(tokens, seconds), "tokens_per_cycle": c.tokens_per_cycle,
                "copies_per_token": _ratio(c.copies, tokens), "host_experts_per_token": _ratio(c.host_experts, tokens),
                "hit_rate": c.hit_rate if c.demand else None, "cycles": c.cycles, "ways": ways})
            for request_id, assistant, prompt, own in requests:
                self._requests[request_id] = {"assistant": assistant, "tokens": own, "prompt_tokens": prompt,
                                              **figures}
                self._requests.move_to_end(request_id)
                t["requests"] += 1
                t["prompt_tokens"] += prompt
            while len(self._requests) > STATS_KEPT:
                self._requests.popitem(last=False)
            t["tokens"] += tokens
            t["busy_seconds"] += seconds
            t["demand"] += c.demand
            t["hits"] += c.hits
            t["copies"] += c.copies
            t["host_experts"] += c.host_experts
            t["copy_busy_seconds"] += c.copy_busy_seconds
            for way, n in ways.items():
                t["ways"][way] = t["ways"].get(way, 0) + n

    def left_waiting(self) -> None:
        with self._lock:
            self.totals["left_waiting"] += 1

    def get(self, request_id: str) -> dict | None:
        with self._lock:
            found = self._requests.get(request_id)
            return None if found is None else dict(found)

    def summary(self) -> dict:
        """The totals since start, with their rates: tok/s over the calls' summed wall clocks (the model's busy
        time), slot hit rate, copies and host experts per token, ms per copy (an emulated link's set time)."""
        with self._lock:
            t = dict(self.totals, ways=dict(self.totals["ways"]))
        t.update({
            "uptime_seconds": time.monotonic() - self.started,
            "tokens_per_second": _ratio(t["tokens"], t["busy_seconds"]),
            "hit_rate": _ratio(t["hits"], t["demand"]),
            "copies_per_token": _ratio(t["copies"], t["tokens"]),
            "host_experts_per_token": _ratio(t["host_experts"], t["tokens"]),
            "ms_per_copy": None if not t["copies"] else 1e3 * t["copy_busy_seconds"] / t["copies"],
        })
        return _finite(t)
