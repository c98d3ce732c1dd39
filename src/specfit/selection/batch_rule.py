"""The batch rule: every row's subtree chosen so that the *batch* commits the most tokens per second.

A batch's verify forward runs every row's root + subtree at once; its experts are the union ``U`` over rows, layer by
layer, of the experts of each row's root and subtree. With ``S_b`` the subtree of row b (ancestor-closed in its pool,
at most ``max_nodes`` nodes), the batch's ratio is

    sum_b (1 + sum_{v in S_b} value_v) / (a(B + sum_b |S_b|) + beta * demand(U) + miss * cold(U))

where ``a(t)`` is the fixed time of a forward over ``t`` tokens (the profile's intercepts, ``a(1 + n)`` for one row's
root + n nodes; beyond the table, the table's last step repeated per token: a stated extrapolation until calibrate
probes batches), ``demand(U)`` counts the union's experts over layers and ``cold(U)`` those not resident.

The search: exact (every combination of every row's ancestor-closed subtrees) when the product of the rows' counts
is at most ``exact_limit``; otherwise *coordinate ascent*: each row in turn takes its exact best subtree given the
others' union, node count and expected tokens, repeated until no row changes (a fixed point; at most
``max_rounds``). It starts from every row's own best alone. ``gap_to_exact`` measures what the fixed point gives up
on recorded pools. No torch here: plain sequences and NumPy bool arrays.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["RowPool", "BatchSelection", "subtrees", "fixed_time", "select_batch", "price_batch", "gap_to_exact"]


@dataclass(frozen=True)
class RowPool:
    parents: Sequence[int]  # parent of each pool node (-1: a child of the root)
    values: Sequence[float]  # path value of each node (expected acceptance of the path down to it)
    routes: np.ndarray  # bool [N, L, E] experts of each node
    root_routes: np.ndarray  # bool [L, E] experts of the root
    max_nodes: int = 7


@dataclass(frozen=True)
class BatchSelection:
    nodes: tuple[tuple[int, ...], ...]  # each row's subtree (pool indices, sorted)
    expected_tokens: float  # summed over rows, each row's bonus token included
    predicted_time: float
    ratio: float
    demand: int  # experts of the union, summed over layers
    misses: int  # of them not resident
    exact: bool  # True: the exhaustive optimum; False: coordinate ascent's fixed point
    rounds: int = 0  # coordinate-ascent rounds run (0 when exact)


def subtrees(parents: Sequence[int], max_nodes: int) -> tuple[tuple[int, ...], ...]:
    """Every ancestor-closed subset of the pool with at most ``max_nodes`` nodes, the empty one first; each once
    (a node joins only after every earlier choice in its frontier, so no set is built twice), smaller ones first.
    Pools of one shape
    recur cycle after cycle (top-k expansions): the answer is kept per shape.

    >>> subtrees([-1, -1, 0], 2)
    ((), (0,), (1,), (0, 1), (0, 2))
    """
    return _subtrees(tuple(int(p) for p in parents), int(max_nodes))[0]


@functools.lru_cache(maxsize=4096)
def _subtrees(parents: tuple[int, ...], max_nodes: int):
    """(subtrees, each one's parent subtree index, the node it adds to it, its size), arrays but the first; grown
    size by size, so every subtree's parent comes at a smaller size."""
    children: dict[int, list[int]] = {}
    for v, p in enumerate(parents):
        children.setdefault(p, []).append(v)
    out: list[tuple[int, ...]] = [()]
    source, added = [0], [-1]
    level = [(0, (), list(children.get(-1, [])))]  # (index, subtree, candidates)
    for _ in range(max_nodes):
        grown = []
        for index, chosen, frontier in level:
            for i, v in enumerate(frontier):
                out.append(tuple(sorted(chosen + (v,))))
                source.append(index)
                added.append(v)
                grown.append((len(out) - 1, out[-1], frontier[i + 1:] + children.get(v, [])))
        level = grown
    sizes = np.array([len(c) for c in out])
    order = np.argsort(sizes, kind="stable")  # by size, then as grown
    rank = np.empty_like(order)
    rank[order] = np.arange(len(out))
    return (tuple(out[i] for i in order), rank[np.array(source)[order]], np.array(added)[order], sizes[order])


def fixed_time(intercepts: Sequence[float], tokens: int) -> float:
    """``a(tokens)``: the intercept of a forward over ``tokens`` tokens (``intercepts[k]``: 1 + k tokens); past the
    table, its last step per extra token.

    >>> fixed_time((1.0, 1.5, 1.75), 5)
    2.25
    """
    k = tokens - 1
    if k < len(intercepts):
        return float(intercepts[max(k, 0)])
    step = intercepts[-1] - intercepts[-2] if len(intercepts) > 1 else 0.0
    return float(intercepts[-1] + step * (k - len(intercepts) + 1))


@dataclass
class _Row:
    nodes: tuple[tuple[int, ...], ...]  # every option's subtree (pool indices)
    values: np.ndarray  # [O] 1 + the sum of its values
    sizes: np.ndarray  # [O] its node count
    words: np.ndarray  # [O, W] its union of root + nodes as uint64 words (bit: layer * experts + expert)


def _row(pool: RowPool, width: int) -> _Row:
    """Every option of a row, built size by size as arrays: an option's union is its parent option's with its added
    node's experts, its value likewise."""
    nodes, source, added, sizes = _subtrees(tuple(int(p) for p in pool.parents), int(pool.max_nodes))
    routes = np.asarray(pool.routes, dtype=bool)  # [N, L, E]
    node_words = _pack(routes.reshape(routes.shape[0], int(np.prod(routes.shape[1:]))), width)  # [N, W]
    node_values = np.asarray(pool.values, dtype=float)
    words = np.empty((len(nodes), width), np.uint64)
    values = np.empty(len(nodes))
    words[0] = _pack(np.asarray(pool.root_routes, dtype=bool).reshape(1, -1), width)[0]
    values[0] = 1.0
    for k in range(1, int(sizes[-1]) + 1 if len(sizes) else 1):
        at = np.flatnonzero(sizes == k)
        words[at] = words[source[at]] | node_words[added[at]]
        values[at] = values[source[at]] + node_values[added[at]]
    return _Row(nodes, values, sizes, words)


def _pack(bits: np.ndarray, width: int) -> np.ndarray:
    """[R, width] uint64 words of bool rows [R, n] (bit i of a row at bit i % 64 of word i // 64)."""
    packed = np.packbits(bits, axis=1, bitorder="little")  # [R, ceil(n / 8)]
    out = np.zeros((bits.shape[0], 8 * width), np.uint8)
    out[:, :packed.shape[1]] = packed
    return out.view("<u8").astype(np.uint64, copy=False)


def _popcount(words: np.ndarray) -> np.ndarray:
    """Set bits per row of ``words`` [..., W] uint64."""
    if hasattr(np, "bitwise_count"):  # NumPy >= 2
        return np.bitwise_count(words).sum(-1, dtype=np.int64)
    return _POP8[words.view(np.uint8)].sum(-1, dtype=np.int64)


_POP8 = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def select_batch(rows: Sequence[RowPool], intercepts: Sequence[float], beta: float, miss: float = 0.0,
                 resident: np.ndarray | None = None, exact_limit: int = 20000, max_rounds: int = 8) -> BatchSelection:
    """The batch's subtrees maximising the batch ratio (module docstring). Each row's options are scored together as
    NumPy arrays (its options' unions with the others' union, popcounts, ratios), so a search step costs a few array
    operations, not a Python loop over the options."""
    if not rows:
        raise ValueError("select_batch needs at least one row")
    shape = np.shape(rows[0].root_routes)
    width = -(-int(np.prod(shape)) // 64)
    cold_words = _pack(~np.asarray(resident, dtype=bool).reshape(1, -1), width)[0] if resident is not None \
        else np.zeros(width, np.uint64)  # [W] the experts not resident
    tables = [_row(r, width) for r in rows]
    count = len(rows)
    most = count + sum(int(t.sizes.max()) for t in tables)
    fixed = np.array([0.0] + [fixed_time(intercepts, tokens) for tokens in range(1, most + 1)])  # [tokens + 1]

    def ratios(t: _Row, union: np.ndarray, expected: float, nodes: int) -> np.ndarray:
        """[O] the batch ratio with each of row t's options beside the others' ``union`` [W], expected tokens and
        node count."""
        u = t.words | union  # [O, W]
        seconds = fixed[count + nodes + t.sizes] + beta * _popcount(u) + miss * _popcount(u & cold_words)
        return (expected + t.values) / seconds

    def result(choice: list[int], exact: bool, rounds: int) -> BatchSelection:
        union, _, nodes = others(choice, -1)
        expected = math.fsum(float(t.values[i]) for t, i in zip(tables, choice))
        demand, misses = int(_popcount(union)), int(_popcount(union & cold_words))
        seconds = fixed_time(intercepts, count + nodes) + beta * demand + miss * misses
        return BatchSelection(tuple(t.nodes[i] for t, i in zip(tables, choice)), expected, seconds,
                              expected / seconds, demand, misses, exact, rounds)

    def others(choice: list[int], skip: int) -> tuple[np.ndarray, float, int]:
        union, expected, nodes = np.zeros(width, np.uint64), 0.0, 0
        for b, (t, i) in enumerate(zip(tables, choice)):
            if b != skip:
                union, expected, nodes = union | t.words[i], expected + float(t.values[i]), nodes + int(t.sizes[i])
        return union, expected, nodes

    total = 1
    for t in tables:
        total *= len(t.nodes)
    if total <= exact_limit:  # every combination: the last row's options as one array per combination of the others
        best, choice = -1.0, None
        last = tables[-1]
        for head in itertools.product(*(range(len(t.nodes)) for t in tables[:-1])):
            union, expected, nodes = others(list(head) + [0], count - 1)
            r = ratios(last, union, expected, nodes)
            i = int(np.argmax(r))
            if r[i] > best:
                best, choice = float(r[i]), list(head) + [i]
        return result(choice, True, 0)
    # start: each row's own best as if alone in the batch
    empty = np.zeros(width, np.uint64)
    choice = [int(np.argmax(ratios(t, empty, 0.0, 0))) for t in tables]
    rounds = 0
    for rounds in range(1, max_rounds + 1):
        changed = False
        for b, t in enumerate(tables):
            union, expected, nodes = others(choice, b)
            r = ratios(t, union, expected, nodes)
            i = int(np.argmax(r))
            if r[i] > r[choice[b]] * (1 + 1e-12):
                choice[b], changed = i, True
        if not changed:
            break
    return result(choice, False, rounds)


def price_batch(rows: Sequence[RowPool], picks: Sequence[Sequence[int]], intercepts: Sequence[float], beta: float,
                miss: float = 0.0, resident: np.ndarray | None = None) -> BatchSelection:
    """The figures of given subtrees (``picks[b]``: row b's pool indices), priced as ``select_batch`` prices them (the
    calibration's probes choose the subtrees themselves and need the same figures).

    >>> row = RowPool([-1], [0.5], np.ones((1, 1, 2), bool), np.array([[True, False]]), 1)
    >>> p = price_batch([row], [(0,)], (1.0, 1.5), beta=0.25)
    >>> p.expected_tokens, p.predicted_time, p.demand
    (1.5, 2.0, 2)
    """
    union, expected, nodes = np.zeros(np.shape(rows[0].root_routes), bool), 0.0, 0
    for row, chosen in zip(rows, picks):
        union |= np.asarray(row.root_routes, bool)
        for v in chosen:
            union |= np.asarray(row.routes[v], bool)
        expected += 1.0 + sum(row.values[v] for v in chosen)
        nodes += len(chosen)
    demand = int(union.sum())
    misses = int((union & ~np.asarray(resident, bool)).sum()) if resident is not None else 0
    seconds = fixed_time(intercepts, len(rows) + nodes) + beta * demand + miss * misses
    return BatchSelection(tuple(tuple(sorted(p)) for p in picks), expected, seconds, expected / seconds, demand,
                          misses, False, 0)


def gap_to_exact(rows: Sequence[RowPool], intercepts, beta, miss=0.0, resident=None) -> tuple[float, float]:
    """(fixed point's ratio, exact optimum's ratio) on one recorded batch: coordinate ascent forced, then the
    exhaustive search (may be slow: use on recorded pools offline)."""
    ascent = select_batch(rows, intercepts, beta, miss, resident, exact_limit=0)
    exact = select_batch(rows, intercepts, beta, miss, resident, exact_limit=10 ** 12)
    return ascent.ratio, exact.ratio
