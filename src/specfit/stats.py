"""Counters: one dataclass for everything SpecFit counts, read as ``model.specfit.stats``.

``Counters`` holds raw, additive counts; rates are derived properties, computed when read. ``Stats`` keeps several
``Counters``, and their names say which span each covers:

- ``stats.last_generate``: **the last** ``generate()`` **call** only (its decode phase, with the call's prefill
  seconds riding along), replaced by every call. This is what to read after a call.
- ``stats.total``: **the running sum** of every forward and call since ``stats.reset()`` (or since ``enable``).
- ``stats.last_prefill`` (the last call's prompt forward) and ``stats.last_forward`` (the last target forward).
  The prompt's forward is in ``last_prefill`` only, never in ``last_generate``: the two add up to the call's share of
  ``total``, and under SpecFit's loop or plain decoding ``last_generate.forwards`` equals its ``cycles``.
- ``stats.last_method``: the decoding path the last call ran: ``"ar"`` (transformers' own greedy or sampling
  decoding, no assistant); ``"specfit"``, ``"eagle3"`` or another registered assistant's name (SpecFit's loop);
  ``"assisted"`` (``assistant_model=``, ...) or ``"prompt_lookup"`` (``prompt_lookup_num_tokens=``): transformers'
  linear speculative decoding, other transformers modes by their ``GenerationMode`` value (``"beam_search"``, ...),
  where SpecFit sees only the target's forwards (expert counters, ``new_tokens`` and the times are the call's;
  ``cycles`` and ``tokens_committed`` stay 0); ``None``: no call yet, or the last one failed or was refused (its
  figures are then all zero). Every ``generate()`` on an enabled model clears the previous call's figures first.

In a notebook ``stats`` shows as a table of both (``_repr_html_``), and ``repr`` gives the same figures rounded on two
labelled lines. ``stats.start_trace()`` records one ``CycleRecord`` per decoding cycle from then on, exportable as
rows of dicts, a pandas DataFrame, or a plot (see ``Trace``).

Times are wall clock: ``prefill_seconds`` runs from the entry of ``generate()`` to the end of the prompt's forward,
``decode_seconds`` from there to the end of decoding, so together they are what a stopwatch around the call reads.
Measurement-only work done inside the call (the route oracle's extra forwards, the acceptance oracle's look-ahead)
is *included* in them and also shown on its own, as ``measurement_seconds``.

Copies are counted where they were issued: a forward's demand copies (bytes and copy-path time) in that forward's
counters, read when it ends; prefetch copies (issued between forwards) in ``total``, bytes when issued and time when
they have landed, at the latest when the ``generate()`` call ends. So ``bytes_copied / copy_busy_seconds`` is the
bandwidth of the same copies in every scope.
"""

from __future__ import annotations

import html
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable


@dataclass
class Counters:
    """Raw, additive counts of one span (a forward, a call, or everything since ``reset()``); rates are properties.

    Offloaded experts, counted on every target forward:

    - ``forwards``: target forwards. ``demand``: summed over forwards and MoE layers, the distinct experts a forward
      needs. ``hits``: of those, already in a slot. ``misses``: not in a slot, so copied host-to-device (``streamed``:
      the misses copied through scratch because every slot was taken by the same forward).
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
      matches the clock.
    - ``prefill_seconds``: wall clock from ``generate()``'s entry to the end of the prompt's forward.
      ``decode_seconds``: wall clock of everything after it; the two add up to a stopwatch around the call.
      ``measurement_seconds``: the part of ``decode_seconds`` spent on measurement only (the route or acceptance
      oracle).
      ``lock_wait_seconds``: the part of ``prefill_seconds`` spent waiting while another thread's call held this
      model (calls on one model run one at a time).

    Derived (properties): ``tokens_per_second`` (decode, wall clock), ``end_to_end_tokens_per_second`` (prefill
    included), ``nodes_per_cycle``, ``tokens_per_cycle``, ``seconds_per_cycle``, ``copies`` (misses + prefetches),
    ``copies_per_token``, ``hit_rate``, ``copy_bandwidth``, ``tokens_per_second_excluding_measurement``,
    ``expected_over_committed``, ``forecast_over_real`` (None unless every cycle was forecast), and what the copies
    cost as the offload literature reports it: ``mib_copied_per_token``, ``copy_wait_share`` (the share of decode
    time blocked by copies: see ``copy_wait_seconds`` for what a host clock sees on each device) and ``hit_rate``.
    ``as_dict()`` gives every field and derived figure; ``repr`` the main figures, rounded.
    """

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
    predicted_seconds: float = 0.0  # the cost model's predicted seconds of each forecast cycle, summed
    forecast_cycles: int = 0  # cycles that came with a predicted time (SpecFit's; AR and EAGLE-3: none)
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
        for name in ("copies", "hit_rate", "copy_bandwidth", "copies_per_token", "nodes_per_cycle", "tokens_per_cycle",
                     "seconds_per_cycle", "tokens_per_second", "end_to_end_tokens_per_second",
                     "tokens_per_second_excluding_measurement", "expected_over_committed", "forecast_over_real",
                     "mib_copied_per_token", "copy_wait_share"):
            out[name] = getattr(self, name)
        return out

    def figures(self) -> list[tuple[str, str, str]]:
        """The figures a reader looks at, as (label, rounded value, meaning); figures that do not apply (no cycles,
        no oracle, no prefetch) are left out."""
        return [(label, value, meaning) for label, value, meaning, _ in _figures(self)]

    def __repr__(self) -> str:
        return f"Counters({_short(self)})"

    def _repr_html_(self) -> str:
        rows = [(label, [value], f"{meaning} [{attribute}]") for label, value, meaning, attribute in _figures(self)]
        return _html_table(["figure", "value"], rows)


# What a reader sees of a Counters: (label, attribute or None, format, meaning, shown when). Shared by repr, the
# notebook table and the docs; `expected_tokens` is read with getattr so that Counters without it still display.
_FIGURES = (
    ("new tokens", "new_tokens", "{:d}", "tokens generate() returned", "always"),
    ("tok/s", "tokens_per_second", "{:.1f}", "new tokens per second of decoding, wall clock (prefill excluded)",
     "tokens"),
    ("tok/s end to end", "end_to_end_tokens_per_second", "{:.1f}",
     "new tokens per second over the whole call, prefill included", "tokens"),
    ("prefill s", "prefill_seconds", "{:.3f}", "wall clock from generate()'s entry to the end of the prompt's forward",
     "tokens"),
    ("decode s", "decode_seconds", "{:.3f}", "wall clock of the rest of the call", "tokens"),
    ("predicted s", "predicted_seconds", "{:.3f}",
     "seconds the cost model predicted for the cycles it forecast (verified subtree and drafting), summed",
     "predicted"),
    ("cycles", "cycles", "{:d}", "decoding cycles, one target forward each (plain decoding: one per token)", "cycles"),
    ("nodes/cycle", "nodes_per_cycle", "{:.2f}", "draft nodes verified per cycle (the root not counted)", "cycles"),
    ("tokens/cycle", "tokens_per_cycle", "{:.2f}", "tokens committed per cycle: accepted draft tokens + 1 bonus",
     "cycles"),
    ("expected tokens/cycle", None, "{:.2f}", "tokens per cycle the selector expected from the subtrees it chose",
     "expected"),
    ("forecast/real", "forecast_over_real", "{:.2f}",
     "predicted s over decode s: 1.00 when the cost model's time forecast matches the clock", "forecast"),
    ("ms/cycle", None, "{:.2f}", "wall clock per cycle of the decode phase", "cycles"),
    ("copies/token", "copies_per_token", "{:.2f}",
     "host-to-device expert copies per new token (slot-cache misses + prefetches)", "tokens"),
    ("copies", "copies", "{:d}", "host-to-device expert copies (slot-cache misses + prefetches)", "forwards"),
    ("hit rate", "hit_rate", "{:.1%}", "share of the experts forwards needed that were already in a slot", "demand"),
    ("MiB/token", "mib_copied_per_token", "{:.2f}", "MiB copied host-to-device per new token (misses + prefetches)",
     "copied"),
    ("copy wait", "copy_wait_share", "{:.1%}",
     "share of decode s the host was blocked by copies (CPU: all the stall; CUDA: issue time only, the device-side "
     "wait is in decode s)", "copy wait"),
    ("forwards", "forwards", "{:d}", "target forwards", "always"),
    ("oracle s", "measurement_seconds", "{:.3f}",
     "measurement-only time (the route or acceptance oracle), inside decode s",
     "measured"),
    ("tok/s excl. oracle", "tokens_per_second_excluding_measurement", "{:.1f}",
     "the paper's figure: decode tok/s with the oracle's time taken out", "measured"),
    ("waited s", "lock_wait_seconds", "{:.3f}",
     "time the call waited for another thread's call on this model (inside prefill s)", "waited"),
    ("prefetch copies", "prefetch_copies", "{:d}", "copies started ahead of a forward (included in copies)",
     "prefetch"),
    ("prefetch wasted", "prefetch_wasted", "{:d}", "prefetched experts the next forward did not use", "prefetch"),
    ("pageable copies", "pageable_copies", "{:d}", "CUDA copies from memory that is not pinned (synchronous)",
     "pageable"),
)
# the figures of the one-line repr, with their labels there
_SHORT = {"new tokens": "new_tokens", "tok/s": "tok/s", "tok/s end to end": "end_to_end_tok/s", "cycles": "cycles",
          "nodes/cycle": "nodes/cycle", "tokens/cycle": "tokens/cycle", "expected tokens/cycle": "expected_tokens/cycle",
          "forecast/real": "forecast/real", "copies/token": "copies/token", "MiB/token": "MiB/token",
          "hit rate": "hit_rate", "copy wait": "copy_wait", "tok/s excl. oracle": "tok/s_excl_oracle",
          "pageable copies": "pageable_copies", "copies": "copies", "forwards": "forwards"}


def _expected_per_cycle(c: Counters) -> float:
    return getattr(c, "expected_tokens", 0) / c.cycles if c.cycles else 0.0


def _figures(c: Counters, force: bool = False) -> list[tuple[str, str, str, str]]:
    """(label, value, meaning, attribute) of the figures that apply to ``c``; ``force``: all of them."""
    shown = {"always": True, "tokens": c.new_tokens > 0, "cycles": c.cycles > 0, "forwards": c.forwards > 0,
             "demand": c.demand > 0, "measured": c.measurement_seconds > 0, "prefetch": c.prefetch_copies > 0,
             "pageable": c.pageable_copies > 0, "expected": bool(getattr(c, "expected_tokens", 0)) and c.cycles > 0,
             "waited": c.lock_wait_seconds > 0, "predicted": getattr(c, "forecast_cycles", 0) > 0,
             "forecast": c.forecast_over_real is not None, "copied": c.bytes_copied > 0 and c.new_tokens > 0,
             "copy wait": c.copy_wait_seconds > 0 and c.decode_seconds > 0}
    out = []
    for label, attribute, fmt, meaning, when in _FIGURES:
        if not (force or shown[when]):
            continue
        if label == "expected tokens/cycle":
            value, attribute = _expected_per_cycle(c), "expected_tokens / cycles"
        elif label == "ms/cycle":
            value, attribute = c.seconds_per_cycle * 1e3, "seconds_per_cycle * 1000"
        else:
            value = getattr(c, attribute)
        out.append((label, "-" if value is None else fmt.format(value), meaning, attribute))
    return out


def _short(c: Counters) -> str:
    """One line: the main figures of ``c``, rounded."""
    shown = {label: value for label, value, _, _ in _figures(c)}
    if c.new_tokens:
        wanted = [label for label in _SHORT if label not in ("copies", "forwards")]
    else:  # a forward, or a span without tokens: what the experts did
        wanted = ["forwards", "copies", "hit rate", "pageable copies"]
    return ", ".join(f"{_SHORT[label]}={shown[label]}" for label in wanted if label in shown)


def _html_table(header: list[str], rows: list[tuple[str, list[str], str]], caption: str = "") -> str:
    """A small HTML table: one row per figure, its meaning (and attribute) as the row's tooltip."""
    esc = html.escape
    out = ['<table class="specfit-stats">']
    if caption:
        out.append(f"<caption style='text-align:left'>{esc(caption)}</caption>")
    out.append("<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead><tbody>")
    for label, values, meaning in rows:
        cells = "".join(f"<td style='text-align:right'>{esc(v)}</td>" for v in values)
        out.append(f"<tr title='{esc(meaning, quote=True)}'><th style='text-align:left'>{esc(label)}</th>{cells}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


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
        last = _short(self.last_generate) if self.last_generate != Counters() else "no generate() call yet"
        return (f"Stats(last_generate ({self._last_label()}): {last}\n"
                f"      total (every call since reset()): {_short(self.total)})")

    def _repr_html_(self) -> str:
        last, total = _figures(self.last_generate), _figures(self.total)
        labels = [label for label, *_ in _FIGURES if any(f[0] == label for f in last + total)]
        by_label = {f[0]: f for f in _figures(self.last_generate, force=True)}
        by_label_total = {f[0]: f for f in _figures(self.total, force=True)}
        shown_last = {f[0] for f in last}
        rows = [(label, [by_label[label][1] if label in shown_last else "", by_label_total[label][1]],
                 f"{by_label[label][2]} [{by_label[label][3]}]") for label in labels]
        return _html_table(["", f"last_generate ({self._last_label()})", "total (since reset())"], rows,
                           caption="model.specfit.stats (hover a row for its meaning and attribute)")


@dataclass(frozen=True)
class CycleRecord:
    """One decoding cycle of an assistant, as ``stats.trace`` records it.

    - ``n_nodes``: draft nodes verified (the root not counted). ``pool``: draft nodes drafted (0: drafting skipped).
    - ``committed``: tokens the cycle committed (accepted draft tokens + the bonus token).
    - ``demand``: distinct experts its verify forward needed, summed over layers; ``misses``: of those, copied to a
      slot (the cycle's expert copies; prefetches are not in it).
    - ``seconds``: the cycle's wall clock; ``draft_seconds`` the part spent drafting and selecting (phases 1-2);
      ``measurement_seconds`` the part spent on measurement only (the route or acceptance oracle).
    - ``predicted_seconds``: what the cost model predicted the cycle would take, drafting included, beside
      ``seconds`` (None: the assistant forecasts no time, as AR and EAGLE-3).
    """

    n_nodes: int
    demand: int
    seconds: float
    pool: int
    committed: int
    misses: int
    draft_seconds: float  # the part of `seconds` spent drafting and selecting (phases 1-2)
    measurement_seconds: float = 0.0  # the part of `seconds` spent measuring only (the route/acceptance oracle)
    predicted_seconds: float | None = None  # the cost model's forecast of `seconds` (None: not forecast)


class Trace(list):
    """The per-cycle trace: a list of ``CycleRecord``, one per decoding cycle since ``stats.start_trace()``.

    ``rows()`` gives plain dicts (``cycle`` plus every ``CycleRecord`` field), ``to_pandas()`` the same as a
    DataFrame, ``plot()`` tokens, nodes and expert copies per cycle (matplotlib). The functions ``trace_rows``,
    ``trace_to_pandas`` and ``plot_trace`` do the same for any list of records.
    """

    def rows(self) -> list[dict]:
        return trace_rows(self)

    def to_pandas(self):
        return trace_to_pandas(self)

    def plot(self, title: str | None = None):
        return plot_trace(self, title)


def trace_rows(trace) -> list[dict]:
    """One dict per cycle: ``cycle`` (0, 1, ...) and the ``CycleRecord`` fields."""
    return [{"cycle": i, **asdict(record)} for i, record in enumerate(_records(trace))]


def trace_to_pandas(trace):
    """The trace as a pandas DataFrame, one row per cycle, indexed by ``cycle``."""
    try:
        import pandas as pd
    except ImportError as err:
        raise ImportError("trace_to_pandas() needs pandas (pip install pandas); trace_rows() gives the same rows as "
                          "plain dicts") from err
    columns = ["cycle"] + [f.name for f in fields(CycleRecord)]
    return pd.DataFrame(trace_rows(trace), columns=columns).set_index("cycle")


def plot_trace(trace, title: str | None = None):
    """Tokens committed and nodes verified per cycle (top), expert copies per cycle (bottom); returns the axes."""
    plt = _pyplot("plot()")
    rows = trace_rows(trace)
    x = [r["cycle"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 4))
    top.step(x, [r["committed"] for r in rows], where="mid", label="tokens committed")
    top.step(x, [r["n_nodes"] for r in rows], where="mid", label="draft nodes verified")
    top.set_ylabel("per cycle")
    top.legend(fontsize=8)
    bottom.bar(x, [r["misses"] for r in rows], color="tab:red", label="expert copies (slot-cache misses)")
    bottom.set_ylabel("copies")
    bottom.set_xlabel("decoding cycle")
    bottom.legend(fontsize=8)
    top.set_title(title or f"{len(rows)} decoding cycles", fontsize=9)
    fig.tight_layout()
    return top, bottom


def _records(trace) -> list:
    if trace is None:
        raise ValueError("no trace recorded: call model.specfit.stats.start_trace() before generate()")
    return list(trace)


def _pyplot(what: str):
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(f'{what} needs matplotlib, an optional dependency: pip install "specfit[plot]"') from err
    return plt


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
              misses: int, draft_seconds: float, expected: float = 0.0, predicted: float | None = None) -> None:
        """One decoding cycle; ``seconds`` is its wall clock, ``measurement`` the part of it spent measuring,
        ``expected`` the tokens the assistant expected it to commit, ``predicted`` the seconds its cost model
        predicted for it, drafting included (None: the cycle was not forecast, and adds nothing)."""
        if predicted is not None and not _seconds(predicted):
            raise ValueError(f"predicted= is the cost model's forecast of the cycle in seconds, a finite number >= 0 "
                             f"(None: not forecast), got {predicted!r}")
        if self.stats.trace is not None:
            self.stats.trace.append(CycleRecord(verified, demand, seconds, pool, committed, misses, draft_seconds,
                                                measurement, None if predicted is None else float(predicted)))
        t = self.stats.total
        if predicted is not None:
            t.predicted_seconds += float(predicted)
            t.forecast_cycles += 1
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
