"""Does a call run slower or faster for the method that ran before it? AR, EAGLE-3 and SpecFit on the embedded model
(12 slots, the structural default link), every prompt in each rotation of the methods' order; prints each method's
mean seconds per call, overall and by the method that ran just before it (None: the first of a prompt's round).

    python benchmarks/method_order.py [--workload humaneval] [--prompts 3] [--tokens 48]

CPU with an emulated link: not GPU speed. Written for issue 42, where single grid cells read SpecFit 0.92-0.97x AR
with 97-98% of its cycles plain.
"""

import argparse
import time

import torch

from specfit import embedded
from specfit.evaluation import datasets
from specfit.evaluation.harness import ASSISTANT, GENERATE, load_instances


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="humaneval", choices=datasets.WORKLOADS)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--slots", type=int, default=12)
    args = p.parse_args()
    torch.set_num_threads(1)
    names = ["ar", "eagle3", "specfit"]
    models, tok = load_instances(names, args.slots, embedded.default_link(1.4 / embedded.DEMAND_TO_COMPUTE))
    ids = [tok(text, return_tensors="pt").input_ids
           for text in datasets.prompts(args.workload, args.prompts, max_chars=1500)]

    def call(m, x, tokens):
        t = time.perf_counter()
        models[m].generate(x, max_new_tokens=tokens, do_sample=False, assistant=ASSISTANT[m], **GENERATE.get(m, {}))
        return time.perf_counter() - t

    for m in names:  # warm-up, untimed
        call(m, ids[0], 2 * args.tokens)
    seconds: dict = {}
    for r in range(len(names)):
        order = names[r:] + names[:r]
        for x in ids:
            before = None
            for m in order:
                s = call(m, x, args.tokens)
                seconds.setdefault((m, "any"), []).append(s)
                seconds.setdefault((m, before), []).append(s)
                before = m
    for (m, before), values in sorted(seconds.items(), key=str):
        print(f"{m:8s} after {str(before):8s} calls {len(values):2d}  mean {sum(values) / len(values):.3f} s")
    ar, sf = (sum(seconds[(m, "any")]) for m in ("ar", "specfit"))
    print(f"SpecFit / AR tok/s over every call: {ar / sf:.3f}")


if __name__ == "__main__":
    main()
