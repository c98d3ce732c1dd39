"""How many CPU threads suit the embedded model: AR, EAGLE-3 and SpecFit tok/s with 1, 2 and torch's default.

    python benchmarks/threads.py [--threads 1 2 default] [--prompts 3] [--max-new-tokens 48] [--rounds 2]

Each thread count runs in a fresh process (torch's thread pool is set once there), with ``specfit.compare`` on the
built-in prompts below (no data needed), 24 of 64 slots and the emulated link the demo uses. tok/s is wall clock of
whole generate() calls. The figures decide what ``specfit.embedded.load`` advises (``FASTEST_THREADS``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROMPTS = [
    "Question: Tom has 3 boxes with 12 apples in each box. He gives away 10 apples. How many apples are left?\n"
    "Answer:",
    "Question: A baker makes 24 muffins and sells 3 boxes of 6. How many muffins are left?\nAnswer:",
    "Question: Sara reads 15 pages a day. How many pages does she read in 2 weeks?\nAnswer:",
]


def child(threads: str, prompts: int, max_new_tokens: int, rounds: int) -> dict:
    import torch

    import specfit
    from specfit.evaluation.harness import EMBEDDED_LINK_S

    if threads != "default":
        torch.set_num_threads(int(threads))
    used = torch.get_num_threads()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the thread-count notice is what this script measures
        model, tokenizer = specfit.embedded.load(24, link=EMBEDDED_LINK_S)
    best = {}
    for _ in range(rounds):  # best of rounds: the least disturbed run of each method
        for row in specfit.compare(model, tokenizer, PROMPTS[:prompts], max_new_tokens=max_new_tokens,
                                   as_frame=False):
            best[row["method"]] = max(best.get(row["method"], 0.0), row["tok_s"])
    return {"threads": threads, "torch_threads": used, "cpus": len(os.sched_getaffinity(0)), "tok_s": best}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", nargs="+", default=["1", "2", "default"], help="thread counts, or 'default'")
    p.add_argument("--prompts", type=int, default=3, help="built-in prompts per round (at most 3)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per generate() call")
    p.add_argument("--rounds", type=int, default=2, help="rounds per thread count (the best is kept)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.prompts, args.max_new_tokens, args.rounds)))
        return 0
    for threads in args.threads:
        out = subprocess.run([sys.executable, __file__, "--child", threads, "--prompts", str(args.prompts),
                              "--max-new-tokens", str(args.max_new_tokens), "--rounds", str(args.rounds)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        figures = "  ".join(f"{m} {v:6.1f}" for m, v in r["tok_s"].items())
        print(f"threads {r['threads']:>7} (torch {r['torch_threads']}, {r['cpus']} CPUs usable): tok/s {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
