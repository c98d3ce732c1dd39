"""Issue 36's goals: cold experts computed on an emulated host lane beside the copies, on held-out prompts.

    python benchmarks/host_lane_goals.py --slots 6 12 --gsm8k 8 --cnn 6 --tokens 48 --out DIR     # the figures
    python benchmarks/host_lane_goals.py --smoke                                                     # a smoke run

Per workload and slot count, one interleaved run (methods taking turns prompt by prompt, whole generate() calls,
wall clock, prefill included): AR with every cold expert copied (``ar-copy``: SpecFit's engine before the host lane),
AR, EAGLE-3 and SpecFit with the host lane on ``cold="auto"`` (the default where a lane exists), and, with
``--all``, AR with every cold expert on the host (``ar-host``) and SpecFit with copies only. Greedy outputs are
checked identical. The goals (issue 36): at 12 slots AR auto >= 1.25x AR copy and SpecFit auto >= 1.5x AR copy;
SpecFit >= 1.10x EAGLE-3 (both auto) on GSM8K and CNN/DailyMail at 6 and 12 slots; SpecFit's forecast within +-10% of
the clock. CPU with the emulated link and host lane at their structural defaults (``embedded.default_link()``,
``embedded.default_host()``): not GPU speed. Held out: GSM8K and CNN/DailyMail test items from index 100 on.
Writes ``results.json`` and prints one table per cell and the goals.
"""

from __future__ import annotations

import argparse
import time

import torch

from specfit.evaluation.results_file import write_results
from forecast_goals import held_out  # the same held-out prompts as issue 27's goals

METHODS = ("ar-copy", "ar", "eagle3", "specfit")
MORE = ("ar-host", "specfit-copy")


def cell(slots: int, link, host, prompts: list[str], tokens: int, methods) -> dict:
    from specfit.evaluation import comparison, harness

    models, tokenizer = harness.load_instances(methods, slots, link, host=host)
    t0 = time.perf_counter()
    result = comparison.run(models, tokenizer, prompts, methods, max_new_tokens=tokens)
    rows = {r["method"]: r for r in result.table(False)}
    return {"slots": slots, "prompts": len(prompts), "tokens": tokens, "wall_s": time.perf_counter() - t0,
            "rows": list(rows.values()), "text": result.format(),
            "ratios": {name: rows[a]["tok_s"] / rows[b]["tok_s"] for name, (a, b) in RATIOS.items()
                       if a in rows and b in rows}}


RATIOS = {"ar_auto/ar_copy": ("ar", "ar-copy"), "specfit/ar_copy": ("specfit", "ar-copy"),
          "specfit/eagle3": ("specfit", "eagle3"), "ar_host/ar_copy": ("ar-host", "ar-copy"),
          "specfit/specfit_copy": ("specfit", "specfit-copy")}


def goals(results: list[dict]) -> list[str]:
    """Each goal of issue 36 against what this run measured."""
    out = []
    for r in results:
        where = f"{r['workload']}, {r['slots']} slots"
        ratios = r["ratios"]
        fc = next((row["forecast_over_real"] for row in r["rows"] if row["method"] == "specfit"), None)
        checks = [("SpecFit / EAGLE-3 (both auto)", ratios.get("specfit/eagle3"), 1.10)]
        if r["slots"] == 12:
            checks = [("AR auto / AR copy", ratios.get("ar_auto/ar_copy"), 1.25),
                      ("SpecFit auto / AR copy", ratios.get("specfit/ar_copy"), 1.5)] + checks
        for name, value, goal in checks:
            if value is not None:
                out.append(f"{where}: {name} x{value:.2f} (goal >= {goal}): {'met' if value >= goal else 'MISSED'}")
        if fc is not None:
            out.append(f"{where}: SpecFit forecast / clock {fc:.2f} (goal 0.90-1.10): "
                       f"{'met' if 0.9 <= fc <= 1.1 else 'MISSED'}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[6, 12])
    p.add_argument("--gsm8k", type=int, default=8, help="GSM8K test questions (from --offset on)")
    p.add_argument("--cnn", type=int, default=6, help="CNN/DailyMail test articles (from --offset on)")
    p.add_argument("--offset", type=int, default=100)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--host-ratio", type=float, default=None, help="host lane bandwidth / the link's (default 2.5)")
    p.add_argument("--all", action="store_true", help="also AR all on the host and SpecFit with copies only")
    p.add_argument("--smoke", action="store_true", help="12 slots, 1 prompt per workload, 8 tokens")
    p.add_argument("--out", default="benchmarks/results/host_lane")
    args = p.parse_args()
    if args.smoke:
        args.slots, args.gsm8k, args.cnn, args.tokens = [12], 1, 1, 8
    torch.set_num_threads(1)
    from specfit import embedded

    link = embedded.default_link()
    host = embedded.default_host(embedded.HOST_TO_LINK if args.host_ratio is None else args.host_ratio, link)
    expert = embedded.bf16_expert_bytes()
    print(f"link: {link.label} ({link.copy_time(expert) * 1e3:.3f} ms per bf16 expert copy); host lane: {host.label} "
          f"({host.expert_time(expert, 1) * 1e3:.3f} ms per expert at 1 token); CPU, emulated: not GPU speed",
          flush=True)
    methods = METHODS + (MORE if args.all else ())
    results = []
    for workload, n in (("gsm8k", args.gsm8k), ("cnn", args.cnn)):
        if n <= 0:
            continue
        prompts = held_out(workload, n, args.offset)
        for slots in args.slots:
            r = cell(slots, link, host, prompts, args.tokens, methods)
            r["workload"] = workload
            results.append(r)
            print(f"\n== {workload}, {slots} slots, {r['prompts']} prompts x {r['tokens']} tokens ({r['wall_s']:.0f} s)")
            print(r.pop("text"))
            print("  " + ", ".join(f"{k} x{v:.2f}" for k, v in r["ratios"].items()), flush=True)
    print("\nGoals (issue 36), this run:")
    print("\n".join(goals(results)))
    print(f"results in {write_results(args.out, {'link': link.label, 'host': host.label, 'results': results})}")


if __name__ == "__main__":
    main()
