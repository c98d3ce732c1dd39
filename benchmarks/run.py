"""SpecFit's benchmarks, one entry: ``python benchmarks/run.py SUITE [options]`` (``--help`` after a suite: its own).

Is SpecFit faster than EAGLE-3 and plain decoding on my prompts, at batch 1 and 4?

    python benchmarks/run.py speed --prompts my_prompts.txt        # one prompt a line, or .jsonl with "prompt"

The timed suites (``speed``, ``batch``, ``lane``, ``fp8``, ``regimes``, ``forecast``) are declarations over one
harness (``harness.py``: whole generate() calls, methods taking turns with the order rotating, an untimed warm-up,
greedy outputs compared, every tok/s the wall clock of everything the calls did); a suite's defaults are the grid
below, and every option on the command line overrides them. The others run their own instruments (``SUITES``). On a
CPU the embedded model runs with an emulated host link and host lane: not GPU speed, and every table says so.
Results: ``--out`` (default ``benchmarks/results/SUITE``), as results.json.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from specfit.evaluation.results_file import write_results

ALL_WORKLOADS = ["gsm8k", "cnn", "mtbench", "humaneval"]
THREE = ["ar", "eagle3", "specfit"]
# suite -> (what it answers, its grid); every key is an option of the timed suites (--batches, --methods, ...)
GRIDS = {
    "speed": ("SpecFit against EAGLE-3 and plain decoding at batch 1 and 4, held-out prompts or --prompts FILE",
              dict(batches=[1, 4], workloads=ALL_WORKLOADS, groups=2, tokens=48)),
    "batch": ("batch sizes x slots x host lane: where speculation pays with several prompts, and SpecFit's ways",
              dict(batches=[1, 2, 4, 8], workloads=["gsm8k", "cnn"], groups=2, tokens=32)),
    "lane": ("cold experts on the host lane beside the copies: every cold expert copied (ar-copy) against the lane",
             dict(methods=["ar-copy", "ar", "eagle3", "specfit"], slots=[6, 12], workloads=["gsm8k", "cnn"],
                  groups=4, tokens=48)),
    "fp8": ("FP8 experts against bf16 (specfit-bf16), outputs checked against transformers' own FP8 load",
            dict(methods=["specfit-bf16", "ar", "eagle3", "specfit"], fp8=True, workloads=["gsm8k", "cnn"],
                 groups=4, tokens=48)),
    "regimes": ("the regime map: SpecFit against plain, EAGLE-3 and prompt lookup over link ratios and slots",
                dict(methods=["ar", "eagle3", "specfit", "prompt-lookup"], links=[0.0, 0.5, 1.0, 2.0, 4.0],
                     slots=[6, 12, 24, 64], workloads=["gsm8k", "cnn"], groups=4, tokens=48)),
    "forecast": ("the time forecast against the clock and per-node acceptance calibration, beside the oracle",
                 dict(methods=["ar", "eagle3", "specfit", "specfit-paper", "acceptance-oracle"], slots=[12, 24],
                      workloads=["gsm8k", "cnn"], groups=6, tokens=48, acceptance=True)),
}
DEFAULTS = dict(methods=THREE, batches=[1], slots=[12], workloads=["gsm8k", "cnn"], lanes=["host"], links=[1.0],
                policies=None, threads=[1], groups=4, tokens=48, warmup_tokens=4, offset=100, acceptance=False,
                fp8=False)
# suite -> (module, what it measures): instruments of their own, each with its parts and options
SUITES = {
    "serve": ("serve_load", "`specfit serve` under load: overhead against generate(), clients x requests"),
    "cache": ("cache_policies", "the slot cache's policies on real routes against Belady's MIN, and their clock"),
    "profile": ("cycle_profile", "where one decoding cycle's time goes, part by part"),
    "rules": ("rules", "the selector, one layer's slot plan, the batch rule against the exact optimum"),
    "load": ("loading", "loading a checkpoint (time, peak memory), plain decode over slots on synthetic checkpoints"),
    "calibration": ("calibrating", "the online cost refresh, the counterfactual forecast, the acceptance prior"),
    "quality": ("quality", "bf16 near ties, seeded repeats, a soak of mixed calls (lossless throughout)"),
    "syncs": (None, "would-be host syncs per token and cycle of whole generate() calls"),
    "hf-tests": ("hf_model_tests", "transformers' own Qwen3-MoE tests on SpecFit-enabled models"),
}


def grid_parser(suite: str) -> argparse.ArgumentParser:
    from specfit.evaluation.harness import METHODS

    what, grid = GRIDS[suite]
    d = DEFAULTS | grid
    said = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in grid.items())
    p = argparse.ArgumentParser(prog=f"run.py {suite}", description=what, epilog=f"this suite's grid: {said}")
    p.add_argument("--prompts", metavar="FILE", help="your prompts (one a line, or .jsonl with a \"prompt\" field) "
                                                      "instead of the held-out workloads")
    p.add_argument("--workloads", nargs="+", default=d["workloads"], choices=ALL_WORKLOADS)
    p.add_argument("--methods", nargs="+", default=d["methods"], metavar="METHOD",
                   help=f"any of {', '.join(METHODS)} (with --fp8 also METHOD-bf16); default {' '.join(d['methods'])}")
    p.add_argument("--batches", nargs="+", type=int, default=d["batches"], help="prompts per generate() call")
    p.add_argument("--slots", nargs="+", type=int, default=d["slots"], help="GPU expert slots per layer (of 64)")
    p.add_argument("--lanes", nargs="+", default=d["lanes"], choices=["host", "copy"],
                   help="host: cold experts on the host lane where it pays; copy: every cold expert copied")
    p.add_argument("--links", nargs="+", type=float, default=d["links"],
                   help="the emulated link, x the structural default (0: no link)")
    p.add_argument("--policies", nargs="+", default=d["policies"], help="slot cache policies (default: the default)")
    p.add_argument("--threads", nargs="+", type=int, default=d["threads"], help="torch CPU threads")
    p.add_argument("--groups", type=int, default=None,
                   help=f"batch calls per cell (default {d['groups']}; with --prompts: all the file's prompts)")
    p.add_argument("--tokens", type=int, default=d["tokens"], help="new tokens per row")
    p.add_argument("--warmup-tokens", type=int, default=d["warmup_tokens"],
                   help="tokens of each method's untimed warm-up call")
    p.add_argument("--offset", type=int, default=d["offset"], help="first held-out GSM8K / CNN test item")
    p.add_argument("--sample-seed", type=int, default=None, help="seeded sampling (temperature 0.8) instead of greedy")
    p.add_argument("--acceptance", action=argparse.BooleanOptionalAction, default=d["acceptance"],
                   help="per-node acceptance calibration of the SpecFit methods")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=d["fp8"],
                   help="the embedded model's FP8 variant")
    p.add_argument("--model", help="a model folder of yours (specfit.from_pretrained) instead of the embedded model")
    p.add_argument("--drafter", help="with --model: its EAGLE-3 drafter folder")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="with --model: the dtype")
    p.add_argument("--link-ms", type=float, help="with --model on a CPU: emulate ms per expert copy")
    p.add_argument("--out", default=f"benchmarks/results/{suite}", help="folder for results.json")
    return p


def check(p: argparse.ArgumentParser, args) -> None:
    """Bad values named before any model loads."""
    from specfit.evaluation.harness import METHODS

    from harness import BF16

    bad = [m for m in args.methods if m.removesuffix(BF16) not in METHODS or (m.endswith(BF16) and not args.fp8)]
    if bad:
        p.error(f"--methods {' '.join(bad)}: not a method (choose from {', '.join(METHODS)}; METHOD-bf16 with --fp8)")
    for name in ("batches", "slots", "threads"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name} {' '.join(map(str, getattr(args, name)))}: every value must be 1 or more")
    if (args.groups is not None and args.groups < 1) or args.tokens < 1 or min(args.links) < 0:
        p.error(f"--groups {args.groups}, --tokens {args.tokens}, --links {args.links}: groups and tokens must be 1 "
                f"or more, links 0 or more")
    if args.prompts and not Path(args.prompts).is_file():
        p.error(f"--prompts {args.prompts}: no such file")
    if any(getattr(args, k) for k in ("drafter", "dtype", "link_ms")) and not args.model:
        p.error("--drafter, --dtype and --link-ms go with --model (the embedded model has its own)")
    if args.model and args.fp8:
        p.error("--fp8 builds the embedded model's FP8 variant; a model of yours is loaded as stored")


def run_grid_suite(suite: str, argv: list[str]) -> int:
    import harness

    p = grid_parser(suite)
    args = p.parse_args(argv)
    if args.groups is None and not args.prompts:
        args.groups = (DEFAULTS | GRIDS[suite][1])["groups"]
    check(p, args)
    args.cells = harness.cells(args)
    results = harness.run_grid(args)
    print(f"written: {write_results(args.out, {'suite': suite, 'setting': harness.setting(args), 'cells': results})}")
    return 0


def syncs(argv: list[str]) -> int:
    """Would-be host syncs of AR, EAGLE-3 and SpecFit on the embedded model (12 slots, no link), counted on the CPU."""
    from collections import Counter

    import torch

    import specfit
    from specfit.evaluation.syncs import WouldBeSyncs

    p = argparse.ArgumentParser(prog="run.py syncs", description=syncs.__doc__)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per call")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = specfit.embedded.load(cache_slots=12)
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How",
               "The quick brown fox jumps over the lazy dog. Then the dog", "Question: what is 12 times 7? Answer:"]
    for method in (None, "eagle3", "specfit"):
        total, toks, cycles, kinds = 0, 0, 0, Counter()
        for text in prompts:
            ids = tok(text, return_tensors="pt").input_ids
            kw = {} if method is None else {"assistant": method}
            model.generate(ids, max_new_tokens=4, do_sample=False, **kw)  # warm-up
            with WouldBeSyncs() as s:
                out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False, **kw)
            total, kinds = total + s.total, kinds + s.by_kind
            toks, cycles = toks + out.shape[1] - ids.shape[1], cycles + model.specfit.stats.last_generate.cycles
        print(f"{method or 'AR'}: {total / toks:.1f} syncs/token, {total / max(1, cycles):.1f} syncs/cycle ({total} "
              f"over {toks} tokens, {cycles} cycles); by kind {dict(kinds)}")
    return 0


def run_part(parser: argparse.ArgumentParser, parts, table: dict, argv) -> int:
    """An instrument's part: parse ``argv``, refuse bad values (the part's ``check`` raises ValueError) in the part's
    own usage before anything loads, then run it; ``table``: part -> (run, check), ``parts``: the subparsers."""
    args = parser.parse_args(argv)
    run, check = table[args.part]
    try:
        check(args)
    except ValueError as err:
        parts.choices[args.part].error(str(err))
    return run(args)


def usage() -> str:
    timed = "\n".join(f"  {name:<12}{what}" for name, (what, _) in GRIDS.items())
    other = "\n".join(f"  {name:<12}{what}" for name, (_, what) in SUITES.items())
    return f"{__doc__}\nTimed suites:\n{timed}\nInstruments:\n{other}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suites' modules, beside this file
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    suite, rest = argv[0], argv[1:]
    if suite in GRIDS:
        return run_grid_suite(suite, rest)
    if suite == "syncs":
        return syncs(rest)
    if suite not in SUITES:
        raise SystemExit(f"run.py: no suite {suite!r} (choose from {', '.join([*GRIDS, *SUITES])})")
    module = importlib.import_module(SUITES[suite][0])
    sys.argv = [f"run.py {suite}", *rest]  # the instruments that read sys.argv see theirs
    return module.main(rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
