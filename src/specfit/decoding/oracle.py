"""The acceptance oracle: the limit of any subtree rule with this drafter and pool. A measurement device, never a
default.

Each cycle drafts the full pool as EAGLE-3 does, then finds the path the target will accept by a look-ahead: one
target forward over root + pool that runs outside the offload (``runtime.measurement()``: no slot touched, no
counter moved, no emulated link; its KV entries dropped again, as the route oracle does), the target's argmax at
every position, and the greedy chain through the tree from the root. It verifies exactly that path, so every node it
verifies is accepted and no rule choosing a subtree of the same pool can commit more per verified node. The verify
forward is the loop's own, priced like any other cycle (slots, copies, link); the look-ahead's time is in the call's
wall clock and shown apart as ``measurement_seconds``, so ``tokens_per_second_excluding_measurement`` is the figure
the oracle stands for.

Greedy only: under sampling the accepted path is a draw, not something a look-ahead can know. The look-ahead reads
raw logits; with logits processors (a repetition penalty, ...) its path can be wrong, and the loop's own verify still
decides what is committed, so the output stays that of plain ``generate()``.

Registered as ``generate(..., assistant="acceptance-oracle")`` when this module is imported: the generate()
strategy imports it, so every enabled model knows the name after a plain ``import specfit``.
"""

from __future__ import annotations

import time

import torch

from ..seam import kv_cache, layers as hf_layers
from .acceptance import walk_greedy
from .assistants import Eagle3Generator, register_assistant
from ..drafting.tree import DraftTree, verify_layout
from ..selection.route_sources import Cycle
from ..transfer import to_host

NAME = "acceptance-oracle"


class AcceptanceOracle(Eagle3Generator):
    """Drafts the full pool (EAGLE-3's drafting), verifies the path the target accepts (found by the look-ahead)."""

    def __init__(self, model):
        super().__init__(model)
        self.path: tuple[int, ...] = ()

    def draft(self, cycle: Cycle) -> DraftTree:
        if cycle.sampling:
            raise ValueError(f"assistant={NAME!r} is a greedy measurement device: under do_sample=True the accepted "
                             f"path is a random draw that no look-ahead can know. Use do_sample=False, or "
                             f"assistant='specfit' / 'eagle3' for sampling")
        tree = super().draft(cycle)
        self.path = accepted_path(cycle, tree)
        return tree

    def select(self, tree: DraftTree, cycle: Cycle) -> tuple[int, ...]:
        self.expected_tokens = len(self.path) + 1.0  # the oracle knows: the path and the bonus token
        return tuple(sorted(self.path))


def accepted_path(cycle: Cycle, tree: DraftTree) -> tuple[int, ...]:
    """Pool indices of the path the target accepts greedily (root's child first): one target forward over root +
    pool outside the offload, its argmax at every position, the chain of children whose token is their parent's
    argmax. Its time is added to ``cycle.measurement_seconds``."""
    if not len(tree):
        return ()
    t0 = time.perf_counter()
    model, cache = cycle.model, cycle.cache
    n = len(tree) + 1
    layout = verify_layout(tree, range(len(tree)), cycle.root, cycle.base, kv_cache.kv_capacity(cache, n, cycle.base),
                           hf_layers.compute_dtype(model), model.specfit.staging)
    masks = kv_cache.layer_masks(model, cache, layout.mask, layout.position_ids)  # per layer type (sliding windows)
    with model.specfit.measurement(), torch.no_grad():
        out = model(layout.tokens, cache=cache, position_ids=layout.position_ids, attention_mask=masks,
                    use_cache=True, logits_to_keep=0)
    kv_cache.crop_kv(cache, cycle.base, current=cycle.base + n)  # the look-ahead leaves no KV behind
    choices = to_host(out.logits[0].argmax(-1))[0].tolist()  # [n] the target's token after each tree position
    tokens = [cycle.root] + [tree.tokens[v] for v in layout.nodes]
    acc = walk_greedy(layout.children, tokens, choices, lambda t: None)
    cycle.measurement_seconds += time.perf_counter() - t0
    return tuple(layout.nodes[t - 1] for t in acc.path)  # tree index t >= 1 is pool node layout.nodes[t - 1]


register_assistant(NAME, AcceptanceOracle, replace=True)
