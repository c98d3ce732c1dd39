"""``Counters``: the raw, additive counts of one span, and the rates derived from them when read."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .display import counters_html, counters_line, figures_of

__all__ = ["Counters"]


@dataclass
class Counters:
    """Raw, additive counts of one span (a forward, a call, or everything since ``reset()``); rates are properties.

    Offloaded experts, counted on every target forward:

    - ``forwards``: target forwards. ``demand``: summed over forwards and MoE layers, the distinct experts a forward
      needs. ``hits``: of those, already in a slot. ``misses``: not in a slot and copied host-to-device
      (``streamed``: the misses copied through scratch because every slot was taken by the same forward).
      ``host_experts``: not in a slot and computed on the host lane instead (``cold="host"`` or ``"auto"``); so
      ``demand = hits + misses + host_experts``.
    - ``host_busy_seconds``: the host lane's time on its experts (an emulated lane: its set time per expert; CUDA:
      the worker's compute time); ``host_wait_seconds``: the Python thread's time blocked joining the lane (the
      part of the lane's time nothing else hid; on a CPU with an emulated lane all of that stall).
    - ``bytes_copied``, ``copy_busy_seconds``: bytes of every expert copy counted here and the copy path's time for
      them (CUDA: copy-stream event time; CPU: memcpy time, or the emulated link's time), so their ratio is the
      bandwidth. ``copy_wait_seconds``: host wall time blocked by copies. What that is differs by device: on a CPU
      (compute runs on the host) it is all the time decoding stood still for copies, the memcpy plus, with an
      emulated link, the sleep until each copy's landing time; on CUDA it is only the host's time *issuing* the
      copies (microseconds from pinned memory; about the copy itself from pageable memory, see
      ``pageable_copies``): there compute waits for copies on the device, which no host clock sees, and that wait
      shows only in ``decode_seconds``. ``copy_wait_share`` (below) inherits this.
    - ``pageable_copies``: CUDA copies from memory that is not pinned (synchronous: a warning sign).
    - ``prefetch_copies``, ``prefetch_bytes``, ``prefetch_wasted``: copies started ahead of a forward (SpecFit's
      ``prefetch=True``), their bytes (also in ``bytes_copied``), and those the next forward did not use.

    Decoding, counted per ``generate()`` call:

    - ``cycles``: decoding cycles, one verify forward each (plain decoding: one per token).
    - ``nodes_drafted``: draft pool size summed over cycles. ``nodes_verified``: draft nodes in the verified subtrees
      (the root not counted). ``tokens_committed``: accepted draft tokens plus the bonus token, summed over cycles.
    - ``new_tokens``: tokens ``generate()`` returned (plain decoding too).
    - ``expected_tokens``: the tokens the assistant expected its cycles to commit, summed (SpecFit: its selector's
      winner, in path values; EAGLE-3: ``1 + sum of path probabilities`` of its verified nodes; plain decoding: 1 per
      step), beside ``tokens_committed``: ``expected_over_committed`` is 1.0 when the estimates are right on average.
    - ``predicted_seconds``: the seconds the cost model predicted for the cycles it ran (the subtree each verified,
      drafting included), summed, beside ``decode_seconds``; ``forecast_cycles``: the cycles that came with such a
      prediction (SpecFit's; AR and EAGLE-3 predict none). ``forecast_over_real`` is 1.0 when the time forecast
      matches the clock. ``cost_refresh_cycles``: the forecast cycles whose wall clock refreshed the cost model
      online (``stats.cost_profile`` names the profile it started from). ``guard_eagle_cycles``: the cycles
      SpecFit's dominance guard ran EAGLE-3's way (its drafting and tree) because the clock said it paid more;
      ``plain_cycles`` those it ran plain (drafting skipped, the root alone verified: a plain decoding step), so
      ``specfit_cycles`` those it ran SpecFit's own way (the three add up to SpecFit's cycles; ``ways`` gives
      them by name). ``plain_row_cycles``: in a
      batch, rows that verified their root alone in a cycle the other rows drafted (the row's own backoff: the
      batch rule had not been taking its trees), summed over cycles.
    - ``batch_row_cycles``: with a batch (several rows, docs/batch.md), the rows verified summed over cycles (rows in
      flight per cycle: ``batch_row_cycles / cycles``; a finished row is not verified again); 0 at batch 1.
    - ``prefill_seconds``: wall clock from ``generate()``'s entry to the end of the prompt's forward.
      ``decode_seconds``: wall clock of everything after it; the two add up to a stopwatch around the call.
      ``measurement_seconds``: the part of ``decode_seconds`` spent on measurement only (the route or acceptance
      oracle).
      ``lock_wait_seconds``: the part of ``prefill_seconds`` spent waiting while another thread's call held this
      model (calls on one model run one at a time).

    Derived (properties): ``tokens_per_second`` (decode, wall clock), ``end_to_end_tokens_per_second`` (prefill
    included), ``nodes_per_cycle``, ``tokens_per_cycle``, ``seconds_per_cycle``, ``copies`` (misses + prefetches),
    ``copies_per_token``, ``hits_per_token``, ``host_experts_per_token`` and ``host_wait_share`` (the host lane),
    ``hit_rate``, ``copy_bandwidth``, ``tokens_per_second_excluding_measurement``, ``expected_over_committed``,
    ``forecast_over_real`` (None unless every cycle was forecast), and what the copies cost as the offload
    literature reports it: ``mib_copied_per_token``, ``copy_wait_share`` (the share of decode
    time blocked by copies: see ``copy_wait_seconds`` for what a host clock sees on each device) and ``hit_rate``.
    ``as_dict()`` gives every field and derived figure; ``repr`` the main figures, rounded.
    """

    # offloaded experts (every target forward)
    forwards: int = 0
    demand: int = 0  # sum over layers of the distinct experts a forward needs
    hits: int = 0
    misses: int = 0  # = host-to-device copies (loads + streamed)
    streamed: int = 0  # misses copied through scratch because every slot was in use by the same forward
    host_experts: int = 0  # not in a slot and computed on the host lane (no slot taken, nothing copied)
    host_busy_seconds: float = 0.0  # the host lane's time on them
    host_wait_seconds: float = 0.0  # the Python thread's time blocked joining the host lane
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
    predicted_seconds: float = 0.0  # the cost model's predicted seconds of each forecast cycle, summed
    forecast_cycles: int = 0  # cycles that came with a predicted time (SpecFit's; AR and EAGLE-3: none)
    cost_refresh_cycles: int = 0  # forecast cycles whose wall clock the cost model learned from online
    guard_eagle_cycles: int = 0  # cycles SpecFit's dominance guard ran EAGLE-3's way
    specfit_cycles: int = 0  # SpecFit cycles run SpecFit's own way (its routes, selector and stop rule)
    plain_cycles: int = 0  # SpecFit cycles run plain: drafting skipped, every row's root alone verified
    plain_row_cycles: int = 0  # batch rows that verified their root alone in a cycle the others drafted
    # a batch (assistant decoding of several rows): rows verified, summed over cycles (rows in flight per cycle =
    # batch_row_cycles / cycles); finished rows are not verified again. Batch 1 counts 0 here.
    batch_row_cycles: int = 0
    new_tokens: int = 0  # tokens returned by generate (AR too)
    prefill_seconds: float = 0.0  # wall clock from generate()'s entry to the end of the prompt's forward
    decode_seconds: float = 0.0  # wall clock of everything generate() did after the prefill (oracle included)
    measurement_seconds: float = 0.0  # the part of decode_seconds spent measuring only (the route/acceptance oracle)
    lock_wait_seconds: float = 0.0  # the part of prefill_seconds spent waiting for another thread's call

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
    def hits_per_token(self) -> float:
        """Experts found in a slot per new token."""
        return self.hits / self.new_tokens if self.new_tokens else 0.0

    @property
    def host_experts_per_token(self) -> float:
        """Experts computed on the host lane per new token."""
        return self.host_experts / self.new_tokens if self.new_tokens else 0.0

    @property
    def host_wait_share(self) -> float:
        """``host_wait_seconds / decode_seconds``: the share of decoding the Python thread waited for the host
        lane (read it from ``last_generate``, as ``copy_wait_share``)."""
        return self.host_wait_seconds / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def ways(self) -> dict[str, int]:
        """SpecFit's cycles by the way they ran: ``{"specfit": ..., "eagle3": ..., "plain": ...}`` (zeros for
        plain decoding and EAGLE-3, which have no ways)."""
        return {"specfit": self.specfit_cycles, "eagle3": self.guard_eagle_cycles, "plain": self.plain_cycles}

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
    def forecast_over_real(self) -> float | None:
        """Predicted seconds (the cost model's, summed over cycles) over ``decode_seconds``: 1.0 when the time
        forecast matches the clock, below 1 when the model thinks cycles cheaper than they are. None when not every
        cycle of the span was forecast (AR, EAGLE-3, or a span mixing them with SpecFit calls): a ratio over part of
        the cycles against all of the clock would mean nothing."""
        if not self.forecast_cycles or self.forecast_cycles != self.cycles or not self.decode_seconds:
            return None
        return self.predicted_seconds / self.decode_seconds

    @property
    def mib_copied_per_token(self) -> float:
        """MiB copied host-to-device per new token (every expert copy: misses and prefetches)."""
        return self.bytes_copied / 2**20 / self.new_tokens if self.new_tokens else 0.0

    @property
    def copy_wait_share(self) -> float:
        """``copy_wait_seconds / decode_seconds``: the share of decoding the host spent blocked by copies. A CPU
        (emulated link or not): all of the stall. CUDA: only the host's issue time, so near 0 from pinned memory;
        the device-side stall is in the decode time, not here. Read it from ``last_generate`` (a decode phase):
        in ``total`` the prefills' waits are in the numerator too."""
        return self.copy_wait_seconds / self.decode_seconds if self.decode_seconds else 0.0

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
        """The paper's figure: decode tok/s with the oracles' measurement time taken out. Not what a user
        waits for when the oracle runs; equal to ``tokens_per_second`` when it does not."""
        seconds = self.decode_seconds - self.measurement_seconds
        return self.new_tokens / seconds if seconds > 0 else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in ("copies", "hit_rate", "copy_bandwidth", "copies_per_token", "hits_per_token",
                     "host_experts_per_token", "host_wait_share", "nodes_per_cycle", "tokens_per_cycle",
                     "seconds_per_cycle", "tokens_per_second", "end_to_end_tokens_per_second",
                     "tokens_per_second_excluding_measurement", "expected_over_committed", "forecast_over_real",
                     "mib_copied_per_token", "copy_wait_share", "ways"):
            out[name] = getattr(self, name)
        return out

    def figures(self) -> list[tuple[str, str, str]]:
        """The figures a reader looks at, as (label, rounded value, meaning); figures that do not apply (no cycles,
        no oracle, no prefetch) are left out."""
        return [(label, value, meaning) for label, value, meaning, _ in figures_of(self)]

    def __repr__(self) -> str:
        return f"Counters({counters_line(self)})"

    def _repr_html_(self) -> str:
        return counters_html(self)
