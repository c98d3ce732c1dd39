"""Calibration: SpecFit's forecasts and acceptance model held against what really happens (issue 38).

    python benchmarks/run.py calibration refresh --slots 12 --workload gsm8k --prompts 8 --tokens 48 --load-after 4
    python benchmarks/run.py calibration counterfactual --cells gsm8k:12 cnn:12 gsm8k:24 cnn:24 gsm8k:64:0 \\
        gsm8k:12:1.4:sample --prompts 4 --tokens 48 --out DIR       # --host-ratio 2.5: with the default host lane
    python benchmarks/run.py calibration acceptance record --prompts 16 --out streams.json
    python benchmarks/run.py calibration acceptance replay streams.json [--sparse]

A counterfactual cell is workload:slots[:link ratio[:sample]]: the link as a multiple of the structural default's
demand-to-compute ratio, 1.4 (0: no link); sample: temperature 0.7, top-p 0.8, top-k 20. Held-out prompts: test
items from --offset on; methods take turns prompt by prompt. CPU with an emulated link: not GPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from specfit.cli_checks import at_least, experts_per_layer
from specfit.evaluation.results_file import write_results

WINDOWS = ((0, 10), (10, 30), (30, 60), (60, None))  # refresh: forecast / real over these cycles
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20)  # a counterfactual cell's "sample"
STRENGTHS, DECAYS = (1, 2, 4, 8, 16), (0.95, 0.98, 0.99, 1.0)  # acceptance replay's grid


def held_out(workload: str, n: int, offset: int = 100) -> list[str]:
    """``n`` held-out GSM8K or CNN/DailyMail test prompts from index ``offset`` on (articles cut at 1500 chars)."""
    from specfit.evaluation import datasets

    return datasets.prompts(workload, offset + n, max_chars=1500)[offset:]


def slot_count(text: str) -> int:
    """Expert slots per layer of the embedded model, 1 to its experts per layer (an argparse type)."""
    from specfit.embedded import TARGET_DIR

    experts = experts_per_layer(json.loads((TARGET_DIR / "config.json").read_text()))
    if not text.strip().isdigit() or not 1 <= int(text) <= experts:
        raise argparse.ArgumentTypeError(f"slots must be an integer from 1 to {experts} (the embedded model's "
                                         f"experts per layer), got {text!r}")
    return int(text)


def prompt_ids(tokenizer, texts: list[str]):
    """(i, ids [1, T]) of each prompt in turn: every method runs on a prompt before the next one, so a change of load
    or of a model's state falls on all of them alike."""
    for i, text in enumerate(texts):
        yield i, tokenizer(text, return_tensors="pt").input_ids


def windows(rows, start: int) -> dict:
    """(forecast / real, cycles) per window of cycles counted from ``start`` (None where no time was measured)."""
    out = {}
    for lo, hi in WINDOWS:
        part = rows[start + lo:None if hi is None else start + hi]
        real = sum(r.seconds for r in part)
        out[f"{lo}-{hi or ''}"] = sum(r.predicted_seconds for r in part) / real if real else None, len(part)
    return out


def refresh(args) -> int:
    """Forecast / real in windows of cycles from the start and from a change of load (a busy process on our core from
    prompt --load-after on), online cost refresh on and off, from an empty cache (the shipped profile; --cache)."""
    from specfit import embedded
    from specfit.patch import configure

    torch.set_num_threads(1)
    texts, models, change, busy = held_out(args.workload, args.prompts, args.offset), {}, {}, None
    core = min(os.sched_getaffinity(0))  # this process (a benchmark's own) on one core, with --cache or an empty one
    os.sched_setaffinity(0, {core})
    os.environ["SPECFIT_CACHE"] = args.cache or tempfile.mkdtemp(prefix="specfit-empty-cache-")
    for name, on in (("refreshed", True), ("frozen", False)):
        models[name], tokenizer = embedded.load(args.slots, link=embedded.default_link())
        configure(models[name], cost_refresh=on)
        models[name].specfit.stats.start_trace()
    t0 = time.perf_counter()
    try:
        for i, ids in prompt_ids(tokenizer, texts):
            if args.load_after and i == args.load_after:
                busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\n"
                                                               "while True: pass"])
                change = {name: len(m.specfit.stats.trace) for name, m in models.items()}
            for m in models.values():
                m.generate(ids, max_new_tokens=args.tokens, do_sample=False, assistant="specfit")
    finally:
        if busy is not None:
            busy.kill(), busy.wait()
    wall = time.perf_counter() - t0
    result = {"workload": args.workload, "slots": args.slots, "prompts": args.prompts, "tokens": args.tokens,
              "core": core, "load_after": args.load_after, "wall_s": wall, "models": {}}
    print(f"{args.workload}, {args.slots} slots, {args.prompts} prompts x {args.tokens} tokens, core {core}, busy "
          f"process from prompt {args.load_after or '-'} ({wall:.0f} s); CPU, emulated link: not GPU speed")
    for name, model in models.items():
        rows = list(model.specfit.stats.trace)
        r = result["models"][name] = {"cost_profile": model.specfit.stats.cost_profile, "cycles": len(rows),
                                      "from_start": windows(rows, 0),
                                      "from_change": windows(rows, change[name]) if change else None}
        print(f"  {name:9s} {r['cycles']} cycles; profile: {r['cost_profile']}")
        for label, key in (("from the start", "from_start"), ("from the change", "from_change")):
            if r[key]:
                print(f"    forecast/real {label:16s} " + "  ".join(
                    f"cycles {w}: {'-' if v is None else f'{v:.2f}'} ({n})" for w, (v, n) in r[key].items()))
    print(f"wrote {write_results(args.out, result)}")
    return 0


def cell(text: str) -> dict:
    """A counterfactual cell, ``workload:slots[:link ratio[:sample]]`` (an argparse type: refused as typed)."""
    parts = text.split(":")
    ratio = parts[2] if len(parts) > 2 else "1.4"
    if not (2 <= len(parts) <= 4 and parts[0] in ("gsm8k", "cnn") and parts[3:] in ([], ["sample"])
            and ratio.replace(".", "", 1).isdigit()):
        raise argparse.ArgumentTypeError(f"a cell is workload:slots[:link ratio[:sample]], workload gsm8k or cnn and "
                                         f"the link ratio >= 0 (0: no link), got {text!r}")
    return dict(workload=parts[0], slots=slot_count(parts[1]), ratio=float(ratio), sample=len(parts) > 3, name=text)


def counterfactual(args) -> int:
    """SpecFit's forecast of its own winner and of EAGLE-3's tree (verified on alternate cycles) against what both
    took, per cell (specfit.evaluation.counterfactual), EAGLE-3 itself beside it: terms, not speed."""
    torch.set_num_threads(1)
    print(f"wrote {write_results(args.out, [run_cell(args, c) for c in args.cells], 'counterfactual.json')}")
    return 0


def run_cell(args, c: dict) -> dict:
    """One cell after an untimed warm-up prompt: its report printed, its summary and every cycle's record returned."""
    from specfit import embedded
    from specfit.evaluation.counterfactual import Counterfactual, join, report, summarize

    link = embedded.default_link(c["ratio"] / embedded.DEMAND_TO_COMPUTE) if c["ratio"] > 0 else None
    host = embedded.default_host(args.host_ratio, link) if args.host_ratio > 0 else None
    model, tokenizer = embedded.load(c["slots"], link=link, host=host)
    eagle, _ = embedded.load(c["slots"], link=link, host=host)  # EAGLE-3 itself, same prompts: its own drafting
    kwargs = dict(SAMPLING) if c["sample"] else dict(do_sample=False)
    rows, own, t0 = [], [], time.perf_counter()
    for i, ids in prompt_ids(tokenizer, held_out(c["workload"], args.prompts + 1, args.offset)):
        for m, log in ((model, []), (eagle, None)):
            trace = m.specfit.stats.start_trace()
            if c["sample"]:
                torch.manual_seed(args.seed + i)
            m.generate(ids, max_new_tokens=args.tokens if i else 8, **kwargs,
                       assistant="eagle3" if log is None else Counterfactual.factory(log))
            if i:  # the first prompt is the warm-up
                rows.extend(join(log, trace)) if log is not None else own.extend(trace)
    wall, summary, n, seconds = time.perf_counter() - t0, summarize(rows), len(own), sum(r.seconds for r in own)
    e = summary["eagle3_itself"] = dict(cycles=n, draft_ms=1e3 * sum(r.draft_seconds for r in own) / n,
                                        ms_per_cycle=1e3 * seconds / n, tok_s=sum(r.committed for r in own) / seconds,
                                        tokens_per_cycle=sum(r.committed for r in own) / n)
    copy = "none" if link is None else f"{embedded.link_seconds_per_expert(link) * 1e3:.3f} ms/copy"
    print(report(f"{c['name']} ({args.prompts} prompts x {args.tokens} tokens, {wall:.0f} s; link {copy}"
                 f"{'' if host is None else f'; {host.label}'}; CPU, emulated: not GPU speed)", summary)
          + f"\n  EAGLE-3 itself (its own drafting, same prompts, its own model): drafting {e['draft_ms']:.1f} "
            f"ms/cycle, {e['ms_per_cycle']:.1f} ms/cycle, tokens/cycle {e['tokens_per_cycle']:.2f}, tok/s "
            f"{e['tok_s']:.2f}", flush=True)
    rows = [{k: v for k, v in r.items() if k not in ("parents", "tokens_pool")} for r in rows]  # the draft pools stay out
    return dict(cell=c, summary=plain(summary), rows=plain(rows))


def plain(x):
    """JSON-safe: tuple keys as strings."""
    if isinstance(x, dict):
        return {(",".join(map(str, k)) if isinstance(k, tuple) else str(k)): plain(v) for k, v in x.items()}
    return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x


def record(args) -> int:
    """(depth, rank, q, label) of the children EAGLE-3 drafts, per cycle, on tuning prompts (GSM8K train 100..,
    CNN/DailyMail 24.. from the end: not the tables' calibration prompts; greedy, all 64 experts resident)."""
    from specfit import embedded
    from specfit.evaluation import datasets
    from specfit.evaluation.acceptance_tables import calibration_prompts, collect_cycles

    warnings.simplefilter("ignore", RuntimeWarning)
    torch.set_num_threads(1)
    texts = {"gsm8k": [datasets.GSM8K_PROMPT.format(question=r["question"])
                       for r in datasets.gsm8k("train", 100 + args.prompts)[100:]],
             "cnn": [datasets.CNN_PROMPT.format(article=r["article"][:1500])
                     for r in datasets.cnn_dailymail()[::-1][24:24 + args.prompts]]}
    model, tokenizer = embedded.load(64)
    streams = {name: collect_cycles(model, calibration_prompts(tokenizer, len(prompts), prompts), args.tokens)
               for name, prompts in texts.items()}  # each prompt's last 450 tokens
    print({name: sum(len(c) for p in prompts for c in p) for name, prompts in streams.items()}, "labels; wrote",
          write_results(Path(args.out).parent, streams, Path(args.out).name))
    return 0


def replay(args) -> int:
    """Per-node calibration error of the acceptance model (each cycle predicted, then learnt) per strength and decay,
    from the drafter's tables and the default prior (--sparse: depth 1 of every third cycle, as SpecFit probes)."""
    from specfit import embedded
    from specfit.evaluation.reliability import replay as replay_cycles
    from specfit.selection.acceptance_model import FILENAME, AcceptanceModel, AcceptanceTables

    try:
        streams = json.loads(Path(args.streams).read_text())
        assert all(isinstance(streams.get(w), list) for w in ("gsm8k", "cnn")), "no gsm8k and cnn lists"
    except (OSError, ValueError, AttributeError, AssertionError) as err:
        args.parser.error(f"{args.streams!r} is not a file `acceptance record` wrote: {type(err).__name__} {err}")
    if args.sparse:
        streams = {w: [[[x for x in c if x[0] == 1] if i % 3 == 0 else [] for i, c in enumerate(p)] for p in ps]
                   for w, ps in streams.items()}
    tables = {"drafter's": AcceptanceTables.load(embedded.DRAFTER_DIR / FILENAME),
              "default": AcceptanceTables.default()}
    for (name, t), strength, decay in ((nt, s, d) for nt in tables.items() for s in STRENGTHS for d in DECAYS):
        model = AcceptanceModel(t.greedy, strength, decay)  # one model, workload after workload, as the bench runs
        cells = {w: replay_cycles(model, (c for prompt in streams[w] for c in prompt)) for w in ("gsm8k", "cnn")}
        print(f"{name:<9} strength {strength:<3} decay {decay:<5} " + "  ".join(
            f"{w} {r['ece']:.3f} (floor {r['floor']:.3f}, {r['labels']} labels)" for w, r in cells.items()))
    return 0


def check(args) -> None:
    """Bad values named before any model loads (ValueError)."""
    at_least(args, 1, *(k for k in ("prompts", "tokens") if k in vars(args)))
    at_least(args, 0, *(k for k in ("offset", "load_after", "host_ratio") if k in vars(args)))
    if getattr(args, "load_after", 0) >= getattr(args, "prompts", 1):
        raise ValueError(f"--load-after {args.load_after}: the busy process starts before that prompt, so it must be "
                         f"below --prompts ({args.prompts}); 0: never")
    if getattr(args, "cache", None) is not None and not Path(args.cache).is_dir():
        raise ValueError(f"--cache {args.cache!r} is not a folder (a user cache to read profiles from)")
    no_link = [c["name"] for c in getattr(args, "cells", []) if c["ratio"] == 0]
    if getattr(args, "host_ratio", 0) > 0 and no_link:
        raise ValueError(f"--host-ratio {args.host_ratio}: the host lane is scaled to the link, and cell {no_link[0]} "
                         f"has none; drop that cell or --host-ratio")


def run_part(p: argparse.ArgumentParser, argv, check) -> int:
    """Parse ``argv``, refuse bad values (``check``'s ValueError) in the part's own usage before anything loads, run
    the part (``run``, set by its parser): its exit status."""
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as err:
        args.parser.error(str(err))
    return args.run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="run.py calibration", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="part", required=True)
    r = sub.add_parser("refresh", help=refresh.__doc__)
    r.add_argument("--workload", default="gsm8k", choices=("gsm8k", "cnn"))
    r.add_argument("--slots", type=slot_count, default=12)
    r.add_argument("--load-after", type=int, default=4, help="prompts before the busy process starts (0: never)")
    r.add_argument("--cache", default=None, help="user cache to read profiles from (default: an empty one)")
    c = sub.add_parser("counterfactual", help=counterfactual.__doc__)
    c.add_argument("--cells", nargs="+", type=cell, metavar="CELL", default=[cell(x) for x in (
        "gsm8k:12", "cnn:12", "gsm8k:24", "cnn:24", "gsm8k:64:0", "gsm8k:12:1.4:sample")])
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--host-ratio", type=float, default=0.0,
                   help="cold experts on the structural default host lane at RATIO x the link (0: copies only)")
    steps = sub.add_parser("acceptance", help="the acceptance prior's strength and decay: record label streams, "
                                              "replay them").add_subparsers(dest="step", required=True)
    rec = steps.add_parser("record", help=record.__doc__)
    rep = steps.add_parser("replay", help=replay.__doc__)
    rep.add_argument("streams", help="a file `acceptance record` wrote")
    rep.add_argument("--sparse", action="store_true", help="only depth-1 labels of every third cycle")
    for q, prompts, tokens, out in ((r, 8, 48, "benchmarks/results/forecast-refresh"),
                                    (c, 4, 48, "benchmarks/results/counterfactual"), (rec, 16, 64, "streams.json")):
        q.add_argument("--prompts", type=int, default=prompts, help="prompts (per workload)")
        q.add_argument("--tokens", type=int, default=tokens, help="new tokens per call")
        q.add_argument("--out", default=out, help="the streams file" if q is rec else "the results folder")
    for q in (r, c):
        q.add_argument("--offset", type=int, default=100, help="first held-out test item")
    for q, run in ((r, refresh), (c, counterfactual), (rec, record), (rep, replay)):
        q.set_defaults(run=run, parser=q)
    return run_part(p, argv, check)
