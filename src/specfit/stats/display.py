"""The figures a reader sees of counters: the one-line repr, the notebook's HTML tables, their labels and meanings.

Counters are read duck-typed (attributes by name), so this module imports nothing of ``specfit.stats``: the
counters call it, never the other way round.
"""

from __future__ import annotations

import html

__all__ = ["FIGURES", "figures_of", "counters_line", "counters_html", "spans_line", "spans_html"]

# What a reader sees of a Counters: (label, attribute or None, format, meaning, shown when). Shared by repr, the
# notebook table and the docs; `expected_tokens` is read with getattr so that Counters without it still display.
FIGURES = (
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
    ("cost refresh cycles", "cost_refresh_cycles", "{:d}",
     "forecast cycles whose wall clock refreshed the cost model online (stats.cost_profile: the profile it started "
     "from)", "refreshed"),
    ("EAGLE-3-way cycles", "guard_eagle_cycles", "{:d}",
     "cycles SpecFit's dominance guard ran EAGLE-3's way (its drafting and tree), because the clock said it paid more",
     "guarded"),
    ("ms/cycle", None, "{:.2f}", "wall clock per cycle of the decode phase", "cycles"),
    ("copies/token", "copies_per_token", "{:.2f}",
     "host-to-device expert copies per new token (slot-cache misses + prefetches)", "tokens"),
    ("copies", "copies", "{:d}", "host-to-device expert copies (slot-cache misses + prefetches)", "forwards"),
    ("hits/token", "hits_per_token", "{:.2f}", "experts already in a slot per new token", "hosted"),
    ("host experts/token", "host_experts_per_token", "{:.2f}",
     "experts computed on the host lane per new token (not in a slot, not copied)", "hosted"),
    ("host wait", "host_wait_share", "{:.1%}",
     "share of decode s the host waited for the host lane (an emulated lane: the part of its time nothing hid)",
     "host wait"),
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
          "hit rate": "hit_rate", "copy wait": "copy_wait", "host experts/token": "host/token",
          "host wait": "host_wait", "tok/s excl. oracle": "tok/s_excl_oracle",
          "pageable copies": "pageable_copies", "copies": "copies", "forwards": "forwards"}


def _expected_per_cycle(c) -> float:
    return getattr(c, "expected_tokens", 0) / c.cycles if c.cycles else 0.0


def figures_of(c, force: bool = False) -> list[tuple[str, str, str, str]]:
    """(label, value, meaning, attribute) of the figures that apply to ``c``; ``force``: all of them."""
    shown = {"always": True, "tokens": c.new_tokens > 0, "cycles": c.cycles > 0, "forwards": c.forwards > 0,
             "demand": c.demand > 0, "measured": c.measurement_seconds > 0, "prefetch": c.prefetch_copies > 0,
             "pageable": c.pageable_copies > 0, "expected": bool(getattr(c, "expected_tokens", 0)) and c.cycles > 0,
             "waited": c.lock_wait_seconds > 0, "predicted": getattr(c, "forecast_cycles", 0) > 0,
             "forecast": c.forecast_over_real is not None, "refreshed": getattr(c, "cost_refresh_cycles", 0) > 0,
             "guarded": getattr(c, "guard_eagle_cycles", 0) > 0, "copied": c.bytes_copied > 0 and c.new_tokens > 0,
             "copy wait": c.copy_wait_seconds > 0 and c.decode_seconds > 0,
             "hosted": getattr(c, "host_experts", 0) > 0 and c.new_tokens > 0,
             "host wait": getattr(c, "host_wait_seconds", 0) > 0 and c.decode_seconds > 0}
    out = []
    for label, attribute, fmt, meaning, when in FIGURES:
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


def counters_line(c) -> str:
    """One line: the main figures of ``c``, rounded."""
    shown = {label: value for label, value, _, _ in figures_of(c)}
    if c.new_tokens:
        wanted = [label for label in _SHORT if label not in ("copies", "forwards")]
    else:  # a forward, or a span without tokens: what the experts did
        wanted = ["forwards", "copies", "hit rate", "pageable copies"]
    return ", ".join(f"{_SHORT[label]}={shown[label]}" for label in wanted if label in shown)


def counters_html(c) -> str:
    """One span's figures as an HTML table: figure, value, and its meaning and attribute as the row's tooltip."""
    rows = [(label, [value], f"{meaning} [{attribute}]") for label, value, meaning, attribute in figures_of(c)]
    return _html_table(["figure", "value"], rows)


def spans_line(last, total, which: str, called: bool) -> str:
    """``Stats``' repr: the last call (``which`` says which path it ran; ``called``: whether there was one) and the
    running total, on two labelled lines."""
    last = counters_line(last) if called else "no generate() call yet"
    return (f"Stats(last_generate ({which}): {last}\n"
            f"      total (every call since reset()): {counters_line(total)})")


def spans_html(last_generate, total, which: str) -> str:
    """``Stats`` in a notebook: one row per figure that applies to either span, a column for each."""
    last, spans_total = figures_of(last_generate), figures_of(total)
    labels = [label for label, *_ in FIGURES if any(f[0] == label for f in last + spans_total)]
    by_label = {f[0]: f for f in figures_of(last_generate, force=True)}
    by_label_total = {f[0]: f for f in figures_of(total, force=True)}
    shown_last = {f[0] for f in last}
    rows = [(label, [by_label[label][1] if label in shown_last else "", by_label_total[label][1]],
             f"{by_label[label][2]} [{by_label[label][3]}]") for label in labels]
    return _html_table(["", f"last_generate ({which})", "total (since reset())"], rows,
                       caption="model.specfit.stats (hover a row for its meaning and attribute)")


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
