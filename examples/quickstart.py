"""Quickstart: the embedded Qwen3-MoE with offloaded experts, decoded by AR, EAGLE-3 and SpecFit.

    python examples/quickstart.py

Runs on a CPU in under a minute, in the demo's configuration (``specfit.embedded.demo_settings()``: 12 of 64 expert
slots, the default emulated host link and host lane, as ``specfit demo`` and the README run). The host link is
emulated (each expert copy costs 1.4x a token's compute / (layers x top-k), measured on this machine once and kept,
so a token's full expert demand costs 1.4x its compute as on the paper's A100), so the speeds show the offload regime
on a CPU, not GPU speed.
"""

import torch

from specfit import embedded

torch.set_num_threads(1)  # fastest for a model this small; this script owns its process, so it sets it
model, tokenizer = embedded.load(**embedded.demo_settings())  # the demo's: 12 of 64 slots, emulated link and lane
prompt = "Question: A baker makes 24 muffins and sells 3 boxes of 6. How many muffins are left?\nAnswer:"
ids = tokenizer(prompt, return_tensors="pt").input_ids

for assistant in (None, "eagle3", "specfit"):
    out = model.generate(ids, max_new_tokens=48, do_sample=False, assistant=assistant)
    g = model.specfit.stats.last_generate
    print(f"{assistant or 'AR':8} {g.tokens_per_second:6.1f} tok/s  {g.nodes_per_cycle:4.2f} nodes/cycle  "
          f"{g.tokens_per_cycle:4.2f} tokens/cycle  {g.copies_per_token:5.1f} copies/token")
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
