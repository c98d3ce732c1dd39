"""EAGLE-2/3 dynamic tree drafting with an EAGLE-3 drafter, one level at a time.

The drafter's KV cache holds one entry per committed position (``stable`` of them, as many as the target's KV
cache) followed by the entries of the tree being drafted, which are dropped before the next cycle. Level 1 takes the
top-k tokens of the drafter's prediction at the last committed position; each further level expands the top-k nodes
of the newest level (by path probability) by their top-k children. Depth, top-k and the pool's node budget are
configurable; SpecFit's defaults are the paper's: top-2, depth 5, 18 nodes.

*Processing* a node runs the drafter on (its drafting state, its token) at position ``stable + depth - 1``; the
output predicts its children and is the node's own *state* (the drafter's pre-norm hidden, an estimate of the
target's feature of that token). Expansion processes the top-k frontier; route predictors may ask for the states of
all nodes of a level, processed in the same single forward.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .drafter import DraftCache, Eagle3Drafter
from .tree import DraftTree, ancestors_or_self


class TreeDrafter:
    def __init__(self, drafter: Eagle3Drafter, topk: int = 2, depth: int = 5, max_pool: int = 18):
        for name, value in (("topk", topk), ("depth", depth), ("max_pool", max_pool)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.drafter, self.topk, self.depth, self.max_pool = drafter, topk, depth, max_pool
        self.cache = DraftCache()
        self.stable = 0  # drafter positions of committed tokens
        self.root_logits: torch.Tensor | None = None  # [Vd] prediction for the children of the root
        self.root_state: torch.Tensor | None = None  # [H] the root token's state (it made root_logits)
        self.tree = DraftTree()
        self._drafted_by: dict[int, torch.Tensor] = {}  # node -> state of its parent (what drafted it) [H]
        self._out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # processed node -> (logits [Vd], state [H])
        self._slot: dict[int, int] = {}  # processed node -> its drafter KV position

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
        self.root_logits, self.root_state = logits[0, -1], hidden[0, -1]

    @torch.no_grad()
    def levels(self) -> Iterator[DraftTree]:
        """Yield the pool after each drafted level. Stop iterating to stop drafting."""
        if self.root_logits is None:
            raise RuntimeError("TreeDrafter.extend() must run before drafting")
        self.cache.crop(self.stable)
        self.tree, self._drafted_by, self._out, self._slot = DraftTree(), {}, {}, {}
        self._add_children([(-1, self.root_logits, self.root_state)])
        yield self.tree
        for level in range(2, self.depth + 1):
            newest = self.tree.level(level - 1)
            frontier = sorted(newest, key=lambda v: -self.tree.path_probs[v])[: self.topk]
            if not frontier or len(self.tree) >= self.max_pool:
                return
            self.process(frontier)
            self._add_children([(v, *self._out[v]) for v in frontier])
            yield self.tree

    @torch.no_grad()
    def states(self, nodes) -> torch.Tensor:
        """[n, H] drafter states of pool nodes (processing, in one forward, those not yet processed)."""
        self.process(nodes)
        return torch.stack([self._out[v][1] for v in nodes]) if nodes else self.root_state.new_zeros(0, 0)

    def process(self, nodes) -> None:
        """One drafter forward over the given nodes that have not been processed yet."""
        todo = [v for v in nodes if v not in self._out]
        if not todo:
            return
        tree = self.tree
        device = self.root_state.device
        base, n = len(self.cache), len(todo)
        for i, v in enumerate(todo):
            self._slot[v] = base + i
        rows = []
        for v in todo:  # ancestors are all processed: a node is drafted by processing its parent
            row = [False] * (base + n - self.stable)
            for a in ancestors_or_self(tree.parents, v):
                row[self._slot[a] - self.stable] = True
            rows.append(row)
        dtype = self.drafter.fc.weight.dtype
        mask = torch.full((n, base + n), torch.finfo(dtype).min, dtype=dtype, device=device)  # [n, base + n]
        mask[:, : self.stable] = 0
        mask[:, self.stable:].masked_fill_(torch.tensor(rows, device=device), 0)
        ids = torch.tensor([[tree.tokens[v] for v in todo]], device=device)  # [1, n]
        hidden = torch.stack([self._drafted_by[v] for v in todo])[None]  # [1, n, H]
        positions = torch.tensor([[self.stable + tree.depths[v] - 1 for v in todo]], device=device)  # [1, n]
        logits, out = self.drafter(ids, hidden, positions, cache=self.cache, attention_mask=mask[None, None])
        for i, v in enumerate(todo):
            self._out[v] = (logits[0, i], out[0, i])

    def _add_children(self, expansions) -> None:
        """Add the top-k children of each expanded node, best path probability first, within the node budget."""
        tree = self.tree
        logits = torch.stack([lg for _, lg, _ in expansions])  # [n, Vd]: one softmax and top-k for the whole level
        q, draft_ids = torch.softmax(logits.float(), -1).topk(self.topk)  # [n, k], [n, k]
        probs, tokens = q.tolist(), self.drafter.to_target_ids(draft_ids).tolist()
        candidates = []
        for (parent, _, state), qs, ts in zip(expansions, probs, tokens):
            base = 1.0 if parent < 0 else tree.path_probs[parent]
            # rank: the child's place in its parent's top-k (1 = the drafter's top choice)
            candidates += [(base * p, parent, t, state, rank, p) for rank, (p, t) in enumerate(zip(qs, ts), 1)]
        candidates.sort(key=lambda c: -c[0])
        for path_prob, parent, token, state, rank, q in candidates[: self.max_pool - len(tree)]:
            self._drafted_by[tree.add(parent, token, path_prob, rank, q)] = state
