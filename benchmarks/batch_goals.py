"""Issue 47's goals: a batch of prompts with EAGLE-3 and SpecFit on the embedded model, held-out prompts.

    python benchmarks/batch_goals.py --slots 12 --gsm8k 4 --cnn 4 --tokens 32 --out DIR     # the figures
    python benchmarks/batch_goals.py --smoke                                                # a smoke run

Per workload, the prompts go in groups of ``--batch`` (left-padded, with an attention mask). For each group, whole
generate() calls take turns (wall clock, prefill included): at batch B, plain decoding with copies only
(``ar-copy``), plain decoding with the default host lane (``ar``, ``cold="auto"``), EAGLE-3 and SpecFit (both
``cold="auto"``); then at batch 1 the same prompts one by one with ``ar-copy`` and ``ar``. Greedy outputs at batch
B are checked identical across methods. Reported: aggregate tok/s (all rows' new tokens over the calls' wall clock),
the ratios the issue sets goals on, cold experts (copies + host experts) per committed token, SpecFit's forecast
over the clock. CPU with the emulated link and host lane at their defaults: not GPU speed. Held out: GSM8K and
CNN/DailyMail test items from index 100 on.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from forecast_goals import held_out

BATCH_METHODS = ("ar-copy", "ar", "eagle3", "specfit")
SINGLE_METHODS = ("ar-copy", "ar")


def cell(workload: str, slots: int, link, host, texts: list[str], tokens: int, batch: int) -> dict:
    from specfit.evaluation import harness
    from specfit.evaluation.batches import left_padded, pad_id
    from specfit.stats import Counters

    models, tokenizer = harness.load_instances(BATCH_METHODS, slots, link, host=host)
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    pad = pad_id(models["ar"])
    groups = left_padded(prompts, batch, pad)
    keys = [(m, batch) for m in BATCH_METHODS] + [(m, 1) for m in SINGLE_METHODS]
    seconds = {k: 0.0 for k in keys}
    new = {k: 0 for k in keys}
    counters = {k: Counters() for k in keys}
    for method, model in models.items():  # untimed warm-up: one short batch call each
        model.generate(groups[0][0], attention_mask=groups[0][1], max_new_tokens=4, do_sample=False,
                       assistant=harness.ASSISTANT[method], **harness.GENERATE.get(method, {}))
    t0 = time.perf_counter()
    for g, (ids, mask) in enumerate(groups):
        reference = None
        for method in BATCH_METHODS:
            model = models[method]
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                                 assistant=harness.ASSISTANT[method], **harness.GENERATE.get(method, {}))
            seconds[(method, batch)] += time.perf_counter() - started
            counters[(method, batch)] += model.specfit.stats.last_generate
            new[(method, batch)] += model.specfit.stats.last_generate.new_tokens
            reference = out if reference is None else reference
            if not torch.equal(out, reference):
                raise AssertionError(f"{method} at batch {batch} produced other greedy tokens than ar-copy, group {g}")
        for method in SINGLE_METHODS:
            model = models[method]
            for b in range(ids.shape[0]):
                row = ids[b:b + 1, mask[b].bool()]
                started = time.perf_counter()
                model.generate(row, max_new_tokens=tokens, do_sample=False, assistant=None)
                seconds[(method, 1)] += time.perf_counter() - started
                counters[(method, 1)] += model.specfit.stats.last_generate
                new[(method, 1)] += model.specfit.stats.last_generate.new_tokens
    tok_s = {f"{m}@b{b}": new[(m, b)] / seconds[(m, b)] for (m, b) in keys}
    cold = {f"{m}@b{b}": (c.misses + c.host_experts) / max(new[(m, b)], 1) for (m, b), c in counters.items()}
    copies = {f"{m}@b{b}": c.misses / max(new[(m, b)], 1) for (m, b), c in counters.items()}
    sf = counters[("specfit", batch)]
    rows_per_cycle = {m: counters[(m, batch)].batch_row_cycles / max(counters[(m, batch)].cycles, 1)
                      for m in ("eagle3", "specfit")}
    nodes = {m: counters[(m, batch)].nodes_verified / max(counters[(m, batch)].batch_row_cycles, 1)
             for m in ("eagle3", "specfit")}
    b = f"b{batch}"
    ratios = {f"ar_copy {b}/b1": tok_s[f"ar-copy@{b}"] / tok_s["ar-copy@b1"],
              f"ar auto {b}/b1": tok_s[f"ar@{b}"] / tok_s["ar@b1"],
              f"specfit/ar auto at {b}": tok_s[f"specfit@{b}"] / tok_s[f"ar@{b}"],
              f"specfit/eagle3 at {b}": tok_s[f"specfit@{b}"] / tok_s[f"eagle3@{b}"],
              f"specfit/eagle3 cold per token at {b}": cold[f"specfit@{b}"] / cold[f"eagle3@{b}"]}
    return {"workload": workload, "slots": slots, "batch": batch, "prompts": len(prompts), "tokens": tokens,
            "wall_s": time.perf_counter() - t0, "tok_s": tok_s, "cold_per_token": cold, "copies_per_token": copies,
            "ratios": ratios, "forecast_over_real": sf.forecast_over_real, "rows_per_cycle": rows_per_cycle,
            "nodes_per_row_cycle": nodes}


GOALS = (("ar_copy {b}/b1", 2.2, ">="), ("ar auto {b}/b1", 2.5, ">="), ("specfit/eagle3 at {b}", 1.10, ">="),
         ("specfit/eagle3 cold per token at {b}", 0.8, "<="))


def goals(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        b = f"b{r['batch']}"
        where = f"{r['workload']}, {r['slots']} slots"
        checks = [(name.format(b=b), goal, how) for name, goal, how in GOALS]
        checks.append((f"specfit/ar auto at {b}", 1.15 if r["workload"] == "gsm8k" else 1.00, ">="))
        for name, goal, how in checks:
            value = r["ratios"][name]
            ok = value >= goal if how == ">=" else value <= goal
            out.append(f"{where}: {name} x{value:.2f} (goal {how} {goal}): {'met' if ok else 'MISSED'}")
        fc = r["forecast_over_real"]
        if fc is not None:
            out.append(f"{where}: SpecFit forecast / clock at {b} {fc:.2f} (goal 0.90-1.10): "
                       f"{'met' if 0.9 <= fc <= 1.1 else 'MISSED'}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[12])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--gsm8k", type=int, default=4, help="GSM8K test questions (from --offset on)")
    p.add_argument("--cnn", type=int, default=4, help="CNN/DailyMail test articles (from --offset on)")
    p.add_argument("--offset", type=int, default=100)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--smoke", action="store_true", help="12 slots, 2 GSM8K prompts in a batch of 2, 6 tokens")
    p.add_argument("--out", default="benchmarks/results/batch")
    args = p.parse_args()
    if args.smoke:
        args.slots, args.gsm8k, args.cnn, args.tokens, args.batch = [12], 2, 0, 6, 2
    torch.set_num_threads(1)
    from specfit import embedded

    link = embedded.default_link()
    host = embedded.default_host(embedded.HOST_TO_LINK, link)
    print(f"link: {link.label}; host lane: {host.label}; CPU, emulated: not GPU speed", flush=True)
    results = []
    for workload, n in (("gsm8k", args.gsm8k), ("cnn", args.cnn)):
        if n <= 0:
            continue
        texts = held_out(workload, n, args.offset)
        for slots in args.slots:
            r = cell(workload, slots, link, host, texts, args.tokens, args.batch)
            results.append(r)
            print(f"\n== {workload}, {slots} slots, batch {args.batch}, {r['prompts']} prompts x {r['tokens']} tokens "
                  f"({r['wall_s']:.0f} s)")
            for key in ("tok_s", "cold_per_token", "copies_per_token", "ratios", "rows_per_cycle",
                        "nodes_per_row_cycle"):
                print(f"  {key}: " + ", ".join(f"{k} {v:.2f}" for k, v in r[key].items()))
            print(f"  specfit forecast / clock: {r['forecast_over_real']}", flush=True)
    print("\nGoals (issue 47), this run:")
    print("\n".join(goals(results)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"link": link.label, "host": host.label, "results": results},
                                                 indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
