"""Counters: one dataclass for everything SpecFit counts, read as ``model.specfit.stats``.

``Counters`` holds raw, additive counts; rates are derived properties, computed when read. ``Stats`` keeps
``total`` (since the last ``reset()``), ``last_forward``, and for the last ``generate()`` call ``last_prefill``
(the prompt's forward) and ``last_generate`` (everything after it: the decode phase the tables report).

Times are wall clock: ``prefill_seconds`` runs from the entry of ``generate()`` to the end of the prompt's forward,
``decode_seconds`` from there to the end of decoding, so together they are what a stopwatch around the call reads.
Measurement-only work done inside the call (the route oracle's extra forwards) is *included* in them and also shown
on its own, as ``measurement_seconds``.

Copies are counted where they were issued: a forward's demand copies (bytes and copy-path time) in that forward's
counters, read when it ends; prefetch copies (issued between forwards) in ``total``, bytes when issued and time when
they have landed, at the latest when the ``generate()`` call ends. So ``bytes_copied / copy_busy_seconds`` is the
bandwidth of the same copies in every scope.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable


@dataclass
class Counters:
    # offloaded experts (every target forward)
    forwards: int = 0
    demand: int = 0  # sum over layers of the distinct experts a forward needs
    hits: int = 0
    misses: int = 0  # = host-to-device copies (loads + streamed)
    streamed: int = 0  # misses copied through scratch because every slot was in use by the same forward
    bytes_copied: int = 0  # of every host-to-device expert copy counted here (misses and prefetches)
    # the time the copy path spent on those copies, the same definition on both devices: CUDA, copy-stream event
    # time of each batch of copies (first copy starting to last landing); CPU, the memcpy time, or with an emulated
    # link the link's time per copy
    copy_busy_seconds: float = 0.0
    # host wall time blocked by copies: CPU, the memcpy and the waits for the emulated link (compute runs on the
    # host); CUDA, issuing them: microseconds from pinned memory, about the copy time from pageable memory. (On CUDA
    # compute waits for copies on the device, which no host clock sees: it shows in decode_seconds.)
    copy_wait_seconds: float = 0.0
    pageable_copies: int = 0  # CUDA copies from host memory that is not pinned: synchronous, overlapping nothing
    prefetch_copies: int = 0  # copies started ahead of a forward (SpecFit's prefetch during drafting)
    prefetch_bytes: int = 0  # their bytes (also in bytes_copied)
    prefetch_wasted: int = 0  # prefetched experts the next forward did not need
    # speculative decoding (generate calls with an assistant)
    cycles: int = 0
    nodes_drafted: int = 0  # draft pool size, summed over cycles
    nodes_verified: int = 0  # draft nodes in the verified subtree (the root not counted)
    tokens_committed: int = 0  # accepted draft tokens + the bonus token
    expected_tokens: float = 0.0  # the assistant's expected committed tokens per cycle, summed (AR: 1 per step)
    new_tokens: int = 0  # tokens returned by generate (AR too)
    prefill_seconds: float = 0.0  # wall clock from generate()'s entry to the end of the prompt's forward
    decode_seconds: float = 0.0  # wall clock of everything generate() did after the prefill (oracle included)
    measurement_seconds: float = 0.0  # the part of decode_seconds spent on measurement only (the route oracle)

    def __iadd__(self, other: "Counters") -> "Counters":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> "Counters":
        return Counters(**asdict(self))

    # derived rates
    @property
    def hit_rate(self) -> float:
        return self.hits / self.demand if self.demand else 0.0

    @property
    def copies(self) -> int:
        """Every host-to-device expert copy: misses of forwards plus prefetches."""
        return self.misses + self.prefetch_copies

    @property
    def copy_bandwidth(self) -> float:
        """Bytes per second of copy-path time (``bytes_copied / copy_busy_seconds``)."""
        return self.bytes_copied / self.copy_busy_seconds if self.copy_busy_seconds else 0.0

    @property
    def copies_per_token(self) -> float:
        return self.copies / self.new_tokens if self.new_tokens else 0.0

    @property
    def nodes_per_cycle(self) -> float:
        return self.nodes_verified / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        return self.tokens_committed / self.cycles if self.cycles else 0.0

    @property
    def expected_over_committed(self) -> float:
        """Expected committed tokens (what the selector predicted) over the tokens committed: 1.0 when the
        acceptance estimates are right on average, below 1 when they understate acceptance."""
        return self.expected_tokens / self.tokens_committed if self.tokens_committed else 0.0

    @property
    def seconds_per_cycle(self) -> float:
        return self.decode_seconds / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode tok/s, wall clock (prefill excluded, measurement work included: what the call took)."""
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def end_to_end_tokens_per_second(self) -> float:
        """tok/s over the whole call, prefill included."""
        seconds = self.prefill_seconds + self.decode_seconds
        return self.new_tokens / seconds if seconds else 0.0

    @property
    def tokens_per_second_excluding_measurement(self) -> float:
        """The paper's figure: decode tok/s with the route oracle's measurement time taken out. Not what a user
        waits for when the oracle runs; equal to ``tokens_per_second`` when it does not."""
        seconds = self.decode_seconds - self.measurement_seconds
        return self.new_tokens / seconds if seconds > 0 else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in ("copies", "hit_rate", "copy_bandwidth", "copies_per_token", "nodes_per_cycle", "tokens_per_cycle",
                     "seconds_per_cycle", "tokens_per_second", "end_to_end_tokens_per_second",
                     "tokens_per_second_excluding_measurement", "expected_over_committed"):
            out[name] = getattr(self, name)
        return out


@dataclass
class Stats:
    total: Counters = field(default_factory=Counters)
    last_forward: Counters = field(default_factory=Counters)
    last_prefill: Counters = field(default_factory=Counters)
    last_generate: Counters = field(default_factory=Counters)
    scope: "GenerateScope | None" = field(default=None, repr=False)
    trace: list | None = field(default=None, repr=False)  # set to [] to record one CycleRecord per decoding cycle
    call_started: float | None = field(default=None, repr=False)  # perf_counter() at generate()'s entry
    # set by the runtime on a device with queued work (CUDA): waits for all of it and counts the copies' time; a
    # generate() scope calls it before it reads the clock or the counters, so no queued work is missed or misplaced
    settle: Callable[[], None] | None = field(default=None, repr=False)

    def reset(self) -> None:
        self.total, self.last_forward = Counters(), Counters()
        self.last_prefill, self.last_generate = Counters(), Counters()

    def generate_called(self) -> None:
        """Start the clock of a ``generate()`` call (its preparation counts as prefill time)."""
        self.call_started = time.perf_counter()

    def begin_generate(self) -> "GenerateScope":
        self.scope = GenerateScope(self, self.call_started)
        self.call_started = None
        return self.scope

    def forward_done(self, counters: Counters) -> None:
        self.last_forward = counters
        self.total += counters
        if self.scope is not None and self.scope.after_prefill is None:
            self.scope.prefill_done()  # the first forward of a generate() call is its prefill

    def __repr__(self) -> str:
        t = self.total
        return (f"Stats(forwards={t.forwards}, demand={t.demand}, hits={t.hits}, misses={t.misses}, "
                f"bytes_copied={t.bytes_copied}, copy_busy_seconds={t.copy_busy_seconds:.4f}, "
                f"pageable_copies={t.pageable_copies}, cycles={t.cycles}, "
                f"new_tokens={t.new_tokens})")


@dataclass(frozen=True)
class CycleRecord:
    """One decoding cycle: draft nodes verified, expert demand and misses of its verify forward, timed seconds."""

    n_nodes: int
    demand: int
    seconds: float
    pool: int
    committed: int
    misses: int
    draft_seconds: float  # the part of `seconds` spent drafting and selecting (phases 1-2)
    measurement_seconds: float = 0.0  # the part of `seconds` spent on measurement only (the route oracle)


class GenerateScope:
    """Accounts one ``generate()`` call: prefill counters and wall clock, then the decode phase (cycles, tokens, wall
    clock until ``end``)."""

    def __init__(self, stats: Stats, started: float | None = None):
        self.stats = stats
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
              misses: int, draft_seconds: float, expected: float = 0.0) -> None:
        """One decoding cycle; ``seconds`` is its wall clock, ``measurement`` the part of it spent measuring,
        ``expected`` the tokens the assistant expected it to commit."""
        if self.stats.trace is not None:
            self.stats.trace.append(CycleRecord(verified, demand, seconds, pool, committed, misses, draft_seconds,
                                                measurement))
        t = self.stats.total
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
        self.stats.last_prefill = self.after_prefill - self.start
        self.stats.last_prefill.prefill_seconds = self.prefill_seconds
        self.stats.last_generate = t - self.after_prefill
        self.stats.last_generate.new_tokens = new_tokens
        # the call's own prefill time rides along, so last_generate alone gives end-to-end tok/s
        self.stats.last_generate.prefill_seconds = self.prefill_seconds
        self.stats.scope = None
