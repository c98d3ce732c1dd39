"""Draft trees as plain data, and the attention layout that verifies one in a single forward.

A *pool* node ``v`` has a parent (``-1``: a child of the root), a token (a target vocabulary id), a path probability
(the product of draft probabilities from the root), a depth (1 for children of the root), a *rank* among its siblings
(1: the drafter's top choice at the parent, 2: its second, ...) and a *conditional draft probability* ``q`` (the
drafter's probability of the token at the parent: ``path_prob / parent's path_prob``). Parents come before children.
The *root* is the last committed token, not yet in the target's KV cache; it is always verified. A *verify tree* is
the root followed by a selected, ancestor-closed subset of the pool, in pool order: tree index 0 is the root, tree
index ``j + 1`` is ``nodes[j]``.
"""

from __future__ import annotations

import random

from dataclasses import dataclass, field

import numpy as np
import torch

from ..transfer import Staging


@dataclass
class DraftTree:
    parents: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    path_probs: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # 1 = the drafter's top choice among the siblings
    qs: list[float] = field(default_factory=list)  # conditional draft probability at the parent

    def __len__(self) -> int:
        return len(self.parents)

    def add(self, parent: int, token: int, path_prob: float, rank: int = 1, q: float | None = None) -> int:
        """Append a node; ``q`` defaults to ``path_prob / parent's path_prob`` (``path_prob`` for a root child)."""
        if parent >= len(self.parents):
            raise ValueError(f"parent {parent} must be an existing node (0..{len(self.parents) - 1}) or -1")
        if q is None:
            above = 1.0 if parent < 0 else self.path_probs[parent]
            q = path_prob / above if above > 0 else 0.0
        self.parents.append(parent)
        self.tokens.append(token)
        self.path_probs.append(path_prob)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.ranks.append(rank)
        self.qs.append(q)
        return len(self.parents) - 1

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def level(self, depth: int) -> list[int]:
        return [v for v, d in enumerate(self.depths) if d == depth]

    def is_ancestor_closed(self, nodes) -> bool:
        chosen = set(nodes)
        return all(self.parents[v] < 0 or self.parents[v] in chosen for v in chosen)


def ancestors_or_self(parents, v: int):
    """v, its parent, ..., the child of the root (parents[v] == -1 ends the walk)."""
    while v >= 0:
        yield v
        v = parents[v]


@dataclass(frozen=True)
class VerifyLayout:
    """The root + selected nodes as one forward: inputs, depth-based positions and the tree attention mask."""

    nodes: tuple[int, ...]  # pool indices of tree indices 1..n
    parents: tuple[int, ...]  # tree-index parent of each tree index (-1 for the root)
    tokens: torch.Tensor  # [1, n+1] root then selected tokens
    position_ids: torch.Tensor  # [1, n+1] base + depth
    mask: torch.Tensor | None  # [1, 1, n+1, kv_len] additive: 0 = attend, finfo.min = masked; None: the root alone
    # (a one-token step, causal as in plain decoding: the model builds its own mask)

    def children(self, t: int) -> list[int]:
        return [c for c, p in enumerate(self.parents) if p == t]


def verify_layout(tree: DraftTree, nodes, root_token: int, base: int, kv_len: int, dtype: torch.dtype,
                  staging: Staging) -> VerifyLayout:
    """``base``: committed positions already in the KV cache (the root goes to position ``base``). Tokens,
    positions and the tree's ancestor matrix reach the device in one transfer that does not stop the host."""
    nodes = tuple(sorted(nodes))
    if len(set(nodes)) != len(nodes) or any(not 0 <= v < len(tree) for v in nodes):
        raise ValueError(f"selected nodes must be distinct pool indices in 0..{len(tree) - 1}, got {nodes}")
    if not tree.is_ancestor_closed(nodes):
        raise ValueError(f"selected nodes {nodes} are not ancestor-closed in the pool")
    tree_index = {v: j + 1 for j, v in enumerate(nodes)}
    parents = (-1,) + tuple(0 if tree.parents[v] < 0 else tree_index[tree.parents[v]] for v in nodes)
    depths = [0] + [tree.depths[v] for v in nodes]
    tokens = [[root_token] + [tree.tokens[v] for v in nodes]]
    positions = [[base + d for d in depths]]
    if not nodes:
        tokens_d, positions_d = staging.to_device(tokens, positions)
        return VerifyLayout(nodes, parents, tokens_d, positions_d, None)
    tokens_d, positions_d, rows = staging.to_device(tokens, positions, ancestor_matrix(parents))
    mask = tree_mask(rows, base, kv_len, dtype)[None, None]
    return VerifyLayout(nodes, parents, tokens_d, positions_d, mask)


def ancestor_matrix(parents) -> np.ndarray:
    """[n, n] 1 where position j is an ancestor-or-self of position i (``parents``: each one's parent, -1 for a
    root), built in Python: n is small.

    >>> ancestor_matrix([-1, 0, 0, 1]).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    n = len(parents)
    rows = np.zeros((n, n), dtype=np.int64)
    for t in range(n):
        for a in ancestors_or_self(parents, t):
            rows[t, a] = 1
    return rows


def tree_mask(ancestors: torch.Tensor, base: int, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, kv_len] additive mask of ``n`` tree positions written at ``base``..: each attends to the ``base``
    committed positions and to its ancestors-or-self (``ancestors``: the [n, n] ``ancestor_matrix`` on the device):
    a few torch calls, whatever n."""
    n = ancestors.shape[0]
    mask = torch.full((n, kv_len), torch.finfo(dtype).min, dtype=dtype, device=ancestors.device)
    mask[:, :base] = 0
    mask[:, base:base + n].masked_fill_(ancestors.bool(), 0)
    return mask


def random_subtree(parents, size: int, rng: random.Random) -> tuple[int, ...]:
    """An ancestor-closed subset of ``size`` pool nodes, grown from the root by adding random frontier nodes."""
    children = [[] for _ in parents]
    frontier = []
    for v, p in enumerate(parents):
        (frontier if p < 0 else children[p]).append(v)
    chosen: list[int] = []
    while len(chosen) < size and frontier:
        v = frontier.pop(rng.randrange(len(frontier)))
        chosen.append(v)
        frontier += children[v]
    return tuple(sorted(chosen))
