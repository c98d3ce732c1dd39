"""EAGLE-2/3 dynamic tree drafting with an EAGLE-3 drafter, one level at a time.

The drafter's KV cache holds one entry per committed position (``stable`` of them, as many as the target's KV
cache) followed by the entries of the tree being drafted, which are dropped before the next cycle. Level 1 takes the
top-k tokens of the drafter's prediction at the last committed position; each further level expands the top-k nodes
of the newest level (by path probability) by their top-k children. Depth, top-k and the pool's node budget are
configurable; SpecFit's defaults are the paper's: top-2, depth 5, 18 nodes.

*Processing* a node runs the drafter on (its drafting state, its token) at position ``stable + depth - 1``; the
output predicts its children and is the node's own *state* (the drafter's pre-norm hidden, an estimate of the
target's feature of that token). A level is processed as soon as it is added, in one forward: the nodes the next
level expands (the level's top-k), or all of its nodes when a ``route_head`` reads their states (route predictors).

One host sync per drafted level: everything the host needs from a level's forward (its nodes' top-k children and,
with a route head, their routes) comes back in one transfer (``transfer.to_host``), and everything the forward
needs from the host (tokens, positions, tree mask) goes in one non-blocking transfer (``transfer.Staging``). Level
1's nodes are processed straight from the device's top-k, before their tokens ever reach the host.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from ..transfer import Staging, to_host
from .drafter import DraftCache, Eagle3Drafter
from .tree import DraftTree


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
        # states [n, H] -> bool routes [n, L, E] on the device (a RoutePredictor's ``routes``); when set, every node
        # is processed and its routes come back with the level
        self.route_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.tree = DraftTree()
        self._staging: Staging | None = None
        self._drafted_by: dict[int, torch.Tensor] = {}  # node -> state of its parent (what drafted it) [H]
        self._out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # processed node -> (logits [Vd], state [H])
        self._slot: dict[int, int] = {}  # processed node -> its drafter KV position
        self._children: dict[int, tuple[list[float], list[int]]] = {}  # processed node -> its top-k (q, tokens)
        self._routes: np.ndarray | None = None  # bool routes of the pool nodes [max_pool, L, E], host (per cycle)
        self._root_routes: np.ndarray | None = None  # bool routes of the root [L, E], host
        self._routed = 0  # pool nodes whose routes came back so far this cycle
        # ancestor-or-self rows of processed nodes over the tree part of the drafter's KV [max_pool, max_pool]: a
        # child's row is its parent's plus its own slot, so a level's mask rows are one gather (no per-node walk)
        self._ancestry = np.zeros((max_pool, max_pool), dtype=bool)

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
        self.begin_cycle()
        tree = self.tree
        # level 1: the root's children, processed from the device's top-k before their tokens reach the host
        q, ids = self._topk(self.root_logits[None])  # [1, k], [1, k]
        first = min(self.topk, self.max_pool)
        for rank in range(1, first + 1):
            self._drafted_by[tree.add(-1, -1, 0.0, rank, 0.0)] = self.root_state  # tokens, probabilities: below
        process = list(range(first)) if self.route_head is not None or self.depth > 1 else []
        root_q, root_ids = self._process(process, ids[0, :first], root=(q, ids))
        for v in range(first):
            tree.tokens[v] = int(root_ids[0, v])
            tree.path_probs[v] = tree.qs[v] = float(root_q[0, v])
        yield tree
        for level in range(2, self.depth + 1):
            newest = tree.level(level - 1)
            frontier = sorted(newest, key=lambda v: -tree.path_probs[v])[: self.topk]
            if not frontier or len(tree) >= self.max_pool:
                return
            added = self._add_children(frontier)
            if self.route_head is not None:
                process = added
            elif level < self.depth:  # only the nodes the next level expands
                process = sorted(added, key=lambda v: -tree.path_probs[v])[: self.topk]
            else:
                process = []
            self._process(process)
            yield tree

    def begin_cycle(self) -> None:
        """A fresh pool for this cycle over the committed cache (``levels``, and a batch's ``batch_drafting``)."""
        if self.root_logits is None:
            raise RuntimeError("TreeDrafter.extend() must run before drafting")
        self.cache.crop(self.stable)
        self.tree, self._drafted_by, self._out, self._slot = DraftTree(), {}, {}, {}
        self._children, self._routes, self._root_routes, self._routed = {}, None, None, 0

    def keep_routes(self, nodes: list[int], routes: np.ndarray, root: np.ndarray | None = None) -> None:
        """Record host bool routes [n, L, E] of pool ``nodes`` (and the root's [L, E], at level 1)."""
        if root is not None:
            self._root_routes = root
        if len(nodes):
            if self._routes is None:  # this cycle's rows (a fresh array: last cycle's views stay valid)
                self._routes = np.zeros((self.max_pool, *routes.shape[1:]), dtype=bool)
            self._routes[nodes] = routes
            self._routed += len(nodes)

    def routes(self) -> tuple[np.ndarray, np.ndarray]:
        """Host bool routes of the pool nodes [N, L, E] and of the root [L, E], from the route head (every node of
        the drafted levels; the root's come with level 1)."""
        root, n = self._root_routes, len(self.tree)
        if root is None or self._routed != n:
            raise RuntimeError(f"routes of {self._routed} of {n} pool nodes came back: set route_head before drafting")
        return (self._routes[:n] if n else np.zeros((0, *root.shape), dtype=bool)), root

    @torch.no_grad()
    def states(self, nodes) -> torch.Tensor:
        """[n, H] drafter states of pool nodes (processing, in one forward, those not yet processed)."""
        todo = [v for v in nodes if v not in self._out]
        if todo:
            self._forward(todo, self._token_ids(todo))
        return torch.stack([self._out[v][1] for v in nodes]) if nodes else self.root_state.new_zeros(0, 0)

    def _process(self, nodes: list[int], ids: torch.Tensor | None = None, root=None) -> list[np.ndarray]:
        """One drafter forward over ``nodes`` (tokens from ``ids`` [n] on the device, else from the tree), then one
        transfer to the host of: the root's top-k (``root``: its (q, ids) [1, k] on the device, at level 1), the
        nodes' top-k children, and with a route head their routes (the root's first, at level 1). Records children
        and routes; returns the root's top-k on the host."""
        pull: list[torch.Tensor] = list(root) if root is not None else []
        root = root is not None
        states = []
        if nodes:
            logits, states = self._forward(nodes, ids if ids is not None else self._token_ids(nodes))
            pull += list(self._topk(logits))  # [n, k] each
        head_in = ([self.root_state[None]] if root else []) + ([states] if len(nodes) else [])
        if self.route_head is not None and head_in:
            pull.append(self.route_head(torch.cat(head_in)))  # [(1 +) n, L, E]
        host = to_host(*pull) if pull else []
        root_part = host[:2] if root else []
        rest = host[2:] if root else host
        if nodes:
            q, tokens = rest[0].tolist(), rest[1].tolist()
            for v, qs, ts in zip(nodes, q, tokens):
                self._children[v] = (qs, ts)
        if self.route_head is not None and head_in:
            routes = rest[-1]  # [(1 +) n, L, E] host
            self.keep_routes(nodes, routes[1:] if root else routes, routes[0] if root else None)
        return list(root_part)

    def _forward(self, todo: list[int], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward over nodes whose ancestors are all processed; ``ids`` [n] their tokens on the device.
        Returns (logits [n, Vd], states [n, H])."""
        tree = self.tree
        device = self.root_state.device
        base, n = len(self.cache), len(todo)
        for i, v in enumerate(todo):
            self._slot[v] = base + i
        ancestry, parents, depths, slot = self._ancestry, tree.parents, tree.depths, self._slot
        own = [base + i - self.stable for i in range(n)]  # tree-KV index of each node's own entry
        for v, k in zip(todo, own):  # ancestors are all processed: a node is drafted by processing its parent
            p = parents[v]
            if p >= 0:
                ancestry[k] = ancestry[slot[p] - self.stable]
            else:
                ancestry[k] = False
            ancestry[k, k] = True
        rows = ancestry[own, : base + n - self.stable].astype(np.int64)  # [n, tree part of the KV]
        positions = [self.stable + depths[v] - 1 for v in todo]
        rows_d, positions_d = self._stage().to_device(rows, positions)
        dtype = self.drafter.fc.weight.dtype
        mask = torch.full((n, base + n), torch.finfo(dtype).min, dtype=dtype, device=device)  # [n, base + n]
        mask[:, : self.stable] = 0
        mask[:, self.stable:].masked_fill_(rows_d.bool(), 0)
        hidden = torch.stack([self._drafted_by[v] for v in todo])[None]  # [1, n, H]
        logits, out = self.drafter(ids.view(1, n), hidden, positions_d.view(1, n), cache=self.cache,
                                   attention_mask=mask[None, None])
        for i, v in enumerate(todo):
            self._out[v] = (logits[0, i], out[0, i])
        return logits[0], out[0]

    def _token_ids(self, nodes: list[int]) -> torch.Tensor:
        return self._stage().to_device([self.tree.tokens[v] for v in nodes])

    def _topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, Vd] -> (draft probabilities [n, k], target token ids [n, k]) on the device."""
        q, draft_ids = torch.softmax(logits.float(), -1).topk(self.topk)
        return q, self.drafter.to_target_ids(draft_ids)

    def _add_children(self, frontier: list[int]) -> list[int]:
        """Add the top-k children of each expanded node, best path probability first, within the node budget;
        returns the new nodes."""
        tree = self.tree
        candidates = []
        for parent in frontier:
            qs, ts = self._children[parent]
            base = tree.path_probs[parent]
            # rank: the child's place in its parent's top-k (1 = the drafter's top choice)
            candidates += [(base * p, parent, t, rank, p) for rank, (p, t) in enumerate(zip(qs, ts), 1)]
        candidates.sort(key=lambda c: -c[0])
        added = []
        for path_prob, parent, token, rank, q in candidates[: self.max_pool - len(tree)]:
            v = tree.add(parent, token, path_prob, rank, q)
            self._drafted_by[v] = self._out[parent][1]
            added.append(v)
        return added

    def _stage(self) -> Staging:
        if self._staging is None or self._staging.device != self.root_state.device:
            self._staging = Staging(self.root_state.device)
        return self._staging
