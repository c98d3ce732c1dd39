"""How many CPU threads suit the embedded model: AR, EAGLE-3 and SpecFit tok/s with 1, 2 and torch's default.

    python benchmarks/threads.py [--threads 1 2 default] [--rounds 6] [--max-new-tokens 48]

One process, one model; the thread counts take turns (round r: each count in turn runs ``specfit.compare`` on
built-in prompt r, so no data is needed), so a busy stretch of the machine hits them all alike. tok/s is wall clock
of whole generate() calls, the median over rounds; 24 of 64 slots and the demo's emulated link. The figures decide
what ``specfit.embedded.load`` advises (``FASTEST_THREADS``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings

import torch

import specfit

PROMPTS = [
    "Question: Tom has 3 boxes with 12 apples in each box. He gives away 10 apples. How many apples are left?\n"
    "Answer:",
    "Question: A baker makes 24 muffins and sells 3 boxes of 6. How many muffins are left?\nAnswer:",
    "Question: Sara reads 15 pages a day. How many pages does she read in 2 weeks?\nAnswer:",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", nargs="+", default=["1", "2", "default"], help="thread counts, or 'default'")
    p.add_argument("--rounds", type=int, default=6, help="rounds (each thread count once per round)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per generate() call")
    args = p.parse_args()

    default = torch.get_num_threads()
    counts = {name: default if name == "default" else int(name) for name in args.threads}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the thread-count notice: what this script measures
        model, tokenizer = specfit.embedded.load(24, link=specfit.embedded.default_link_seconds())
    figures = {name: {} for name in counts}
    for r in range(args.rounds):
        for name, n in counts.items():
            torch.set_num_threads(n)
            rows = specfit.compare(model, tokenizer, PROMPTS[r % len(PROMPTS)], max_new_tokens=args.max_new_tokens,
                                   warmup=r == 0, as_frame=False)
            for row in rows:
                figures[name].setdefault(row["method"], []).append(row["tok_s"])
    print(f"embedded model, 24 of 64 slots, emulated link; {len(os.sched_getaffinity(0))} CPUs usable, torch default "
          f"{default} threads; median tok/s (wall clock of whole calls) over {args.rounds} rounds")
    for name, n in counts.items():
        cells = "  ".join(f"{m} {statistics.median(v):6.1f}" for m, v in figures[name].items())
        print(f"threads {name:>7} ({n}): {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
