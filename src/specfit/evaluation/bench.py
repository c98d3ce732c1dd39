"""``specfit bench``: the paper's table reproduced on the embedded model.

Rows: AR, EAGLE-3 vanilla (cache cleared before every forward), EAGLE-3 with the cache, SpecFit with the same
cache. Columns: tok/s, draft nodes verified per cycle, tokens committed per cycle, cycle time, expert copies per
output token. Workloads: the first 40 CNN/DailyMail test articles (summarisation prompt) and the first 80 GSM8K test
questions. Sweep: the equivalents of the paper's 48 / 24 / 12 / 0 slots of 128 (24 / 12 / 6 / none of the embedded
model's 64). Regimes: no link cost (SpecFit's overhead) and an emulated host link (CPU, labelled as such). Output:
the tables, a JSON of every figure, and a PNG of tok/s against slots. The paper's figures are printed apart.

Acceptance: the SpecFit row logs every drafted child it labels, so the bench also prints the expected calibration
error of per-node acceptance, the acceptance model's estimates against the raw draft probabilities (the paper's
reward), per workload, and draws a reliability diagram per depth and rank (``reliability.png``).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import reliability
from .harness import (EMBEDDED_LINK_S, LABELS, METHODS, PAPER_METHODS, Row, format_table, load_instances,
                      paper_table, run_side_by_side, token_compute_seconds)

SLOTS = ("24", "12", "6", "none")
REGIMES = {"no-link": None, "emulated": EMBEDDED_LINK_S}
MAX_PROMPT_TOKENS = 450


def add_arguments(p) -> None:
    p.add_argument("--workloads", nargs="+", default=["cnn", "gsm8k"], choices=["cnn", "gsm8k"],
                   help="CNN/DailyMail summarisation and GSM8K questions (test sets)")
    p.add_argument("--cnn-prompts", type=int, default=40, help="CNN/DailyMail articles (the paper: the first 40)")
    p.add_argument("--gsm8k-prompts", type=int, default=80, help="GSM8K questions (the paper: the first 80)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
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
    p.add_argument("--link-ms", type=float, default=EMBEDDED_LINK_S * 1e3,
                   help="emulated link: ms per expert copy, chosen so that a token's expert copies take ~1.4x its compute, as on "
                        "the paper's A100")
    p.add_argument("--out", default="bench-results", help="folder for results.json and tok_s_vs_slots.png")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)")
    p.add_argument("--quick", action="store_true", help="4 prompts per workload, 32 new tokens (a smoke run)")


def main(args) -> int:
    from tqdm.auto import tqdm

    from . import datasets

    torch.set_num_threads(args.threads)
    if args.methods is None:
        args.methods = list(PAPER_METHODS) + ["specfit-paper", "specfit-oracle"]
    if args.quick:
        args.cnn_prompts, args.gsm8k_prompts, args.max_new_tokens = 4, 4, 32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    regimes = {r: (args.link_ms / 1e3 if r == "emulated" else None) for r in args.regimes}

    # the prompts first: without them there is nothing to measure, so say where to get them before loading anything
    try:
        texts = {w: datasets.prompts(w, args.cnn_prompts if w == "cnn" else args.gsm8k_prompts, max_chars=1800)
                 for w in args.workloads}
    except datasets.DataUnavailable as err:
        print(f"specfit bench: the benchmark prompts are not available: {err}\n`specfit demo` runs without them, "
              f"on built-in prompts.", file=sys.stderr)
        return 2
    _, tokenizer = load_instances(["ar"], 1, None)
    workloads = {w: [tokenizer(t, return_tensors="pt").input_ids[:, -MAX_PROMPT_TOKENS:] for t in prompts]
                 for w, prompts in texts.items()}
    ratio = _link_ratio(args.link_ms / 1e3)
    print(f"emulated link: {args.link_ms:.3f} ms per expert copy; one token's full expert demand costs "
          f"{ratio:.2f}x one token's compute on this machine (target ~1.4x, as on the paper's A100)")

    rows, started = [], time.time()
    logs, cells = {}, []  # the SpecFit row's labelled children: per workload, and a summary per cell
    total_runs = len(regimes) * len(args.slots) * sum(len(p) for p in workloads.values())
    with tqdm(total=total_runs, desc="bench", unit="prompt") as bar:
        for regime, link_s in regimes.items():
            for slots in args.slots:
                n_slots = None if slots == "none" else int(slots)
                instances, _ = load_instances(args.methods, n_slots, link_s, prepare=lambda model, method: (
                    _ensure_profile(model, tokenizer) if method.assistant == "specfit" else None))
                for w, prompts in workloads.items():
                    watched = instances.get("specfit")
                    if watched is not None:
                        watched.specfit.acceptance_log = []
                    totals, _ = run_side_by_side(instances, prompts, args.max_new_tokens,
                                                 on_prompt=lambda i: bar.update(1))
                    label = "emulated link" if link_s else "no link"
                    rows += [Row.of(m, w, slots, label, len(prompts), c) for m, c in totals.items()]
                    if watched is not None:
                        log, watched.specfit.acceptance_log = watched.specfit.acceptance_log, None
                        logs.setdefault(w, []).extend(log)
                        cell = reliability.summary(log)
                        cell.pop("by_depth_rank", None)
                        cells.append(dict(regime=label, slots=slots, workload=w, **cell))
    report = _report(rows, args)
    print(report)
    calibration = {w: reliability.summary(log) for w, log in logs.items()}
    for w, summary in calibration.items():
        print(reliability.describe(f"[{w}] SpecFit, all cells", summary))
    print()
    print(paper_table())
    result = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), machine=platform.processor() or
                  platform.machine(), torch_threads=args.threads, link_ms=args.link_ms, link_to_compute=ratio,
                  max_new_tokens=args.max_new_tokens, methods=args.methods, wall_seconds=time.time() - started,
                  note="CPU; 'emulated link' rows use an emulated host-to-device link, not GPU speed",
                  rows=[r.as_dict() for r in rows],
                  acceptance_calibration=dict(workloads=calibration, cells=cells))
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    _plot(rows, out_dir / "tok_s_vs_slots.png")
    if logs:
        reliability.plot(logs, out_dir / "reliability.png")
    print(f"\nresults: {out_dir / 'results.json'}")
    return 0


def _report(rows: list[Row], args) -> str:
    parts = []
    for regime in sorted({r.regime for r in rows}):
        for w in args.workloads:
            for slots in args.slots:
                sel = [r for r in rows if r.regime == regime and r.workload == w and r.slots == slots]
                if sel:
                    parts.append(format_table(sel, f"\n[{w}] slots {slots} of 64, {regime} (CPU"
                                                   f"{', emulated' if regime == 'emulated link' else ''})"))
            for base in ("eagle3", "ar"):
                ratios = []
                for slots in args.slots:
                    by = {r.method: r for r in rows if r.regime == regime and r.workload == w and r.slots == slots}
                    if "specfit" in by and base in by and by[base].tok_s:
                        ratios.append(f"{slots}: x{by['specfit'].tok_s / by[base].tok_s:.3f}")
                if ratios:
                    parts.append(f"SpecFit (default routes) / {LABELS[base]}, wall clock, [{w}] {regime}, by slots: "
                                 + ", ".join(ratios))
    return "\n".join(parts)


def _ensure_profile(model, tokenizer) -> None:
    """SpecFit needs a cost profile for this machine, slot count, cache mode and link; calibrate one if missing."""
    from . import datasets
    from .calibrate import PROBES, calibrate, describe, install
    from ..selection.cost_model import profile_path
    from ..selection.profiles import find_profile, profile_key

    if find_profile(model) is not None:
        return
    print(f"no cost profile for {profile_key(model)}: calibrating (GSM8K train questions as probes)")
    prompts = [tokenizer(datasets.GSM8K_PROMPT.format(question=r["question"]), return_tensors="pt").input_ids
               for r in datasets.gsm8k("train", PROBES["num_prompts"])]
    cost = calibrate(model, prompts).cost
    print(describe(cost))
    install(cost, profile_path(**profile_key(model)))  # a poor fit is used for this run but not installed
    model.specfit.cost_model = cost


def _link_ratio(link_s: float) -> float:
    instances, tokenizer = load_instances(["ar"], 64, None)
    model = instances["ar"]
    ids = tokenizer("Question: A farmer has 12 cows.\nAnswer:", return_tensors="pt").input_ids
    compute = token_compute_seconds(model, ids)
    demand = model.config.num_hidden_layers * model.config.num_experts_per_tok
    return demand * link_s / compute


def _plot(rows: list[Row], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'specfit[plot]'): no PNG written")
        return
    panels = sorted({(r.regime, r.workload) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (regime, w) in zip(axes[0], panels):
        order = [s for s in SLOTS if any(r.slots == s for r in rows)]
        for m in dict.fromkeys(r.method for r in rows):
            pts = [next((r.tok_s for r in rows if (r.regime, r.workload, r.slots, r.method) == (regime, w, s, m)),
                        None) for s in order]
            if any(p is not None for p in pts):
                ax.plot(order, pts, marker="o", label=LABELS[m])
        ax.set_title(f"{w}, {regime} (CPU)", fontsize=9)
        ax.set_xlabel("expert slots per layer (of 64)")
        ax.set_ylabel("tok/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
