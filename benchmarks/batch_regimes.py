"""Batches: plain decoding, EAGLE-3 and SpecFit side by side, per batch size, slot count, workload and host lane.

    python benchmarks/batch_regimes.py --batches 1 2 4 8 --slots 6 12 24 --workloads gsm8k cnn --lanes host copy
    python benchmarks/batch_regimes.py --goals          # issue 50's goal cells (12 slots, default link and lane)
    python benchmarks/batch_regimes.py --smoke          # a smoke run (seconds)

Per cell, fresh instances of each method (each its own model, so caches and guards never mix), one untimed
warm-up call each, then ``--groups`` left-padded batches of held-out prompts (GSM8K and CNN/DailyMail test items
from ``--offset`` on; MT-Bench and HumanEval prompts the drafter never saw), whole generate() calls taking turns
with the order rotating batch by batch; every row's greedy tokens checked identical across methods. Reported per
cell: aggregate tok/s (all rows' new tokens over the calls' wall clock, prefill and everything included), cold
experts (copies + host experts) per committed token, SpecFit's ways and its forecast over the clock. CPU with the
emulated default link (and host lane, ``--lanes host``; ``copy``: every cold expert copied): not GPU speed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

METHODS = ("ar", "eagle3", "specfit")
GOAL_CELLS = [("gsm8k", 4), ("cnn", 4), ("mtbench", 4), ("humaneval", 4), ("gsm8k", 8), ("cnn", 8)]


def held_out(workload: str, n: int, offset: int) -> list[str]:
    from specfit.evaluation import datasets

    start = offset if workload in ("gsm8k", "cnn") else 0  # MT-Bench and HumanEval: never seen by the drafter
    return datasets.prompts(workload, start + n, max_chars=1500)[start:]


def cell(workload: str, batch: int, slots: int, lane: str, groups: int, tokens: int, offset: int,
         sample_seed: int | None = None) -> dict:
    from specfit import embedded
    from specfit.evaluation import harness
    from specfit.evaluation.batches import left_padded, pad_id
    from specfit.stats import Counters

    link = embedded.default_link()
    host = embedded.default_host(embedded.HOST_TO_LINK, link) if lane == "host" else None
    models, tokenizer = harness.load_instances(METHODS, slots, link, host=host)
    texts = held_out(workload, batch * groups, offset)
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    calls = left_padded(prompts, batch, pad_id(models["ar"]))
    sampling = {"do_sample": True, "temperature": 0.8} if sample_seed is not None else {"do_sample": False}
    for method, model in models.items():  # untimed: one short call each (one-time costs stay out)
        model.generate(calls[0][0], attention_mask=calls[0][1], max_new_tokens=4, assistant=harness.ASSISTANT[method],
                       **sampling)
    seconds = {m: 0.0 for m in METHODS}
    counters = {m: Counters() for m in METHODS}
    for g, (ids, mask) in enumerate(calls):
        outputs = {}
        for k in range(len(METHODS)):
            method = METHODS[(g + k) % len(METHODS)]  # the order rotates batch by batch
            if sample_seed is not None:
                torch.manual_seed(sample_seed + g)
            started = time.perf_counter()
            out = models[method].generate(ids, attention_mask=mask, max_new_tokens=tokens,
                                          assistant=harness.ASSISTANT[method], **sampling)
            seconds[method] += time.perf_counter() - started
            counters[method] += models[method].specfit.stats.last_generate
            outputs[method] = out
        if sample_seed is None and any(not torch.equal(outputs[m], outputs["ar"]) for m in METHODS):
            raise AssertionError(f"{workload} batch {g}: greedy rows differ across methods (lossless broken)")
    tok_s = {m: counters[m].new_tokens / seconds[m] for m in METHODS}
    cold = {m: (counters[m].misses + counters[m].host_experts) / max(counters[m].new_tokens, 1) for m in METHODS}
    sf = counters["specfit"]
    best = max(tok_s["ar"], tok_s["eagle3"])
    return {"workload": workload, "batch": batch, "slots": slots, "lane": lane, "groups": len(calls),
            "tokens": tokens, "sampling": sample_seed is not None, "tok_s": tok_s, "cold_per_token": cold,
            "specfit_vs_plain": tok_s["specfit"] / tok_s["ar"], "specfit_vs_best": tok_s["specfit"] / best,
            "cold_vs_eagle3": cold["specfit"] / cold["eagle3"] if cold["eagle3"] else None,
            "ways": sf.ways, "plain_row_cycles": sf.plain_row_cycles, "forecast_over_real": sf.forecast_over_real,
            "nodes_per_row_cycle": {m: counters[m].nodes_verified / max(counters[m].batch_row_cycles or
                                                                           counters[m].cycles, 1)
                                    for m in ("eagle3", "specfit")}}


def line(r: dict) -> str:
    t, c = r["tok_s"], r["cold_per_token"]
    fc = r["forecast_over_real"]
    return (f"{r['workload']:<10}{r['batch']:>3}{r['slots']:>6} {r['lane']:<5}"
            f"{t['ar']:>8.2f}{t['eagle3']:>8.2f}{t['specfit']:>8.2f}{r['specfit_vs_plain']:>8.2f}"
            f"{r['specfit_vs_best']:>8.2f}{c['ar']:>8.1f}{c['eagle3']:>8.1f}{c['specfit']:>8.1f}"
            f"{'-' if fc is None else f'{fc:.2f}':>7}  {r['ways']}")


HEAD = (f"{'workload':<10}{'B':>3}{'slots':>6} {'lane':<5}{'plain':>8}{'EAGLE-3':>8}{'SpecFit':>8}{'/plain':>8}"
        f"{'/best':>8}{'cold:AR':>8}{'E3':>8}{'SF':>8}{'fc/clk':>7}  SpecFit's ways")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--slots", type=int, nargs="+", default=[12])
    p.add_argument("--workloads", nargs="+", default=["gsm8k", "cnn"])
    p.add_argument("--lanes", nargs="+", default=["host"], choices=["host", "copy"])
    p.add_argument("--groups", type=int, default=2, help="batches per cell")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per row")
    p.add_argument("--offset", type=int, default=100, help="first held-out GSM8K / CNN test item")
    p.add_argument("--sample-seed", type=int, default=None, help="seeded sampling (temperature 0.8) instead of greedy")
    p.add_argument("--goals", action="store_true", help="issue 50's goal cells: batch 4 on four workloads, batch 8 "
                                                        "on two, 12 slots, the default host lane")
    p.add_argument("--smoke", action="store_true", help="one tiny cell (batch 2, 12 slots, 6 tokens)")
    p.add_argument("--out", default="benchmarks/results/batch-regimes")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.smoke:
        cells = [("gsm8k", 2, 12, "host")]
        args.groups, args.tokens = 1, 6
    elif args.goals:
        cells = [(w, b, 12, "host") for w, b in GOAL_CELLS]
    else:
        cells = [(w, b, s, lane) for lane in args.lanes for w in args.workloads for s in args.slots
                 for b in args.batches]
    print("CPU, embedded model, emulated default link (and host lane where 'host'): not GPU speed", flush=True)
    print(HEAD, flush=True)
    results = []
    for workload, batch, slots, lane in cells:
        r = cell(workload, batch, slots, lane, args.groups, args.tokens, args.offset, args.sample_seed)
        results.append(r)
        print(line(r), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"written: {out / 'results.json'}")


if __name__ == "__main__":
    main()
