"""The selection rule: which ancestor-closed subtree of the draft pool the target verifies.

Vocabulary (the paper's):

- *pool*: the draft tree the drafter expanded, as parallel arrays. Node ``v`` has a parent ``parents[v]`` (``-1`` for
  a child of the root token, which is the last committed token and is always verified) and a *path value*
  ``path_values[v]``, the probability that every token from the root down to ``v`` is accepted: the product of the
  acceptance model's estimates along the path (``acceptance_model.py``), or, with the paper's reward, the path
  probability (the product of draft probabilities).
- *routes*: the experts each token routes to, a bool array ``[num_nodes, num_layers, num_experts]``.
- *expert demand* of a subtree ``S``: ``sum over layers of |experts of the root and of S in that layer|``. A node pays
  only for experts that no other verified token already asks for.
- *misses* of ``S``: the experts of its demand that are not resident in the slot cache (``resident``, the live mask):
  what its verify forward copies or computes on the host lane (its cold experts).
- *ratio*: ``(1 + sum_{v in S} path_values[v]) / (intercepts[|S|] + beta * demand(S) + miss * misses(S))``, expected
  committed tokens (the root's bonus token included) over the predicted cycle time; ``miss`` prices one cold expert
  of the union once per cycle: its copy, its host time, or the cheaper of the two (``CostModel.miss``, as the
  engine's ``cold=`` computes it). The selector returns the subtree with the largest ratio. (The paper's model is
  ``miss = 0``.)

No torch here: the rule takes plain sequences and NumPy arrays, so it is testable in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["Selection", "select_subtree", "node_depths", "takes_from_level", "REL_TIE"]

# Ratios this close (relative) count as equal. Summing path probabilities in another order moves a ratio by a few
# ulps; without a tolerance the winner between two equal subtrees would depend on the enumeration order.
REL_TIE = 1e-12


@dataclass(frozen=True)
class Selection:
    """The winning subtree and the figures it was chosen on.

    Attributes:
        nodes: pool indices of the verified draft nodes, sorted; ``()`` verifies the root alone.
        expected_tokens: ``1 + sum of their path values`` (the root's token included).
        predicted_time: ``intercepts[len(nodes)] + beta * demand + copy * misses``, in the cost model's unit
            (seconds).
        ratio: ``expected_tokens / predicted_time``.
        demand: expert demand, ``sum over layers of |union of the experts of the root and the nodes|``.
        subtrees: how many ancestor-closed subtrees were scored (the empty one included); a work counter.
        misses: the experts of the demand not resident (what the verify forward would copy).
    """

    nodes: tuple[int, ...]
    expected_tokens: float
    predicted_time: float
    ratio: float
    demand: int
    subtrees: int = 0
    misses: int = 0


def select_subtree(parents, path_values, routes, root_routes, cost, max_nodes: int = 7, resident=None) -> Selection:
    """Return the ancestor-closed subtree of at most ``max_nodes`` pool nodes with the largest ratio.

    Args:
        parents: ``[N]`` ints, the parent's pool index or ``-1``; a parent comes before its children.
        path_values: ``[N]`` finite, non-negative floats (path values, or path probabilities for the paper's reward).
        routes: ``[N, num_layers, num_experts]`` bool (any 0/1 array-like; non-zero counts as routed).
        root_routes: ``[num_layers, num_experts]`` bool, the root token's experts (always paid).
        cost: a ``CostModel`` (anything with ``intercepts``, ``beta`` and optionally ``miss`` or ``copy``, the price
            of one cold expert); ``intercepts[n]`` is the fixed time of a cycle that verifies ``n`` draft nodes, so
            it needs ``max_nodes + 1`` entries.
        max_nodes: the verification budget (draft nodes, the root not counted).
        resident: ``[num_layers, num_experts]`` bool, the experts in a device slot now (None: none is); each expert
            of the demand outside it also costs ``cost.miss``.

    Returns:
        A ``Selection``. Ties: the larger ratio wins, where ratios within a relative ``REL_TIE`` (1e-12) of the best
        count as equal; among those, fewer nodes, then the lexicographically smaller ``nodes``. This makes the choice
        deterministic whatever order the float sums were taken in.

    The search is exact. It scores every ancestor-closed subtree of size ``<= max_nodes`` exactly once, growing them
    one node at a time (no recursion) and carrying the union of expert bitmaps as one Python int (all layers packed
    together, so a union is one ``|`` and the demand one ``bit_count()``). Cost: one big-int OR and popcount per
    subtree; an EAGLE-style top-2 pool of 18 nodes with ``max_nodes=7`` has about 250-320 of them. Before the walk,
    experts that only one node newly asks for become per-node counts (see ``_split_demand``), so the ints are short.

    Example: node 2 is free because its parent already asks for its expert, so it joins node 0.

    >>> from specfit.selection.cost_model import CostModel
    >>> import numpy as np
    >>> experts = [{0, 1}, {2, 3}, {1}]          # one layer, four experts; the root routes to {0}
    >>> routes = np.array([[[e in s for e in range(4)]] for s in experts])
    >>> root = np.array([[True, False, False, False]])
    >>> sel = select_subtree([-1, -1, 0], [0.6, 0.3, 0.4], routes, root, CostModel((1.0,) * 4, beta=0.5), max_nodes=3)
    >>> sel.nodes, sel.demand, round(sel.ratio, 6)
    ((0, 2), 2, 1.0)
    """
    parents, probs = _check_tree(parents, path_values)
    intercepts, beta, copy = _check_cost(cost, max_nodes)
    flat, full_bits, root_bits = _pack_routes(routes, root_routes, len(parents))
    missing = _missing_bits(resident, np.shape(root_routes)) if copy else 0
    shared_bits, own, root_demand, shared_missing, own_missing, root_missing = \
        _split_demand(parents, flat, full_bits, root_bits, missing)
    if min(intercepts) + beta * root_demand + copy * root_missing <= 0:
        raise ValueError("cost model predicts a zero cycle time (an intercept is 0 and the root's experts cost 0)")
    n = len(parents)
    budget = min(max_nodes, n)

    roots, children = [], [[] for _ in range(n)]
    for v, p in enumerate(parents):
        (roots if p < 0 else children[p]).append(v)
    children = [tuple(c) for c in children]
    onehot = [1 << v for v in range(n)]
    own_time = [beta * k + copy * m for k, m in zip(own, own_missing)]
    # the root's experts are paid at every size
    fixed_time = [a + beta * root_demand + copy * root_missing for a in intercepts]

    best = 1.0 / fixed_time[0]
    floor = best * (1.0 - REL_TIE)
    near = [(best, 0, 0)]  # (ratio, size, node mask) of each subtree that was near the best when scored
    keep = near.append
    subtrees = 1
    # Grow subtrees one node at a time. A subtree is (shared-expert union, time of its own experts, 1 + prob sum,
    # node mask, candidates); adding candidate i leaves candidates i+1.. plus i's children, so each ancestor-closed
    # set is generated exactly once.
    level = [(0, 0.0, 1.0, 0, tuple(roots))]
    for size in range(1, budget + 1):
        fixed = fixed_time[size]
        grown = []
        push = grown.append
        for union, paid, mass, mask, cands in level:
            subtrees += len(cands)
            base = fixed + paid
            if size == budget:  # the last size: score, grow nothing
                for v in cands:
                    u = union | shared_bits[v]
                    r = (mass + probs[v]) / (base + own_time[v] + beta * u.bit_count()
                                             + copy * (u & shared_missing).bit_count())
                    if r >= floor:
                        if r > best:
                            best, floor = r, r * (1.0 - REL_TIE)
                        keep((r, size, mask | onehot[v]))
                continue
            i = 0
            for v in cands:
                i += 1
                u = union | shared_bits[v]
                m = mass + probs[v]
                mk = mask | onehot[v]
                r = m / (base + own_time[v] + beta * u.bit_count() + copy * (u & shared_missing).bit_count())
                if r >= floor:
                    if r > best:
                        best, floor = r, r * (1.0 - REL_TIE)
                    keep((r, size, mk))
                rest = cands[i:] + children[v]
                if rest:
                    push((u, paid + own_time[v], m, mk, rest))
        level = grown

    _, nodes = min((s, _members(mk, n)) for r, s, mk in near if r >= floor)
    return _selection(nodes, probs, full_bits, root_bits, intercepts, beta, copy, missing, subtrees)


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each pool node: 1 for a child of the root, parent's depth + 1 otherwise.

    >>> node_depths([-1, -1, 0, 2])
    [1, 1, 2, 3]
    """
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def takes_from_level(selection: Selection, depths: Sequence[int], level: int) -> bool:
    """Whether the winning subtree takes a node at ``level``; the drafter stops when the newest level gives none.

    A deeper node can only be verified with its ancestor, which the search just rejected, so drafting on is wasted.

    >>> takes_from_level(Selection((0, 2), 2.0, 2.0, 1.0, 2), [1, 1, 2], 2)
    True
    """
    return any(depths[v] == level for v in selection.nodes)


def _members(mask: int, n: int) -> tuple[int, ...]:
    return tuple(v for v in range(n) if mask >> v & 1)


def _selection(nodes, probs, node_bits, root_bits, intercepts, beta, copy, missing, subtrees) -> Selection:
    # Recompute the winner's figures in sorted order, so they do not depend on the walk's summation order.
    union = root_bits
    for v in nodes:
        union |= node_bits[v]
    expected = 1.0 + math.fsum(probs[v] for v in nodes)
    demand, misses = union.bit_count(), (union & missing).bit_count()
    time = intercepts[len(nodes)] + beta * demand + copy * misses
    return Selection(nodes, expected, time, expected / time, demand, subtrees, misses)


def _check_tree(parents, path_values) -> tuple[list[int], list[float]]:
    parents = [int(p) for p in parents]
    probs = [float(x) for x in path_values]
    if len(probs) != len(parents):
        raise ValueError(f"path_values has {len(probs)} entries but parents has {len(parents)}")
    for v, p in enumerate(parents):
        if not -1 <= p < v:
            raise ValueError(f"parents[{v}] = {p}: a parent must come before its child (-1 <= parent < {v})")
    for v, x in enumerate(probs):
        if not (math.isfinite(x) and x >= 0.0):
            raise ValueError(f"path_values[{v}] = {x}: path values must be finite and >= 0")
    return parents, probs


def _check_cost(cost, max_nodes) -> tuple[list[float], float]:
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, (int, np.integer)) or max_nodes < 0:
        raise ValueError(f"max_nodes must be an int >= 0, got {max_nodes!r}")
    intercepts = [float(a) for a in cost.intercepts]
    if len(intercepts) <= max_nodes:
        raise ValueError(
            f"cost model has {len(intercepts)} intercepts (n = 0..{len(intercepts) - 1}) but max_nodes={max_nodes} "
            f"needs {max_nodes + 1} (n = 0..{max_nodes})"
        )
    copy = float(getattr(cost, "miss", getattr(cost, "copy", 0.0)))  # one price per cold expert
    if not (math.isfinite(copy) and copy >= 0.0):
        raise ValueError(f"cost model's price per cold expert must be finite and >= 0, got {copy!r}")
    return intercepts[: max_nodes + 1], float(cost.beta), copy


def _pack_routes(routes, root_routes, n: int):
    """Check shapes; return the routes as bool ``[N, layers * experts]`` and as one int per node and for the root.

    Bit ``layer * num_experts + expert`` of a node's int is set when the node routes to that expert in that layer.
    """
    root = np.asarray(root_routes)
    routes = np.asarray(routes)
    if root.ndim != 2:
        raise ValueError(f"root_routes must be [num_layers, num_experts], got shape {root.shape}")
    if routes.shape != (n, *root.shape):
        raise ValueError(
            f"routes has shape {routes.shape}, expected {(n, *root.shape)} "
            "([num_nodes, num_layers, num_experts] matching parents and root_routes)"
        )
    root_bits = _to_int(np.packbits(root.astype(bool, copy=False), axis=None, bitorder="little"))
    flat = routes.astype(bool, copy=False).reshape(n, root.size)  # [N, layers * experts]
    return flat, _rows_to_ints(np.packbits(flat, axis=1, bitorder="little")), root_bits


def _split_demand(parents, flat, bits, root_bits, missing: int = 0):
    """Shrink the bitmaps the walk ORs, without changing any subtree's demand or misses.

    Verified sets are ancestor-closed, so an expert that the root or an ancestor of ``v`` asks for is already paid
    when ``v`` joins: only ``v``'s *new* experts matter. A new expert of ``v`` that no other node newly asks for costs
    exactly 1 when ``v`` is in the set: it becomes a count, ``own[v]`` (``own_missing[v]`` of them not resident).
    Only experts that two or more nodes newly ask for (siblings and cousins sharing) stay as bits, gathered into
    short ints (a few hundred bits instead of layers * experts). Those ints keep all of ``v``'s routes in the shared
    columns, not only its new ones: the extra bits belong to an ancestor, which is in any set ``v`` is in, so no
    union changes. For an ancestor-closed ``S``: ``demand(S) = root_demand + sum(own[v] for v in S) +
    popcount(OR of shared_bits[v] for v in S)``, and ``misses(S)`` the same with the ``missing`` parts
    (``shared_missing`` masks the shared columns that are not resident).

    Returns:
        (shared_bits per node, own per node, root_demand, shared_missing, own_missing per node, root_missing)
    """
    n = len(parents)
    closed, new = [0] * n, [0] * n  # closed[v]: experts of the root, v's ancestors and v
    seen = shared = 0
    for v, p in enumerate(parents):
        above = root_bits if p < 0 else closed[p]
        closed[v] = above | bits[v]
        x = new[v] = closed[v] ^ above
        shared |= seen & x
        seen |= x
    own = [x.bit_count() - (x & shared).bit_count() for x in new]
    own_missing = [(x & missing).bit_count() - (x & shared & missing).bit_count() for x in new]
    width = flat.shape[1]
    columns = _unpack(shared, width)  # [layers * experts], True where two or more nodes newly ask for the expert
    shared_bits = _rows_to_ints(np.packbits(flat.compress(columns, axis=1), axis=1, bitorder="little"))
    shared_missing = _to_int(np.packbits(_unpack(missing, width)[columns], bitorder="little")) if missing else 0
    return shared_bits, own, root_bits.bit_count(), shared_missing, own_missing, (root_bits & missing).bit_count()


def _unpack(bits: int, width: int) -> np.ndarray:
    """bool ``[width]`` of an int's low ``width`` bits (bit i at index i)."""
    return np.unpackbits(np.frombuffer(bits.to_bytes(-(-width // 8), "little"), np.uint8), count=width,
                         bitorder="little").view(bool)


def _missing_bits(resident, shape) -> int:
    """The experts *not* in a slot, packed as the routes are (bit ``layer * num_experts + expert``)."""
    if resident is None:
        return (1 << int(np.prod(shape))) - 1
    resident = np.asarray(resident, dtype=bool)
    if resident.shape != tuple(shape):
        raise ValueError(f"resident has shape {resident.shape}, expected {tuple(shape)} ([num_layers, num_experts] "
                         f"like root_routes)")
    return _to_int(np.packbits(~resident, axis=None, bitorder="little"))


def _rows_to_ints(packed) -> list[int]:
    # One bytes object, sliced per row: much cheaper than iterating over NumPy row views.
    width, buf = packed.shape[1], packed.tobytes()
    return [int.from_bytes(buf[i * width : (i + 1) * width], "little") for i in range(packed.shape[0])]


def _to_int(packed) -> int:
    return int.from_bytes(packed.tobytes(), "little")
