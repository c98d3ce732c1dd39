"""Would-be host syncs of whole generate() calls on the embedded model (12 slots, no link), per token and per cycle,
counted on the CPU by specfit.evaluation.syncs.WouldBeSyncs (every host wait included). Usage: python benchmarks/host_syncs.py"""

from collections import Counter

import torch

torch.set_num_threads(1)
import specfit
from specfit.evaluation.syncs import WouldBeSyncs

model, tok = specfit.embedded.load(cache_slots=12)
prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many",
           "The quick brown fox jumps over the lazy dog. Then the dog", "Question: what is 12 times 7? Answer:"]
layers = len(model.specfit.layers)
for method in (None, "eagle3", "specfit"):
    total, toks, cycles, kinds, sites = 0, 0, 0, Counter(), Counter()
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        kw = {} if method is None else {"assistant": method}
        model.generate(ids, max_new_tokens=8, do_sample=False, **kw)  # warm-up
        with WouldBeSyncs(sites=True) as s:
            out = model.generate(ids, max_new_tokens=32, do_sample=False, **kw)
        c = model.specfit.stats.last_generate
        total += s.total; kinds += s.by_kind; sites += s.where
        toks += out.shape[1] - ids.shape[1]; cycles += c.cycles
    print(f"{method or 'AR'}: {layers} MoE layers; {total / toks:.1f} syncs/token, {total / max(1, cycles):.1f} "
          f"syncs/cycle ({total} over {toks} tokens, {cycles} cycles); by kind {dict(kinds)}")
    print("   sites:", sites.most_common(12))
