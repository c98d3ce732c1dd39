"""AR, EAGLE-3, SpecFit (calibrated acceptance, the default) and SpecFit with the paper's reward, side by side on the
embedded model: tok/s by wall clock *and* by process CPU time, nodes and tokens per cycle, expected / committed
tokens, and the SpecFit row's per-node calibration error (raw draft probabilities vs calibrated estimates).

Everything runs on one thread, so CPU time is the work a call did; on a shared machine wall clock also counts the
time the scheduler gave to others (the emulated link's waits are wall clock only). Methods take turns prompt by
prompt on their own model instances; the first prompt of each workload is a warm-up; every method must write the
same greedy tokens. Timings include each call's prefill.

    python benchmarks/acceptance_side_by_side.py --slots 24 --gsm8k 20 --cnn 12 --out results.json
    python benchmarks/acceptance_side_by_side.py --slots 12 --link-ms 0.28 --gsm8k 12 --cnn 8
"""

import argparse
import json
import time
import warnings

import torch

from specfit.evaluation import datasets
from specfit.evaluation.harness import ASSISTANT, load_instances
from specfit.evaluation.reliability import summary

METHODS = ("ar", "eagle3", "specfit", "specfit-paper")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=24, help="expert slots per layer (of 64)")
    p.add_argument("--link-ms", type=float, default=None, help="emulated link, ms per expert copy (default: none)")
    p.add_argument("--gsm8k", type=int, default=20, help="GSM8K test questions (the first ones)")
    p.add_argument("--cnn", type=int, default=12, help="CNN/DailyMail test articles (the first ones)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="JSON of every figure")
    args = p.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # reference cost profile measured on another machine
    torch.set_num_threads(1)
    instances, tokenizer = load_instances(METHODS, args.slots, args.link_ms / 1e3 if args.link_ms else None)
    workloads = {"gsm8k": datasets.prompts("gsm8k", args.gsm8k),
                 "cnn": datasets.prompts("cnn", args.cnn, max_chars=1800)}
    result = {"slots": args.slots, "link_ms": args.link_ms, "max_new_tokens": args.max_new_tokens}
    for name, texts in workloads.items():
        prompts = [tokenizer(t, return_tensors="pt").input_ids[:, -450:] for t in texts]
        instances["specfit"].specfit.acceptance_log = []
        totals = {m: dict(wall=0.0, cpu=0.0, tokens=0, cycles=0, committed=0, expected=0.0, nodes=0)
                  for m in METHODS}
        for i, ids in enumerate(prompts):
            outputs = {}
            for m in METHODS:
                model = instances[m]
                wall, cpu = time.perf_counter(), time.process_time()
                outputs[m] = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                            assistant=ASSISTANT[m])
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                g = model.specfit.stats.last_generate
                if i > 0:  # the first prompt warms up
                    t = totals[m]
                    t["wall"] += wall
                    t["cpu"] += cpu
                    t["tokens"] += g.new_tokens
                    t["cycles"] += g.cycles
                    t["committed"] += g.tokens_committed
                    t["expected"] += g.expected_tokens
                    t["nodes"] += g.nodes_verified
            if not all(torch.equal(outputs[m], outputs["ar"]) for m in METHODS):
                raise AssertionError(f"{name} prompt {i}: the methods wrote different tokens (lossless is broken)")
        calibration = summary(instances["specfit"].specfit.acceptance_log)
        calibration.pop("by_depth_rank", None)
        result[name] = {"methods": totals, "calibration": calibration}
        print(f"[{name}] {args.slots} slots, link {args.link_ms or 'none'} ms; {len(prompts) - 1} prompts "
              f"(+1 warm-up); prefill included")
        for m in METHODS:
            t = totals[m]
            print(f"  {m:<14} wall {t['tokens'] / t['wall']:7.1f} tok/s  cpu {t['tokens'] / t['cpu']:7.1f} tok/s  "
                  f"nodes/cyc {t['nodes'] / t['cycles']:.2f}  tok/cyc {t['committed'] / t['cycles']:.2f}  "
                  f"exp/real {t['expected'] / t['committed']:.3f}")
        for base in ("eagle3", "ar", "specfit-paper"):
            print(f"  specfit / {base}: wall x{totals[base]['wall'] / totals['specfit']['wall']:.3f}, "
                  f"cpu x{totals[base]['cpu'] / totals['specfit']['cpu']:.3f}")
        c = calibration
        print(f"  per-node ECE: calibrated {c['ece_calibrated']:.3f}, raw {c['ece_raw']:.3f}, perfect-calibration "
              f"floor {c['ece_floor']:.3f}, over {c['labels']} labels")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
