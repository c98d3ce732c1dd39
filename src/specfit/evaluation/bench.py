"""``specfit bench``: the paper's table reproduced on the embedded model, and a regime map.

Rows: AR, EAGLE-3 vanilla (cache cleared before every forward), EAGLE-3 with the cache, SpecFit with the same
cache, transformers' own prompt-lookup decoding on the same offloaded model. Columns: tok/s of whole generate() calls
(wall clock, everything included) and of the decode phase, draft nodes verified per cycle, tokens committed per
cycle, cycle time, expert copies and MiB copied per output token, the share of decode time blocked by copies, the
hit rate, the tokens each method expected against those committed, and SpecFit's time forecast against the clock.
Workloads: the first 40 CNN/DailyMail test articles
(summarisation prompt) and the first 80 GSM8K test questions. Sweep: the equivalents of the paper's 48 / 24 / 12 / 0
slots of 128 (24 / 12 / 6 / none of the embedded model's 64). Regimes: no link cost (SpecFit's overhead) and an
emulated host link (CPU, labelled as such) whose cost per expert copy follows from the model's structure: a token's
full expert demand costs 1.4x its compute, as on the paper's A100 (``--link-ms`` sets it). Output: the tables, a
JSON of every figure, and a PNG of tok/s against slots. The paper's figures are printed apart.

The limit: the *acceptance oracle* (``decoding/oracle.py``, a measurement device, never a default) verifies in
every cycle exactly the path the target accepts, found by a look-ahead forward outside the offload. Its row is shown
apart from the others, by its decode tok/s without the look-ahead's time, and every cell says SpecFit's decode tok/s
as a fraction of it: how close SpecFit's choice of subtree comes to the best any rule can do with this drafter and
pool.

``--map``: the regime map, SpecFit / the best of AR, EAGLE-3 and prompt lookup (whole calls, wall clock) over link
ratios (what copying one token's full expert demand costs, as a multiple of that token's compute: 0.5, 1, 1.4 (the
paper's A100, the default link), 2, 4, 8; 0 for no link) and slot counts (6, 12, 24, all 64), ``--map-prompts``
prompts of ``--map-tokens`` tokens per cell, drawn as heat maps (``regime_map.png``): where speculation pays, and
that SpecFit never loses much where it does not.

Acceptance: the SpecFit row logs every drafted child it labels, so the bench also prints the expected calibration
error of per-node acceptance, the acceptance model's estimates against the raw draft probabilities (the paper's
reward), per workload, and draws a reliability diagram per depth and rank (``reliability.png``).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .. import cli_checks
from . import regime_map, reliability
from .harness import (LABELS, LEGEND, METHODS, ORACLE, PAPER_METHODS, Row, format_table, link_seconds,
                      load_instances, paper_table, side_by_side)
from .demo import host_lane, host_line

SLOTS = ("24", "12", "6", "none")
REGIMES = ("no-link", "emulated")
MAX_PROMPT_TOKENS = 450
# --quick: one cell of the table, the demo's three methods, a few short prompts (each option only where not given)
QUICK = dict(cnn_prompts=3, gsm8k_prompts=3, max_new_tokens=16, slots=["12"], regimes=["emulated"],
             methods=["ar", "eagle3", "specfit"])
QUICK_SAID = ("3 prompts per workload (the first untimed)", "16 new tokens", "12 slots", "the emulated link only",
              "AR, EAGLE-3 and SpecFit")


def add_arguments(p) -> None:
    p.add_argument("--workloads", nargs="+", default=["cnn", "gsm8k"], choices=["cnn", "gsm8k"],
                   help="CNN/DailyMail summarisation and GSM8K questions (test sets)")
    p.add_argument("--cnn-prompts", type=int, default=40, help="CNN/DailyMail articles (the paper: the first 40)")
    p.add_argument("--gsm8k-prompts", type=int, default=80, help="GSM8K questions (the paper: the first 80)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--batch", type=int, default=1,
                   help="prompts per generate() call, left-padded (docs/batch.md); tok/s is then the batch's")
    p.add_argument("--slots", nargs="+", default=list(SLOTS),
                   help="expert slots per layer of the embedded model's 64, or 'none' (no cache: every slot emptied "
                        "before each forward); 24 / 12 / 6 are the paper's 48 / 24 / 12 of 128")
    p.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES),
                   help="no-link: copies cost only the memcpy (SpecFit's overhead shows); emulated: every expert copy "
                        "takes --link-ms, standing in for a GPU's host link")
    p.add_argument("--methods", nargs="+", default=None, choices=list(METHODS), metavar="METHOD",
                   help=f"rows, of: {', '.join(METHODS)} (default: the paper's four, SpecFit with its default "
                        f"deployable routes, plus SpecFit with the paper's reward instead of calibrated acceptance, "
                        f"and SpecFit with exact routes from the oracle, the paper's measurement device)")
    p.add_argument("--link-ms", type=float, default=None,
                   help="emulated link: ms per expert copy (default: the structural default link, a token's full "
                        "expert demand at 1.4x its compute as on the paper's A100: measured on this machine's first "
                        "run, then kept in the user cache; `specfit calibrate` measures it again)")
    p.add_argument("--host-ratio", type=float, default=None, metavar="RATIO",
                   help="the emulated-link regime's host lane: the host reads experts RATIO x as fast as the link "
                        "copies them (default 2.5, a PCIe 4.0 host: specfit.embedded.default_host; every method "
                        "computes cold experts where predicted cheaper); 0: no host lane, every cold expert copied")
    p.add_argument("--map", action="store_true",
                   help="also sweep the regime map: link ratios x slot counts, SpecFit / AR and / EAGLE-3 heat maps")
    p.add_argument("--map-only", action="store_true", help="the regime map alone (no main table)")
    p.add_argument("--map-prompts", type=int, default=6, help="prompts per workload in each cell of the regime map")
    p.add_argument("--map-tokens", type=int, default=None,
                   help="tokens generated per prompt in the regime map (default: --max-new-tokens)")
    p.add_argument("--map-ratios", nargs="*", type=float, default=list(regime_map.MAP_RATIOS),
                   help="link costs of the map: copying one token's full expert demand costs this many times its "
                        "compute (1.4: the paper's A100, the default link; 0: no link; none given: the host axis "
                        "alone)")
    p.add_argument("--map-slots", nargs="+", type=int, default=list(regime_map.MAP_SLOTS), help="slot counts of the map")
    p.add_argument("--map-host-ratios", nargs="*", type=float, default=list(regime_map.MAP_HOST_RATIOS),
                   help="the map's host axis: host lane bandwidths as multiples of the link's, at the default link "
                        "(2.5: the structural default; none given: no host axis)")
    p.add_argument("--map-host-slots", nargs="+", type=int, default=list(regime_map.MAP_HOST_SLOTS),
                   help="slot counts of the host axis")
    p.add_argument("--out", default="bench-results", help="folder for results.json and tok_s_vs_slots.png")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run of a minute or two: " + ", ".join(QUICK_SAID) + " (options given on the command "
                        "line keep their values)")
    p.add_argument("--fp8", action="store_true", help="the FP8 variant of the embedded model (experts as FP8)")


def check_arguments(args) -> None:
    """Every option, before anything loads (no torch imported): a refusal names the value and the valid range."""
    from ..embedded.paths import TARGET_DIR

    regime_map.check_arguments(args)
    cli_checks.at_least(args, 1, "cnn_prompts", "gsm8k_prompts", "max_new_tokens", "threads", "batch")
    cli_checks.milliseconds(args, "link_ms")
    experts = cli_checks.experts_per_layer(json.loads((TARGET_DIR / "config.json").read_text()))
    bad = [s for s in args.slots if s != "none" and not (s.isdigit() and 1 <= int(s) <= experts)]
    if bad:
        raise ValueError(f"--slots are expert slots per layer, each in 1..{experts} (the embedded model's experts "
                         f"per layer) or 'none' (no cache), got {' '.join(bad)}")
    bad = [s for s in args.map_slots if s > experts]
    if bad:
        raise ValueError(f"--map-slots are expert slots per layer, each in 1..{experts} (the embedded model's experts "
                         f"per layer), got {bad}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r} is a file; it names the folder for results.json and the plots")
    cli_checks.writable(args.out, "--out")


def quick(args) -> None:
    """``--quick``: ``QUICK``'s settings for every option left at its default (those given keep their values)."""
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    for name, value in QUICK.items():
        if getattr(args, name) == getattr(defaults, name):
            setattr(args, name, list(value) if isinstance(value, list) else value)


def main(args) -> int:
    import torch

    from . import datasets
    from .. import embedded

    torch.set_num_threads(args.threads)
    if args.quick:
        quick(args)
    if args.methods is None:
        args.methods = list(PAPER_METHODS) + ["prompt-lookup", "specfit-paper", "specfit-oracle", ORACLE]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    # the prompts first: without them there is nothing to measure, so say where to get them before loading anything
    try:
        texts = {w: datasets.prompts(w, args.cnn_prompts if w == "cnn" else args.gsm8k_prompts, max_chars=1800)
                 for w in args.workloads}
    except datasets.DataUnavailable as err:
        print(f"specfit bench: the benchmark prompts are not available: {err}\n`specfit demo` runs without them, "
              f"on built-in prompts.", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded.TARGET_DIR)  # the tokenizer alone: no model loaded for it
    workloads = {w: [tokenizer(t, return_tensors="pt").input_ids[:, -MAX_PROMPT_TOKENS:] for t in prompts]
                 for w, prompts in texts.items()}
    link, how = link_seconds(args.link_ms)
    args.link_ms = embedded.link_seconds_per_expert(link) * 1e3  # per bf16 expert (the default link is per byte)
    ratio = link_to_compute(args.link_ms / 1e3)
    print(f"emulated link: {args.link_ms:.4f} ms per expert copy ({how}); one token's full expert demand costs "
          f"{ratio:.2f}x one token's compute on this machine (the paper's A100: ~1.4x)")
    host = host_lane(args, link)
    print(host_line(host))
    started = time.time()
    result = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), machine=platform.processor() or
                  platform.machine(), torch_threads=args.threads, link_ms=args.link_ms, link_source=how,
                  link_to_compute=ratio, max_new_tokens=args.max_new_tokens, methods=args.methods,
                  host_lane=host.label if host else None,
                  host_ms=host.expert_time(embedded.bf16_expert_bytes(), 1) * 1e3 if host else None,
                  note="CPU; 'emulated link' rows use an emulated host-to-device link (and host lane), not GPU speed")
    try:
        if not args.map_only:
            result.update(_main_table(args, workloads, tokenizer, link, out_dir, host))
        if args.map or args.map_only:
            result["map"] = regime_map.run(args, workloads, link, ratio, out_dir, prepare=lambda model, method: (
                _ensure_profile(model, tokenizer) if method.assistant == "specfit" else None))
    except KeyboardInterrupt as stop:  # Ctrl-C: the cells measured so far are written, and said in one line
        result.update(getattr(stop, "partial", {}), interrupted=True, wall_seconds=time.time() - started)
        (out_dir / "results.json").write_text(json.dumps(result, indent=2))
        cells = getattr(stop, "cells", None)
        done = f"after {cells[0]} of {cells[1]} cells of the table" if cells else "during the regime map"
        raise KeyboardInterrupt(f"{done}; the rows of the cells finished are in {out_dir / 'results.json'}") from None
    result["wall_seconds"] = time.time() - started
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    print(f"\nresults: {out_dir / 'results.json'}")
    return 0


def _main_table(args, workloads, tokenizer, link, out_dir: Path, host=None) -> dict:
    regimes = {r: (link if r == "emulated" else None) for r in args.regimes}  # the host lane beside the link only
    rows = []
    logs, cells = {}, []  # the SpecFit row's labelled children: per workload, and a summary per cell
    total_runs = len(regimes) * len(args.slots) * sum(len(p) for p in workloads.values())
    total_cells = len(regimes) * len(args.slots) * len(workloads)
    spread = {}  # (regime, workload, slots, method) -> standard deviation of its calls' decode tok/s
    try:
        _cells(args, workloads, tokenizer, link, host, regimes, total_runs, rows, logs, cells, spread)
    except KeyboardInterrupt:
        stop = KeyboardInterrupt()
        finished = len({(r.regime, r.workload, r.slots) for r in rows})
        stop.partial, stop.cells = dict(rows=[r.as_dict() for r in rows]), (finished, total_cells)
        raise stop from None
    print(_report(rows, args))
    print("\n".join(LEGEND))
    calibration = {w: reliability.summary(log) for w, log in logs.items()}
    for w, summary in calibration.items():
        print(reliability.describe(f"[{w}] SpecFit, all cells", summary))
    print()
    print(paper_table())
    _plot(rows, out_dir / "tok_s_vs_slots.png", spread)
    if logs:
        reliability.plot(logs, out_dir / "reliability.png")
    return dict(rows=[dict(r.as_dict(), tok_s_spread=spread.get((r.regime, r.workload, r.slots, r.method)))
                      for r in rows], specfit_over_oracle=oracle_fractions(rows),
                acceptance_calibration=dict(workloads=calibration, cells=cells))


def _cells(args, workloads, tokenizer, link, host, regimes, total_runs, rows, logs, cells, spread) -> None:
    """Every cell of the table (regime x slots x workload), appending its rows, acceptance logs and summary, and
    each row's spread over prompts (standard deviation of the decode tok/s of its calls), as it finishes (what
    Ctrl-C keeps)."""
    from tqdm.auto import tqdm

    with tqdm(total=total_runs, desc="bench", unit="prompt") as bar:
        for regime, link in regimes.items():
            for slots in args.slots:
                n_slots = None if slots == "none" else int(slots)
                instances, _ = load_instances(args.methods, n_slots, link, fp8=args.fp8,
                                              host=host if link is not None else None,
                                              prepare=lambda model, method: (
                    _ensure_profile(model, tokenizer) if method.assistant == "specfit" else None))
                for w, prompts in workloads.items():
                    watched = instances.get("specfit")
                    if watched is not None:
                        watched.specfit.acceptance_log = []
                    each = {m: [] for m in instances}  # decode tok/s of each call, for the spread

                    def on_prompt(i, each=each):
                        bar.update(args.batch)
                        for m, model in instances.items():
                            each[m].append(model.specfit.stats.last_generate.tokens_per_second)

                    runs = side_by_side(instances, prompts, args.max_new_tokens, batch=args.batch,
                                        on_prompt=on_prompt)
                    label = ("emulated link + host lane" if host else "emulated link") if link else "no link"
                    rows += [Row.of(m, w, slots, label, len(prompts), c, runs.seconds[m])
                             for m, c in runs.counters.items()]
                    for m, values in each.items():  # the first call is the untimed warm-up (side_by_side's skip)
                        timed = values[1:] if len(values) > 1 else values
                        spread[(label, w, slots, m)] = statistics.stdev(timed) if len(timed) > 1 else 0.0
                    if watched is not None:
                        log, watched.specfit.acceptance_log = watched.specfit.acceptance_log, None
                        logs.setdefault(w, []).extend(log)
                        cell = reliability.summary(log)
                        cell.pop("by_depth_rank", None)
                        cells.append(dict(regime=label, slots=slots, workload=w, **cell))


def oracle_fractions(rows: list[Row]) -> list[dict]:
    """Per cell (regime, workload, slots) with both rows: SpecFit's decode tok/s over the acceptance oracle's decode
    tok/s without its look-ahead (the best any subtree rule can do with this drafter and pool)."""
    out = []
    for key in dict.fromkeys((r.regime, r.workload, r.slots) for r in rows):
        by = {r.method: r for r in rows if (r.regime, r.workload, r.slots) == key}
        if "specfit" in by and ORACLE in by and by[ORACLE].tok_s_excluding_measurement:
            limit = by[ORACLE].tok_s_excluding_measurement
            out.append(dict(regime=key[0], workload=key[1], slots=key[2], specfit_tok_s=by["specfit"].tok_s,
                            oracle_tok_s_excluding_measurement=limit, fraction=by["specfit"].tok_s / limit))
    return out


def _oracle_lines(rows: list[Row]) -> list[str]:
    """The oracle's row of a cell, apart from the others, and SpecFit as a fraction of it."""
    oracle = next((r for r in rows if r.method == ORACLE), None)
    if oracle is None:
        return []
    lines = [f"{LABELS[ORACLE]:<25}{oracle.tok_s_excluding_measurement:>8.1f} tok/s without its look-ahead "
             f"({oracle.tok_s:.1f} with it), {oracle.nodes_per_cycle:.2f} nodes/cyc, {oracle.tokens_per_cycle:.2f} "
             f"tok/cyc, {oracle.copies_per_token:.1f} copies/tok, {oracle.mib_per_token:.2f} MiB/tok"]
    fraction = oracle_fractions(rows)
    if fraction:
        lines.append(f"SpecFit / acceptance oracle (decode tok/s; the oracle's without its look-ahead): "
                     f"{fraction[0]['fraction']:.0%}")
    lines.append("* the limit, a measurement device (never a default): every cycle verifies the path the target "
                 "accepts, found by an extra untracked target forward over the pool, whose time is left out here")
    return lines


def _report(rows: list[Row], args) -> str:
    parts = []
    for regime in sorted({r.regime for r in rows}):
        for w in args.workloads:
            for slots in args.slots:
                cell = [r for r in rows if r.regime == regime and r.workload == w and r.slots == slots]
                sel = [r for r in cell if r.method != ORACLE]
                if sel:
                    parts.append(format_table(sel, f"\n[{w}] slots {slots} of 64, {regime} (CPU"
                                                   f"{', emulated' if regime.startswith('emulated') else ''})"))
                parts += _oracle_lines(cell)
            for base in ("eagle3", "ar", "prompt-lookup", "specfit-paper"):
                ratios = []
                for slots in args.slots:
                    by = {r.method: r for r in rows if r.regime == regime and r.workload == w and r.slots == slots}
                    if "specfit" in by and base in by and by[base].call_tok_s:
                        ratios.append(f"{slots}: x{by['specfit'].call_tok_s / by[base].call_tok_s:.3f}")
                if ratios:
                    parts.append(f"SpecFit (default routes) / {LABELS[base]}, whole calls, wall clock, [{w}] "
                                 f"{regime}, by slots: " + ", ".join(ratios))
            limits = [f"{f['slots']}: {f['fraction']:.0%}" for f in oracle_fractions(rows)
                      if (f["regime"], f["workload"]) == (regime, w)]
            if limits:
                parts.append(f"SpecFit / acceptance oracle (decode tok/s, the oracle's without its look-ahead), [{w}] "
                             f"{regime}, by slots: " + ", ".join(limits))
    return "\n".join(parts)


def _ensure_profile(model, tokenizer) -> None:
    """SpecFit needs a cost profile for this machine and model (one prices every slot count, cache mode and link):
    this machine's, else the reference shipped for the model; calibrate one if there is neither (the FP8 variant)."""
    from . import datasets
    from .calibrate import describe, install
    from .probes import PROBES, calibrate
    from ..selection.profile_files import profile_path
    from ..selection.profiles import calibrate_command, find_profile, profile_key

    if find_profile(model) is not None:
        return
    print(f"no cost profile for {profile_key(model)}: calibrating (GSM8K train questions as probes)")
    prompts = [tokenizer(datasets.GSM8K_PROMPT.format(question=r["question"]), return_tensors="pt").input_ids
               for r in datasets.gsm8k("train", PROBES["num_prompts"])]
    cost = calibrate(model, prompts).cost
    print(describe(cost))
    # a poor fit is used for this run but not installed; the refusal names the command that fits one
    install(cost, profile_path(**profile_key(model)), command=calibrate_command(model))
    model.specfit.cost_model = cost


def link_to_compute(link_s: float) -> float:
    """One token's full expert demand (layers x top-k copies) over one token's compute, on this machine."""
    from .. import embedded

    config = json.loads((embedded.TARGET_DIR / "config.json").read_text())  # its shape, without loading the model
    return config["num_hidden_layers"] * config["num_experts_per_tok"] * link_s / embedded.token_compute_seconds()


def _plot(rows: list[Row], path: Path, spread: dict | None = None) -> None:
    """tok/s against slots, a panel per regime and workload, each point with its spread over prompts (error bars)
    and a title saying what was measured."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'specfit[plot]'): no PNG written")
        return
    spread = spread or {}
    panels = sorted({(r.regime, r.workload) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (regime, w) in zip(axes[0], panels):
        order = [s for s in SLOTS if any(r.slots == s for r in rows)]
        for m in dict.fromkeys(r.method for r in rows):
            cell = {r.slots: r for r in rows if (r.regime, r.workload, r.method) == (regime, w, m)}
            pts = [cell[s].tok_s if s in cell else float("nan") for s in order]
            if cell:
                err = [spread.get((regime, w, s, m), 0.0) if s in cell else 0.0 for s in order]
                ax.errorbar(order, pts, yerr=err, marker="o", capsize=3, label=LABELS[m])
        ax.set_title(f"{w}, {regime} (CPU)", fontsize=9)
        ax.set_xlabel("expert slots per layer (of 64)")
        ax.set_ylabel("decode tok/s")
    axes[0][0].legend(fontsize=7)
    prompts = sorted({r.prompts for r in rows})
    fig.suptitle(f"specfit bench: decode tok/s against expert slots, {'/'.join(map(str, prompts))} prompts per "
                 f"point, error bars: standard deviation over prompts (CPU; emulated link: not GPU speed)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
