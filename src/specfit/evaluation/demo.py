"""``specfit demo``: the embedded model with offloaded experts on the CPU, decoded by AR, EAGLE-3 and SpecFit.

Prints the generated text once (all three produce the same tokens: decoding is lossless) and a table of wall-clock
tok/s, draft nodes verified per cycle, tokens committed per cycle and expert copies per token, with a legend. SpecFit
runs with the defaults a user gets (deployable routes from the drafter's trained route predictor). The host link is
emulated (every expert copy costs a set time), so the figures show the offload regime on a CPU; they are not GPU
speed.
"""

from __future__ import annotations

import time
import warnings

import torch

from .harness import EMBEDDED_LINK_S, LEGEND, Row, format_table, load_instances, run_side_by_side

# used only when neither the local data folder nor the hub can provide GSM8K / CNN prompts
FALLBACK = {
    "gsm8k": ["Question: Tom has 3 boxes with 12 apples in each box. He gives away 10 apples. How many apples does "
              "he have left?\nAnswer:"],
    "cnn": ["Article: The city council voted on Tuesday to extend the opening hours of the public library, after a "
            "year in which the number of visitors doubled. The library will now stay open until nine in the "
            "evening on weekdays.\nSummary:"],
}


def add_arguments(p) -> None:
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload (GSM8K and CNN/DailyMail)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--slots", type=int, default=24, help="expert slots per layer of 64 (24 = the paper's 48/128)")
    p.add_argument("--link-ms", type=float, default=EMBEDDED_LINK_S * 1e3, help="emulated ms per expert copy")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)")


def main(args) -> int:
    from . import datasets

    started = time.time()
    torch.set_num_threads(args.threads)
    print(f"SpecFit demo: the embedded Qwen3-MoE (64 experts, top-4, 6 layers) with its EAGLE-3 drafter, experts "
          f"in host memory, {args.slots} slots per layer, CPU with an emulated host link of {args.link_ms:.2f} ms "
          f"per expert copy (emulated: not GPU speed).")
    print("The embedded model is a 5.6M-parameter model trained by this project only to show the method: its text is "
          "not meant to be good. What matters is that all three methods write the same tokens, and how fast.\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        instances, tokenizer = load_instances(["ar", "eagle3", "specfit"], args.slots, args.link_ms / 1e3)
        rows = []
        for workload in ("gsm8k", "cnn"):
            try:
                texts = datasets.prompts(workload, args.prompts, max_chars=1200)
            except datasets.DataUnavailable as err:
                print(f"({workload}: {err}; using a built-in prompt)")
                texts = FALLBACK[workload]
            ids = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
            totals, outputs = run_side_by_side(instances, ids, args.max_new_tokens, warmup=0)
            for text, out in zip(texts, outputs["ar"]):
                print(f"--- {workload} prompt ---\n{_clip(text)}\n--- generated (identical for AR, EAGLE-3 and "
                      f"SpecFit) ---\n{tokenizer.decode(out, skip_special_tokens=True).strip()}\n")
            rows += [Row.of(m, workload, str(args.slots), "emulated link", len(ids), c) for m, c in totals.items()]
    for w in ("gsm8k", "cnn"):
        print(format_table([r for r in rows if r.workload == w],
                           f"[{w}] {args.slots} slots of 64, CPU, emulated host link (not GPU speed)"))
        print()
    print("\n".join(LEGEND))
    print("AR: plain generate(); EAGLE-3: its tree, 7 nodes verified; SpecFit: the subtree that maximises predicted "
          "tokens per second (default routes: the trained route predictor)\n")
    for warning in caught:
        if "profile" in str(warning.message):
            print(f"note: {warning.message}")
    print(f"(tok/s: decode phase, wall clock; {time.time() - started:.0f} s in all. `specfit bench` runs the full "
          f"table.)")
    return 0


def _clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + " [...]"
