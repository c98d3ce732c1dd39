"""Issue 38's forecast goal: SpecFit's time forecast against the clock, with and without the online cost refresh,
on a machine that never ran ``specfit calibrate`` (the reference profile shipped with specfit is the start) and
after a change of load (a busy process started on the same core half-way through).

    python benchmarks/forecast_refresh.py --slots 12 --workload gsm8k --prompts 8 --tokens 48 --load-after 4

The user cache is an empty temporary folder unless ``--cache`` names one (then this machine's calibrated profile
there is the start). Both SpecFit models (refresh on, refresh off) decode the same held-out prompts (GSM8K or
CNN/DailyMail test items from index 100 on), taking turns prompt by prompt, one process pinned to one core; after
``--load-after`` prompts a busy-looping process is pinned to that core too, until the end. Reported: forecast / real
(predicted over measured seconds, summed over cycles) in windows of cycles from the start and from the change, per
model. CPU with an emulated link (the structural default): not GPU speed. Smoke: ``--prompts 2 --tokens 12
--load-after 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WINDOWS = ((0, 10), (10, 30), (30, 60), (60, None))


def windows(rows, start: int) -> dict:
    """forecast / real over cycle windows counted from ``start``."""
    out = {}
    for lo, hi in WINDOWS:
        part = rows[start + lo: None if hi is None else start + hi]
        real = sum(r.seconds for r in part)
        out[f"{lo}-{'' if hi is None else hi}"] = (sum(r.predicted_seconds for r in part) / real if real else None,
                                                   len(part))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="gsm8k", choices=("gsm8k", "cnn"))
    p.add_argument("--slots", type=int, default=12)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--offset", type=int, default=100)
    p.add_argument("--load-after", type=int, default=4, help="prompts before the busy process starts (0: never)")
    p.add_argument("--cache", default=None, help="user cache to read profiles from (default: an empty one)")
    p.add_argument("--out", default="benchmarks/results/forecast-refresh")
    args = p.parse_args()
    os.environ["SPECFIT_CACHE"] = args.cache or tempfile.mkdtemp(prefix="specfit-empty-cache-")
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    from specfit import embedded
    from specfit.evaluation import datasets
    from specfit.patch import configure

    models = {}
    for name, refresh in (("refreshed", True), ("frozen", False)):
        models[name], tokenizer = embedded.load(args.slots, link=embedded.default_link())
        configure(models[name], cost_refresh=refresh)
        models[name].specfit.stats.start_trace()
    texts = datasets.prompts(args.workload, args.offset + args.prompts, max_chars=1500)[args.offset:]
    busy, change = None, {}
    t0 = time.perf_counter()
    try:
        for i, text in enumerate(texts):
            if args.load_after and i == args.load_after:
                busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\n"
                                                                "while True: pass"])
                change = {name: len(m.specfit.stats.trace) for name, m in models.items()}
            ids = tokenizer(text, return_tensors="pt").input_ids
            for name, model in models.items():
                model.generate(ids, max_new_tokens=args.tokens, do_sample=False, assistant="specfit")
    finally:
        if busy is not None:
            busy.kill()
    result = {"workload": args.workload, "slots": args.slots, "prompts": args.prompts, "tokens": args.tokens,
              "core": core, "load_after": args.load_after, "wall_s": time.perf_counter() - t0, "models": {}}
    print(f"{args.workload}, {args.slots} slots, {args.prompts} prompts x {args.tokens} tokens, core {core}, busy "
          f"process from prompt {args.load_after or '-'} ({result['wall_s']:.0f} s); CPU, emulated link")
    for name, model in models.items():
        rows = list(model.specfit.stats.trace)
        r = {"cost_profile": model.specfit.stats.cost_profile, "cycles": len(rows), "from_start": windows(rows, 0),
             "from_change": windows(rows, change[name]) if change else None}
        result["models"][name] = r
        print(f"  {name:9s} {r['cycles']} cycles; profile: {r['cost_profile']}")
        for label, key in (("from the start", "from_start"), ("from the change", "from_change")):
            if r[key]:
                print(f"    forecast/real {label:16s} " + "  ".join(
                    f"cycles {w}: {'-' if v is None else f'{v:.2f}'} ({n})" for w, (v, n) in r[key].items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
