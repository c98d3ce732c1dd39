"""Register your own assistant: here a chain drafter that verifies only the most probable path of the pool.

    python examples/custom_assistant.py

Any factory ``factory(model) -> TreeCandidateGenerator`` can be registered; ``generate(..., assistant=NAME)`` then
runs it inside SpecFit's decoding loop (draft, select, verify, accept, compact, observe), losslessly.
"""

import torch

import specfit
from specfit import embedded
from specfit import Eagle3Generator


class ChainGenerator(Eagle3Generator):
    """Drafts the usual EAGLE tree, verifies the chain of best children from the root."""

    def select(self, tree, cycle):
        chain, parent = [], -1
        while True:
            children = [v for v in range(len(tree)) if tree.parents[v] == parent]
            if not children or len(chain) == self.max_nodes:
                return tuple(chain)
            parent = max(children, key=lambda v: tree.path_probs[v])
            chain.append(parent)


specfit.register_assistant("chain", ChainGenerator, replace=True)

torch.set_num_threads(1)  # fastest for a model this small; this script owns its process, so it sets it
model, tokenizer = embedded.load(cache_slots=24)
ids = tokenizer("Question: What is 7 times 8?\nAnswer:", return_tensors="pt").input_ids
for assistant in (None, "chain", "eagle3"):
    out = model.generate(ids, max_new_tokens=40, do_sample=False, assistant=assistant)
    g = model.specfit.stats.last_generate
    print(f"{assistant or 'AR':7} tokens/cycle {g.tokens_per_cycle:.2f}  nodes/cycle {g.nodes_per_cycle:.2f}  "
          f"-> {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")
