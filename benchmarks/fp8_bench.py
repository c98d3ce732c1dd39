"""FP8 experts against bf16 experts on the embedded model (CPU, emulated link priced per byte; not GPU speed).

One interleaved run, prompt by prompt: SpecFit on the bf16 model, then AR, EAGLE-3 and SpecFit on its FP8 variant
(``specfit.embedded.load(..., fp8=True)``), each its own instance with 12 of 64 slots and the structural default link
(per byte: a bf16 expert copy costs what it always did, an FP8 one about half). Whole generate() calls are timed.
Before the timing, each prompt's greedy output on the FP8 model is checked against plain transformers' own load of
the same FP8 folder (fp32, where it dequantizes on a CPU), for all three methods.

    python benchmarks/fp8_bench.py --gsm8k 6 --cnn 4 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gsm8k", type=int, default=6, help="GSM8K test questions (held out: the drafter trains on train)")
    p.add_argument("--cnn", type=int, default=4, help="CNN/DailyMail test articles")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--slots", type=int, default=12)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM

    from specfit import embedded
    from specfit.evaluation import datasets
    from specfit.evaluation.harness import interleave

    link = embedded.default_link()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models = {"specfit-bf16": embedded.load(args.slots, link=link)[0]}
        for m in ("ar", "eagle3", "specfit"):
            models[f"{m}-fp8"], tokenizer = embedded.load(args.slots, link=link, fp8=True)
    assistants = {"specfit-bf16": "specfit", "ar-fp8": None, "eagle3-fp8": "eagle3", "specfit-fp8": "specfit"}
    fp8_dir = models["ar-fp8"].name_or_path
    reference = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()
    bytes_ratio = models["specfit-fp8"].specfit.store.weight_bytes / models["specfit-bf16"].specfit.store.weight_bytes
    result = dict(note="CPU, emulated link (structural default, priced per byte): not GPU speed",
                  slots=args.slots, max_new_tokens=args.max_new_tokens, fp8_folder=fp8_dir,
                  link_ms_per_bf16_expert=embedded.link_seconds_per_expert(link) * 1e3,
                  link_ms_per_fp8_expert=link.copy_time(models["specfit-fp8"].specfit.store.expert_bytes) * 1e3,
                  host_arena_bytes_fp8_over_bf16=bytes_ratio,
                  warnings=sorted({str(w.message)[:200] for w in caught if "profile" in str(w.message)}),
                  workloads={})
    for workload, n in (("gsm8k", args.gsm8k), ("cnn", args.cnn)):
        texts = datasets.prompts(workload, n + 1, max_chars=1200)  # + 1: the first prompt is untimed
        ids = [tokenizer(t, return_tensors="pt").input_ids[:, -450:] for t in texts]
        lossless = []
        for prompt in ids:
            want = reference.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
            for m in ("ar-fp8", "eagle3-fp8", "specfit-fp8"):
                got = models[m].generate(prompt, max_new_tokens=args.max_new_tokens, assistant=assistants[m],
                                        do_sample=False)
                lossless.append(bool(torch.equal(got, want)))
        started = time.time()
        runs = interleave(models, ids, args.max_new_tokens, assistants=assistants, skip=1, check_lossless=False)
        tok_s = {m: runs.counters[m].new_tokens / runs.seconds[m] for m in models}
        result["workloads"][workload] = dict(
            prompts=n, equal_to_transformers=f"{sum(lossless)}/{len(lossless)}", tok_s=tok_s,
            copies_per_token={m: runs.counters[m].copies_per_token for m in models},
            mib_copied_per_token={m: runs.counters[m].bytes_copied / 2**20 / max(1, runs.counters[m].new_tokens)
                                  for m in models},
            specfit_fp8_over_bf16=tok_s["specfit-fp8"] / tok_s["specfit-bf16"],
            specfit_fp8_over_ar_fp8=tok_s["specfit-fp8"] / tok_s["ar-fp8"],
            specfit_fp8_over_eagle3_fp8=tok_s["specfit-fp8"] / tok_s["eagle3-fp8"],
            seconds=time.time() - started)
        print(workload, json.dumps(result["workloads"][workload], indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "workloads"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
