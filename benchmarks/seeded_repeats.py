"""Issue 35: seeded sampling repeats. On one embedded model (fp32, CPU, 12 slots, the default emulated link),
``torch.manual_seed(seed)`` then the same sampling ``generate(..., assistant="specfit")`` call, ``--repeats`` times per
held-out prompt: how many distinct texts (1 is the goal), while SpecFit's acceptance model, backoff and slot cache
change between the calls; and whether EAGLE-3 under the same seed gives that same text (the token at each position
depends on the seed and the position only, not on the tree).

    python benchmarks/seeded_repeats.py --prompts 2 --repeats 10 --tokens 48      # the figures (~10 min, CPU)
    python benchmarks/seeded_repeats.py --smoke                                   # 1 prompt, 3 repeats, 12 tokens
"""

from __future__ import annotations

import argparse
import time

import torch

from specfit.evaluation.results_file import write_results
from forecast_goals import held_out  # the same held-out prompts (this folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=2, help="held-out prompts: half GSM8K, half CNN/DailyMail")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--slots", type=int, default=12)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--smoke", action="store_true", help="1 prompt, 3 repeats, 12 tokens")
    p.add_argument("--out", default="benchmarks/results/seeded_repeats")
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.repeats, args.tokens = 1, 3, 12
    torch.set_num_threads(1)
    from specfit import embedded

    gsm = (args.prompts + 1) // 2
    prompts = held_out("gsm8k", gsm, 100) + held_out("cnn", args.prompts - gsm, 100)
    model, tokenizer = embedded.load(args.slots, link=embedded.default_link())
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.tokens)
    t0 = time.perf_counter()
    rows = []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        outs, learned = [], []
        for _ in range(args.repeats):
            torch.manual_seed(args.seed)
            outs.append(model.generate(ids, assistant="specfit", **sampling)[0, ids.shape[1]:].tolist())
            learned.append(model.specfit.acceptance_models["sampling"].labels_seen)
        torch.manual_seed(args.seed)
        eagle = model.generate(ids, assistant="eagle3", **sampling)[0, ids.shape[1]:].tolist()
        row = {"prompt": text[:60], "repeats": args.repeats, "distinct_texts": len({tuple(o) for o in outs}),
               "same_as_first": sum(o == outs[0] for o in outs), "eagle3_same": eagle == outs[0],
               "labels_seen_after_each_call": learned, "text": tokenizer.decode(outs[0])}
        rows.append(row)
        print(f"{row['same_as_first']}/{args.repeats} calls gave the first call's text ({row['distinct_texts']} "
              f"distinct); EAGLE-3 same text: {row['eagle3_same']}; acceptance labels seen "
              f"{learned[0]} -> {learned[-1]}: {text[:50]!r}", flush=True)
    result = {"slots": args.slots, "link": model.specfit.link_label, "seed": args.seed, "sampling": sampling,
              "rows": rows, "seconds": time.perf_counter() - t0}
    print(f"{result['seconds']:.0f} s; wrote {write_results(args.out, result)}")


if __name__ == "__main__":
    main()
