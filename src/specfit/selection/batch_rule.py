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

import itertools
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


def _bits(mask: np.ndarray) -> int:
    """A bool array as one Python int (bit i: flat index i)."""
    return int.from_bytes(np.packbits(mask.reshape(-1), bitorder="little").tobytes(), "little")


def subtrees(parents: Sequence[int], max_nodes: int) -> list[tuple[int, ...]]:
    """Every ancestor-closed subset of the pool with at most ``max_nodes`` nodes, the empty one first; each once
    (a node joins only after every earlier choice in its frontier, so no set is built twice).

    >>> subtrees([-1, -1, 0], 2)
    [(), (0,), (0, 1), (0, 2), (1,)]
    """
    children: dict[int, list[int]] = {}
    for v, p in enumerate(parents):
        children.setdefault(p, []).append(v)
    out: list[tuple[int, ...]] = [()]

    def grow(chosen: tuple[int, ...], frontier: list[int]) -> None:
        if len(chosen) >= max_nodes:
            return
        for i, v in enumerate(frontier):
            nxt = tuple(sorted(chosen + (v,)))
            out.append(nxt)
            grow(nxt, frontier[i + 1:] + children.get(v, []))

    grow((), list(children.get(-1, [])))
    return out


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
    options: list[tuple[tuple[int, ...], float, int]]  # (nodes, 1 + sum values, union bits of root + nodes)


def _row(pool: RowPool) -> _Row:
    node_bits = [_bits(r) for r in np.asarray(pool.routes, dtype=bool)]
    root = _bits(np.asarray(pool.root_routes, dtype=bool))
    options = []
    for nodes in subtrees(pool.parents, pool.max_nodes):
        bits = root
        for v in nodes:
            bits |= node_bits[v]
        options.append((nodes, 1.0 + sum(pool.values[v] for v in nodes), bits))
    return _Row(options)


def select_batch(rows: Sequence[RowPool], intercepts: Sequence[float], beta: float, miss: float = 0.0,
                 resident: np.ndarray | None = None, exact_limit: int = 20000, max_rounds: int = 8) -> BatchSelection:
    """The batch's subtrees maximising the batch ratio (module docstring)."""
    if not rows:
        raise ValueError("select_batch needs at least one row")
    cold_mask = _bits(~np.asarray(resident, dtype=bool)) if resident is not None else 0
    tables = [_row(r) for r in rows]
    count = len(rows)

    def price(picks) -> tuple[float, float, int, int]:
        union, expected, nodes = 0, 0.0, 0
        for (chosen, value, bits) in picks:
            union |= bits
            expected += value
            nodes += len(chosen)
        demand, misses = union.bit_count(), (union & cold_mask).bit_count()
        seconds = fixed_time(intercepts, count + nodes) + beta * demand + miss * misses
        return expected / seconds, seconds, demand, misses

    def result(picks, exact, rounds) -> BatchSelection:
        ratio, seconds, demand, misses = price(picks)
        return BatchSelection(tuple(p[0] for p in picks), sum(p[1] for p in picks), seconds, ratio, demand, misses,
                              exact, rounds)

    total = 1
    for t in tables:
        total *= len(t.options)
    if total <= exact_limit:
        best = max(itertools.product(*(t.options for t in tables)), key=lambda picks: price(picks)[0])
        return result(best, True, 0)
    # start: each row's own best as if alone in the batch
    picks = [max(t.options, key=lambda o: price([o])[0]) for t in tables]
    rounds = 0
    for rounds in range(1, max_rounds + 1):
        changed = False
        for b, t in enumerate(tables):
            current = price(picks)[0]
            others = picks[:b] + picks[b + 1:]
            union, expected, nodes = 0, 0.0, 0  # the others' part, fixed while row b searches
            for chosen, value, bits in others:
                union, expected, nodes = union | bits, expected + value, nodes + len(chosen)

            def ratio(option):
                u = union | option[2]
                seconds = fixed_time(intercepts, count + nodes + len(option[0])) + beta * u.bit_count() + \
                    miss * (u & cold_mask).bit_count()
                return (expected + option[1]) / seconds

            choice = max(t.options, key=ratio)
            if price(others + [choice])[0] > current * (1 + 1e-12):
                picks = others[:b] + [choice] + others[b:]
                changed = True
        if not changed:
            break
    return result(picks, False, rounds)


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
