"""The batch rule's coordinate ascent against the exact optimum, on batch pools recorded from real decoding.

    python benchmarks/batch_rule_gap.py --prompts 4 --tokens 16

Decodes held-out GSM8K prompts in one batch with ``assistant="specfit"`` on the embedded model (12 slots, default
link and host lane), records every pool the batch rule priced (each row's parents, values, routes, the resident mask,
the prices), then on each recorded batch compares coordinate ascent with the exhaustive optimum: over every pair of
rows at the real node budget, and over all rows with the budget capped at ``--cap`` nodes per row (the exhaustive
search over four full rows, ~300^4 combinations, is out of reach). Prints the mean and worst gap.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import numpy as np
import torch
from forecast_goals import held_out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--cap", type=int, default=2, help="node budget per row for the all-rows exact search")
    args = p.parse_args()
    torch.set_num_threads(1)
    from specfit import embedded
    from specfit.decoding import batch_rows
    from specfit.evaluation import harness
    from specfit.evaluation.batches import left_padded, pad_id
    from specfit.selection.batch_rule import select_batch

    recorded = []
    original = batch_rows.select_batch

    def record(rows, intercepts, beta, miss, resident=None, **kw):
        recorded.append((rows, tuple(intercepts), beta, miss, resident))
        return original(rows, intercepts, beta, miss, resident, **kw)

    batch_rows.select_batch = record
    link = embedded.default_link()
    models, tokenizer = harness.load_instances(("specfit",), 12, link, host=embedded.default_host(
        embedded.HOST_TO_LINK, link))
    model = models["specfit"]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in held_out("gsm8k", args.prompts, 100)]
    ids, mask = left_padded(prompts, len(prompts), pad_id(model))[0]
    model.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, do_sample=False, assistant="specfit")
    pair_gaps, all_gaps = [], []
    for rows, intercepts, beta, miss, resident in recorded:
        for a, b in itertools.combinations(range(len(rows)), 2):
            pair = [rows[a], rows[b]]
            ascent = select_batch(pair, intercepts, beta, miss, resident, exact_limit=0)
            exact = select_batch(pair, intercepts, beta, miss, resident, exact_limit=10 ** 7)
            pair_gaps.append(1 - ascent.ratio / exact.ratio)
        capped = [replace(r, max_nodes=min(r.max_nodes, args.cap)) for r in rows]
        ascent = select_batch(capped, intercepts, beta, miss, resident, exact_limit=0)
        exact = select_batch(capped, intercepts, beta, miss, resident, exact_limit=10 ** 7)
        all_gaps.append(1 - ascent.ratio / exact.ratio)
    print(f"{len(recorded)} recorded batch pools ({args.prompts} rows, GSM8K held out, 12 slots)")
    for name, gaps in (("row pairs, full budget", pair_gaps), (f"all rows, <= {args.cap} nodes per row", all_gaps)):
        g = np.array(gaps)
        print(f"  {name}: {len(g)} searches, gap to exact mean {g.mean():.4%}, worst {g.max():.4%}, "
              f"exact reached in {np.mean(g <= 1e-12):.0%}")


if __name__ == "__main__":
    main()
