"""``specfit demo``: the embedded model with offloaded experts on the CPU, decoded by AR, EAGLE-3 and SpecFit.

Prints the generated text once (all three produce the same tokens: decoding is lossless) and a table of wall-clock
tok/s, draft nodes verified per cycle, tokens committed per cycle and expert copies per token, with a legend. The
measurement is ``specfit.compare`` (the methods interleaved prompt by prompt, whole generate() calls timed). SpecFit
runs with the defaults a user gets (deployable routes from the drafter's trained route predictor). The host link is
emulated (every expert copy costs a set time), so the figures show the offload regime on a CPU; they are not GPU
speed.
"""

from __future__ import annotations

import time
import warnings

import torch

from . import comparison
from .harness import link_seconds, load_instances

METHODS = ("ar", "eagle3", "specfit")

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
    p.add_argument("--slots", type=int, default=12,
                   help="expert slots per layer of 64 (12: where copies dominate, as in the paper's 24 of 128)")
    p.add_argument("--link-ms", type=float, default=None,
                   help="emulated ms per expert copy (default: measured at start so that a token's full expert demand "
                        "costs 1.4x its compute, as on the paper's A100)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)")
    p.add_argument("--fp8", action="store_true", help="the FP8 variant of the embedded model (experts as FP8)")


def main(args) -> int:
    from . import datasets
    from .. import embedded

    started = time.time()
    torch.set_num_threads(args.threads)  # this command owns its process: the count that suits the model (--threads)
    link, how = link_seconds(args.link_ms)
    args.link_ms = embedded.link_seconds_per_expert(link) * 1e3  # per bf16 expert (the default link is per byte)
    print(f"SpecFit demo: the embedded Qwen3-MoE ({_architecture()}) with its EAGLE-3 drafter, "
          f"experts in host memory, {args.slots} slots per layer, CPU with an emulated host link of "
          f"{args.link_ms:.3f} ms per expert copy ({how}; emulated: not GPU speed), {args.threads} CPU thread"
          f"{'s' if args.threads != 1 else ''} (--threads).")
    print("The embedded model is a small model trained by this project only to show the method: its text is not "
          "meant to be good. What matters is that all three methods write the same tokens, and how fast.")
    print(f"Where SpecFit pays: when expert copies are dear - few slots per layer (here {args.slots} of 64) and a "
          f"slow host link (here {args.link_ms:.3f} ms per copy) - it verifies only the draft nodes worth their "
          f"experts' copies, so it copies fewer experts per token than EAGLE-3; with every expert resident or a "
          f"free link it has nothing to save.\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        instances, tokenizer = load_instances(list(METHODS), args.slots, link, fp8=args.fp8)
        tables = []
        for workload in ("gsm8k", "cnn"):
            try:
                texts = datasets.prompts(workload, args.prompts, max_chars=1200)
            except datasets.DataUnavailable as err:
                print(f"({workload}: {err}; using a built-in prompt)")
                texts = FALLBACK[workload]
            result = comparison.run(instances, tokenizer, texts, METHODS, max_new_tokens=args.max_new_tokens)
            for text, out in zip(texts, result.outputs["ar"]):
                print(f"--- {workload} prompt ---\n{_clip(text)}\n--- generated (identical for AR, EAGLE-3 and "
                      f"SpecFit) ---\n{tokenizer.decode(out, skip_special_tokens=True).strip()}\n")
            tables.append(result.format(f"[{workload}] {args.slots} slots of 64, CPU, emulated host link (not GPU "
                                        f"speed), {len(texts)} prompt{'s' if len(texts) != 1 else ''}"))
    for table in tables:
        print(table + "\n")
    print("\n".join(comparison.LEGEND))
    print("AR: plain generate(); EAGLE-3: its tree, 7 nodes verified; SpecFit: the subtree that maximises predicted "
          "tokens per second (default routes: the trained route predictor)\n")
    for warning in caught:
        if "profile" in str(warning.message):
            print(f"note: {warning.message}")
    print(f"({time.time() - started:.0f} s in all. In Python: specfit.compare(model, tokenizer, prompts) runs this "
          f"on your own prompts; `specfit bench` runs the full table.)")
    return 0


def _architecture() -> str:
    from transformers import AutoConfig

    from .. import embedded

    c = AutoConfig.from_pretrained(embedded.TARGET_DIR)
    return f"{c.num_experts} experts, top-{c.num_experts_per_tok}, {c.num_hidden_layers} layers"


def _clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + " [...]"
