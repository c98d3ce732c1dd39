"""EAGLE-2/3 dynamic tree drafting with an EAGLE-3 drafter, one level at a time.

The drafter's KV cache holds one entry per committed position (``stable`` of them, as many as the target's KV
cache) followed by the entries of the tree being drafted, which are dropped before the next cycle. Level 1 takes the
top-k tokens of the drafter's prediction at the last committed position; each further level expands the top-k nodes
of the newest level (by path probability) by their top-k children, in one drafter forward with a tree mask. Depth,
top-k and the pool's node budget are configurable; SpecFit's defaults are the paper's: top-2, depth 5, 18 nodes.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .drafter import DraftCache, Eagle3Drafter
from .tree import DraftTree


class TreeDrafter:
    def __init__(self, drafter: Eagle3Drafter, topk: int = 2, depth: int = 5, max_pool: int = 18):
        for name, value, low in (("topk", topk, 1), ("depth", depth, 1), ("max_pool", max_pool, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.drafter, self.topk, self.depth, self.max_pool = drafter, topk, depth, max_pool
        self.cache = DraftCache()
        self.stable = 0  # drafter positions of committed tokens
        self._root_logits: torch.Tensor | None = None  # [Vd] prediction for the children of the root
        self._root_hidden: torch.Tensor | None = None  # [H] the pre-norm state that made it

    def reset(self) -> None:
        self.cache, self.stable = DraftCache(), 0

    @torch.no_grad()
    def extend(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Consume committed pairs: ``features`` [1, m, 3Ht] of tokens at positions stable.., and ``next_tokens``
        [1, m], the token after each of them (the last one is the new root)."""
        self.cache.crop(self.stable)
        m = next_tokens.shape[1]
        positions = torch.arange(self.stable, self.stable + m, device=next_tokens.device)[None]  # [1, m]
        logits, hidden = self.drafter(next_tokens, features, positions, cache=self.cache)
        self.stable += m
        self._root_logits, self._root_hidden = logits[0, -1], hidden[0, -1]

    @torch.no_grad()
    def levels(self) -> Iterator[DraftTree]:
        """Yield the pool after each drafted level. Stop iterating to stop drafting."""
        if self._root_logits is None:
            raise RuntimeError("TreeDrafter.extend() must run before drafting")
        self.cache.crop(self.stable)
        tree = DraftTree()
        state: dict[int, torch.Tensor] = {}  # node -> pre-norm state of the step that drafted it [H]
        slot: dict[int, int] = {}  # node -> its drafter KV position, once expanded
        self._add_children(tree, state, [(-1, self._root_logits, self._root_hidden)])
        yield tree
        for level in range(2, self.depth + 1):
            newest = tree.level(level - 1)
            frontier = sorted(newest, key=lambda v: -tree.path_probs[v])[: self.topk]
            if not frontier or len(tree) >= self.max_pool:
                return
            logits, hidden = self._expand(tree, state, slot, frontier, level)
            self._add_children(tree, state, [(v, logits[i], hidden[i]) for i, v in enumerate(frontier)])
            yield tree

    def _expand(self, tree, state, slot, frontier, level):
        """One drafter forward over the frontier nodes (depth level-1) at position stable + level - 2."""
        device = self._root_hidden.device
        n = len(frontier)
        base = len(self.cache)
        for i, v in enumerate(frontier):
            slot[v] = base + i
        allowed = torch.zeros(n, base + n, dtype=torch.bool, device=device)
        allowed[:, : self.stable] = True
        for i, v in enumerate(frontier):
            a = v
            while a >= 0:  # ancestors-or-self that have drafter KV entries
                allowed[i, slot[a]] = True
                a = tree.parents[a]
        dtype = self.drafter.fc.weight.dtype
        mask = torch.zeros(n, base + n, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        ids = torch.tensor([[tree.tokens[v] for v in frontier]], device=device)  # [1, n]
        hidden = torch.stack([state[v] for v in frontier])[None]  # [1, n, H]
        positions = torch.full((1, n), self.stable + level - 2, device=device)
        logits, out = self.drafter(ids, hidden, positions, cache=self.cache, attention_mask=mask[None, None])
        return logits[0], out[0]

    def _add_children(self, tree: DraftTree, state, expansions) -> None:
        """Add the top-k children of each expanded node, best path probability first, within the node budget."""
        candidates = []
        for parent, logits, hidden in expansions:
            q, draft_ids = torch.softmax(logits.float(), -1).topk(self.topk)  # [k], [k]
            tokens = self.drafter.to_target_ids(draft_ids).tolist()
            base = 1.0 if parent < 0 else tree.path_probs[parent]
            candidates += [(base * p, parent, t, hidden) for p, t in zip(q.tolist(), tokens)]
        candidates.sort(key=lambda c: -c[0])
        for path_prob, parent, token, hidden in candidates[: self.max_pool - len(tree)]:
            state[tree.add(parent, token, path_prob)] = hidden
