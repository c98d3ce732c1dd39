"""How a comparison is shown: ``compare``'s rows as a text table with its legend, and as two bar charts with a title
and the spread over prompts. No torch here."""

from __future__ import annotations


def ratio_to(rows: list[dict], row: dict, method: str) -> str:
    """``row``'s tok/s over ``method``'s, as the tables print it ("x1.04"), or "-" when that method is not here.

    >>> rows = [dict(method="ar", tok_s=10.0), dict(method="eagle3", tok_s=12.5)]
    >>> ratio_to(rows, rows[0], "eagle3"), ratio_to(rows, rows[0], "specfit")
    ('x0.80', '-')
    """
    tok = {r["method"]: r["tok_s"] for r in rows}
    return f"x{row['tok_s'] / tok[method]:.2f}" if tok.get(method) else "-"


def format_rows(rows: list[dict], title: str = "") -> str:
    """Rows of ``compare`` as a text table: every column of the demo's narrow table (tok/s, against the first method
    and against EAGLE-3, tokens per cycle, copies per token) and the rest of ``COLUMNS``."""
    base = (rows[0]["label"] if len(rows[0]["label"]) <= 10 else rows[0]["method"]) if rows else ""
    eagle = any(r["method"] == "eagle3" for r in rows)
    hosted = any(r.get("host_per_token") for r in rows)  # the host lane's columns, where one computed experts
    head = (f"{'method':<22}{'tok/s':>8}{'vs ' + base:>14}" + (f"{'vs EAGLE-3':>12}" if eagle else "") +
            f"{'nodes/cyc':>11}{'tok/cyc':>9}{'exp/real':>10}"
            f"{'fcst/real':>11}{'copies/tok':>12}{'MiB/tok':>9}{'copy wait':>11}{'hit rate':>10}")
    head += f"{'hits/tok':>10}{'host/tok':>10}{'host wait':>11}" if hosted else ""
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for r in rows:
        forecast = "-" if r["forecast_over_real"] is None else f"{r['forecast_over_real']:.2f}"
        line = (f"{r['label']:<22}{r['tok_s']:>8.1f}{'x%.2f' % r['speedup']:>14}"
                + (f"{ratio_to(rows, r, 'eagle3'):>12}" if eagle else "") +
                f"{r['nodes_per_cycle']:>11.2f}"
                f"{r['tokens_per_cycle']:>9.2f}{r['expected_over_committed']:>10.2f}{forecast:>11}"
                f"{r['copies_per_token']:>12.2f}{r['mib_per_token']:>9.2f}{r['copy_wait_share']:>11.1%}"
                f"{r['hit_rate']:>10.0%}")
        if hosted:
            line += f"{r['hits_per_token']:>10.2f}{r['host_per_token']:>10.2f}{r['host_wait_share']:>11.1%}"
        lines.append(line)
    return "\n".join(lines)


LEGEND = ("tok/s: new tokens per second, wall clock of the whole generate() calls (what a stopwatch reads); vs AR, "
          "vs EAGLE-3: that tok/s over theirs",
          "nodes/cyc: draft nodes verified per decoding cycle (EAGLE-3 verifies its 7)",
          "tok/cyc: tokens committed per cycle (accepted draft tokens + 1 bonus token; AR: 1)",
          "exp/real: tokens the method expected its cycles to commit over those committed (1.00: right on average)",
          "fcst/real: seconds SpecFit's cost model predicted for its cycles over the decode time (1.00: the forecast "
          "matches the clock; -: the method forecasts no time)",
          "copies/tok: host-to-device expert copies per new token (slot-cache misses + prefetches); MiB/tok: their "
          "MiB per token",
          "copy wait: share of decode time the host was blocked by copies (on a CPU, emulated link included: all of "
          "the stall; on CUDA only the issue time, the device-side wait shows in tok/s)",
          "hit rate: share of the experts the forwards needed that were already in a slot",
          "hits/tok, host/tok (with a host lane): experts per token found in a slot, and computed on the host lane "
          "(neither resident nor copied); host wait: share of decode time the host waited for the lane (CPU: an "
          "emulated lane, the part of its time nothing hid)")


def plot_comparison(table, title: str | None = None):
    """Bar charts of tok/s (with the spread over prompts as error bars, where there are two prompts or more) and
    expert copies per token by method, under ``title`` (default: what was compared); ``table``: what ``compare``
    returned (either form). Returns the two axes."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError('plotting needs matplotlib, an optional dependency: pip install "specfit[plot]"') from err
    rows = table if isinstance(table, list) else table.reset_index().to_dict("records")
    names = [r["label"] for r in rows]
    spread = [r.get("tok_s_spread") or 0.0 for r in rows]
    fig, (speed, copies) = plt.subplots(1, 2, figsize=(8, 3.4))
    speed.bar(names, [r["tok_s"] for r in rows], yerr=spread, capsize=4, color="tab:blue")
    speed.set_ylabel("tok/s (wall clock)")
    prompts = rows[0].get("prompts", 0) if rows else 0
    speed.set_title("error bars: standard deviation over prompts" if any(spread) else
                    f"{prompts} prompt{'s' if prompts != 1 else ''}: no spread to show", fontsize=8)
    copies.bar(names, [r["copies_per_token"] for r in rows], color="tab:red")
    copies.set_ylabel("expert copies per token")
    for ax in (speed, copies):
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle(title or f"specfit.compare: {', '.join(names)} on {prompts} prompt{'s' if prompts != 1 else ''}",
                 fontsize=9)
    fig.tight_layout()
    return speed, copies
