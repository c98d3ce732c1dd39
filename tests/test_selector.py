"""The selection rule against a plain brute force, plus invariants, ties and bad inputs."""

import doctest
import itertools
import subprocess
import sys

import numpy as np
import pytest

import specfit.selection.selector
from specfit.selection.cost_model import CostModel
from specfit.selection.selector import REL_TIE, Selection, node_depths, select_subtree, takes_from_level


# ---- pools --------------------------------------------------------------------------------------------------------


def routes_from(rng, parents, layers, experts, top_k, keep=0.5):
    """Root and node routes; a node keeps each expert of its parent (or the root) with prob ``keep``."""
    root = np.zeros((layers, experts), bool)
    for layer in range(layers):
        root[layer, rng.choice(experts, top_k, replace=False)] = True
    routes = np.zeros((len(parents), layers, experts), bool)
    for v, p in enumerate(parents):
        above = root if p < 0 else routes[p]
        for layer in range(layers):
            kept = [e for e in np.flatnonzero(above[layer]) if rng.random() < keep]
            others = [e for e in rng.permutation(experts) if e not in kept]
            routes[v, layer, kept + others[: top_k - len(kept)]] = True
    return routes, root


def random_tree(rng, n):
    parents = [int(rng.integers(-1, v)) for v in range(n)]  # -1 .. v-1
    probs = rng.random(n) ** 2
    return parents, probs


def eagle_tree(rng, depth):
    """Top-2 EAGLE-style pool: 2 children of the root, then the 2 best nodes of each level get 2 children each."""
    parents, probs, frontier = [], [], [(-1, 1.0)]
    for _ in range(depth):
        level = []
        for parent, prob in frontier:
            for q in sorted(rng.dirichlet(np.full(4, 0.5)), reverse=True)[:2]:
                parents.append(parent)
                probs.append(prob * q)
                level.append((len(parents) - 1, probs[-1]))
        frontier = sorted(level, key=lambda node: -node[1])[:2]
    return parents, np.array(probs)


def random_cost(rng, max_nodes):
    intercepts = rng.uniform(0.5, 1.5, max_nodes + 1)
    if rng.random() < 0.5:
        intercepts = np.sort(intercepts)
    return CostModel(tuple(intercepts), beta=float(10 ** rng.uniform(-3, 0)))


# ---- the reference: every subset, filtered, scored plainly ---------------------------------------------------------


def brute_force(parents, probs, routes, root, cost, max_nodes):
    """(winner nodes, its ratio, its demand, number of ancestor-closed subsets within budget)."""
    scored = []
    for size in range(min(max_nodes, len(parents)) + 1):
        for nodes in itertools.combinations(range(len(parents)), size):
            if any(parents[v] != -1 and parents[v] not in nodes for v in nodes):
                continue
            union = root.copy()
            for v in nodes:
                union |= routes[v]
            demand = int(union.sum())
            ratio = (1 + sum(probs[v] for v in nodes)) / (cost.intercepts[size] + cost.beta * demand)
            scored.append((ratio, nodes, demand))
    top = max(r for r, _, _ in scored)
    near = [(len(nodes), nodes, r, d) for r, nodes, d in scored if r >= top * (1 - REL_TIE)]
    _, nodes, ratio, demand = min(near)
    return nodes, ratio, demand, len(scored)


def test_matches_brute_force_on_random_pools():
    rng = np.random.default_rng(1234)
    sizes = []
    for trial in range(150):
        if trial % 2:
            parents, probs = eagle_tree(rng, depth=int(rng.integers(1, 4)))  # 2, 6 or 10 nodes
        else:
            parents, probs = random_tree(rng, int(rng.integers(0, 13)))
        layers, experts, top_k = int(rng.integers(1, 4)), int(rng.integers(4, 12)), 2
        routes, root = routes_from(rng, parents, layers, experts, top_k)
        max_nodes = int(rng.integers(0, 8))
        cost = random_cost(rng, max_nodes)

        got = select_subtree(parents, probs, routes, root, cost, max_nodes=max_nodes)
        nodes, ratio, demand, count = brute_force(parents, probs, routes, root, cost, max_nodes)
        assert got.nodes == nodes, f"trial {trial}"
        assert got.ratio == pytest.approx(ratio, rel=1e-12)
        assert got.demand == demand
        assert got.subtrees == count  # each ancestor-closed subtree scored exactly once
        sizes.append(len(nodes))
    # The pools and costs must exercise the rule: empty, partial and large winners all occur.
    assert sizes.count(0) >= 10 and len(set(sizes)) >= 5


def brute_force_with_copies(parents, probs, routes, root, cost, max_nodes, resident):
    """(winner nodes, ratio, demand, misses): every ancestor-closed subset scored as
    ``(1 + sum p) / (a(n) + beta * demand + copy * |demand outside resident|)``."""
    scored = []
    for size in range(min(max_nodes, len(parents)) + 1):
        for nodes in itertools.combinations(range(len(parents)), size):
            if any(parents[v] != -1 and parents[v] not in nodes for v in nodes):
                continue
            union = root.copy()
            for v in nodes:
                union |= routes[v]
            demand, misses = int(union.sum()), int((union & ~resident).sum())
            time = cost.intercepts[size] + cost.beta * demand + cost.copy * misses
            scored.append(((1 + sum(probs[v] for v in nodes)) / time, nodes, demand, misses))
    top = max(s[0] for s in scored)
    _, nodes, ratio, demand, misses = min((len(n), n, r, d, m) for r, n, d, m in scored if r >= top * (1 - REL_TIE))
    return nodes, ratio, demand, misses


def test_matches_brute_force_when_copies_are_priced_by_residency():
    """Resident experts cost only their compute (beta), the others beta + copy: the walk's split of own and shared
    experts into resident and missing parts must give every subtree exactly its misses."""
    rng = np.random.default_rng(77)
    differs = 0
    for trial in range(120):
        parents, probs = eagle_tree(rng, depth=int(rng.integers(1, 4))) if trial % 2 else \
            random_tree(rng, int(rng.integers(0, 12)))
        layers, experts = int(rng.integers(1, 4)), int(rng.integers(4, 12))
        routes, root = routes_from(rng, parents, layers, experts, 2)
        resident = rng.random((layers, experts)) < rng.uniform(0, 1)
        max_nodes = int(rng.integers(0, 8))
        base = random_cost(rng, max_nodes)
        cost = CostModel(base.intercepts, beta=base.beta * rng.uniform(0, 0.3), copy=base.beta)

        got = select_subtree(parents, probs, routes, root, cost, max_nodes=max_nodes, resident=resident)
        nodes, ratio, demand, misses = brute_force_with_copies(parents, probs, routes, root, cost, max_nodes,
                                                               resident)
        assert (got.nodes, got.demand, got.misses) == (nodes, demand, misses), f"trial {trial}"
        assert got.ratio == pytest.approx(ratio, rel=1e-12)
        assert got.predicted_time == pytest.approx(cost.predict(len(nodes), demand, misses=misses), rel=1e-12)
        blind = select_subtree(parents, probs, routes, root, cost, max_nodes=max_nodes)  # nothing resident
        differs += blind.nodes != got.nodes
    assert differs >= 5  # residency changes the choice often enough for the test to mean something


def test_resident_experts_make_a_node_cheap():
    # one layer of 4 experts; the root asks for 0; node 0 for {1, 2} (resident), node 1 for {3} (not resident)
    routes = np.array([[[e in s for e in range(4)]] for s in ({1, 2}, {3})])
    root = np.array([[True, False, False, False]])
    resident = np.array([[True, True, True, False]])
    cost = CostModel((1.0,) * 3, beta=0.01, copy=1.0)
    sel = select_subtree([-1, -1], [0.5, 0.5], routes, root, cost, max_nodes=1, resident=resident)
    assert sel.nodes == (0,) and sel.misses == 0 and sel.demand == 3
    sel = select_subtree([-1, -1], [0.5, 0.5], routes, root, cost, max_nodes=1)  # nothing resident: same price
    assert sel.misses == sel.demand


def test_invariants_on_eagle_pools_of_18_nodes():
    rng = np.random.default_rng(7)
    for _ in range(30):
        parents, probs = eagle_tree(rng, depth=5)
        assert len(parents) == 18
        routes, root = routes_from(rng, parents, layers=6, experts=32, top_k=4)
        cost = random_cost(rng, 7)
        sel = select_subtree(parents, probs, routes, root, cost, max_nodes=7)

        assert list(sel.nodes) == sorted(set(sel.nodes)) and len(sel.nodes) <= 7
        assert all(parents[v] == -1 or parents[v] in sel.nodes for v in sel.nodes)  # ancestor-closed
        union = root | routes[list(sel.nodes)].any(axis=0) if sel.nodes else root
        assert sel.demand == union.sum()
        assert sel.expected_tokens == pytest.approx(1 + probs[list(sel.nodes)].sum())
        assert sel.predicted_time == pytest.approx(cost.intercepts[len(sel.nodes)] + cost.beta * sel.demand)
        assert sel.ratio == pytest.approx(sel.expected_tokens / sel.predicted_time)
        assert 247 <= sel.subtrees <= 400  # the work the docstring promises for this pool shape


def test_subtree_counts_on_literal_trees():
    flat = CostModel((1.0,) * 8, beta=0.0)
    chain = [-1, 0, 1, 2, 3]
    star = [-1, -1, -1, -1]

    def count(parents, max_nodes):
        routes = np.zeros((len(parents), 1, 2), bool)
        root = np.zeros((1, 2), bool)
        return select_subtree(parents, [0.5] * len(parents), routes, root, flat, max_nodes).subtrees

    assert count(chain, 3) == 4  # {}, {0}, {0,1}, {0,1,2}
    assert count(star, 2) == 1 + 4 + 6
    assert count(star, 7) == 2**4


# ---- worked cases --------------------------------------------------------------------------------------------------


def one_layer(sets, experts=4):
    return np.array([[[e in s for e in range(experts)]] for s in sets])


def test_a_free_node_rides_along_with_its_parent():
    # Node 2 asks only for expert 1, which its parent 0 already asks for; node 1 brings two new experts.
    routes, root = one_layer([{0, 1}, {2, 3}, {1}]), one_layer([{0}])[0]
    sel = select_subtree([-1, -1, 0], [0.6, 0.3, 0.4], routes, root, CostModel((1.0,) * 4, 0.5), max_nodes=3)
    assert sel == Selection((0, 2), 2.0, 2.0, 1.0, 2, sel.subtrees)


def test_empty_pool_verifies_the_root_alone():
    root = one_layer([{0, 3}])[0]
    cost = CostModel((0.8, 0.9), beta=0.1)
    sel = select_subtree([], [], np.zeros((0, 1, 4), bool), root, cost, max_nodes=1)
    assert sel.nodes == () and sel.demand == 2 and sel.subtrees == 1
    assert sel.ratio == pytest.approx(1 / (0.8 + 0.1 * 2))


def test_zero_probabilities_take_nothing_with_non_decreasing_intercepts():
    rng = np.random.default_rng(3)
    parents, _ = eagle_tree(rng, 3)
    routes, root = routes_from(rng, parents, 2, 8, 2)
    cost = CostModel((1.0, 1.0, 1.1, 1.2, 1.2, 1.3, 1.3, 1.4), beta=0.01)
    assert select_subtree(parents, [0.0] * len(parents), routes, root, cost).nodes == ()


def test_beta_zero_takes_the_most_expected_tokens_within_budget():
    rng = np.random.default_rng(5)
    for _ in range(10):
        parents, probs = random_tree(rng, 10)
        probs = probs + 0.01  # every node adds something, so a full budget beats a smaller set
        routes, root = routes_from(rng, parents, 2, 8, 2)
        sel = select_subtree(parents, probs, routes, root, CostModel((1.0,) * 5, beta=0.0), max_nodes=4)
        best_mass = max(
            sum(probs[v] for v in nodes)
            for nodes in itertools.combinations(range(10), 4)
            if all(parents[v] == -1 or parents[v] in nodes for v in nodes)
        )
        assert len(sel.nodes) == 4
        assert sel.expected_tokens == pytest.approx(1 + best_mass)


def test_huge_beta_takes_nothing_when_every_node_brings_new_experts():
    # With beta -> inf the rule compares expected tokens per expert: the root alone gives 1 token for 1 expert,
    # and each node adds at most 1 token for 3 new experts.
    routes = one_layer([{1, 2, 3}, {4, 5, 6}, {7, 8, 9}, {10, 11, 12}], experts=13)
    root = one_layer([{0}], experts=13)[0]
    sel = select_subtree([-1, 0, -1, 2], [0.9, 0.8, 0.5, 0.4], routes, root, CostModel((1.0,) * 5, beta=1e9), 4)
    assert sel.nodes == ()
    # The same pool with a node that brings nothing new: it costs no time, so even a huge beta takes it.
    routes[2] = root
    sel = select_subtree([-1, 0, -1, 2], [0.9, 0.8, 0.5, 0.4], routes, root, CostModel((1.0,) * 5, beta=1e9), 4)
    assert sel.nodes == (2,)


def test_max_nodes_zero_verifies_the_root_alone():
    routes, root = one_layer([{0}, {0}]), one_layer([{0}])[0]
    sel = select_subtree([-1, 0], [0.9, 0.9], routes, root, CostModel((1.0,), beta=0.1), max_nodes=0)
    assert sel.nodes == () and sel.subtrees == 1


def test_integer_routes_are_read_as_bool():
    rng = np.random.default_rng(11)
    parents, probs = eagle_tree(rng, 3)
    routes, root = routes_from(rng, parents, 3, 8, 2)
    cost = random_cost(rng, 7)
    assert select_subtree(parents, probs, routes.astype(np.int64), root.astype(np.uint8), cost) == select_subtree(
        parents, probs, routes, root, cost
    )


# ---- ties ----------------------------------------------------------------------------------------------------------


def test_identical_siblings_tie_to_the_smaller_index():
    routes, root = one_layer([{1}, {1}]), one_layer([{0}])[0]
    sel = select_subtree([-1, -1], [0.5, 0.5], routes, root, CostModel((1.0, 1.0, 5.0), 0.1), max_nodes=2)
    assert sel.nodes == (0,)


@pytest.mark.parametrize(
    "parents, probs, experts, winner",
    [
        # Mirror-image branches {0, 2} and {1, 3}.
        ([-1, -1, 0, 1], [0.5, 0.5, 0.3, 0.3], [{1}, {2}, {1}, {2}], (0, 2)),
        # {0, 3} and {0, 1} tie; a walk that extends {0} by the later root 3 before its child 1 meets {0, 3} first.
        ([-1, 0, 0, -1], [0.5, 0.3, 0.1, 0.3], [{1}, {1}, {2}, {0}], (0, 1)),
    ],
)
def test_ties_do_not_depend_on_the_walk_order(parents, probs, experts, winner):
    routes, root = one_layer(experts), one_layer([{0}])[0]
    cost = CostModel((1.0, 1.0, 1.0, 10.0, 10.0), beta=0.5)
    sel = select_subtree(parents, probs, routes, root, cost, max_nodes=4)
    assert sel.nodes == winner and sel.ratio == pytest.approx(0.9)


def test_equal_ratio_prefers_fewer_nodes():
    # Node 1 is free and has probability 0: taking it leaves the ratio exactly unchanged.
    routes, root = one_layer([{1}, {1}]), one_layer([{0}])[0]
    sel = select_subtree([-1, 0], [0.5, 0.0], routes, root, CostModel((1.0,) * 3, 0.1), max_nodes=2)
    assert sel.nodes == (0,)


@pytest.mark.parametrize("prob, taken", [(1e-14, False), (1e-9, True)])
def test_ratios_within_the_relative_tolerance_count_as_equal(prob, taken):
    routes, root = one_layer([{0}]), one_layer([{0}])[0]
    sel = select_subtree([-1], [prob], routes, root, CostModel((1.0, 1.0), 0.1), max_nodes=1)
    assert (sel.nodes == (0,)) is taken


# ---- the stop rule's helpers -------------------------------------------------------------------------------------


def test_depths_and_takes_from_level():
    depths = node_depths([-1, -1, 0, 0, 2])
    assert depths == [1, 1, 2, 2, 3]
    sel = Selection((0, 2), 1.5, 1.0, 1.5, 3)
    assert takes_from_level(sel, depths, 1) and takes_from_level(sel, depths, 2)
    assert not takes_from_level(sel, depths, 3)
    assert not takes_from_level(Selection((), 1.0, 1.0, 1.0, 1), depths, 1)


# ---- bad inputs ----------------------------------------------------------------------------------------------------


def good_inputs():
    return dict(
        parents=[-1, 0],
        path_values=[0.5, 0.25],
        routes=np.zeros((2, 3, 4), bool),
        root_routes=np.zeros((3, 4), bool),
        cost=CostModel((1.0,) * 8, 0.1),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(parents=[-1, 1]), r"parents\[1\] = 1"),
        (dict(parents=[-2, 0]), r"parents\[0\] = -2"),
        (dict(parents=[-1, 0, 0]), "path_values has 2 entries but parents has 3"),
        (dict(path_values=[0.5, float("nan")]), r"path_values\[1\] = nan"),
        (dict(path_values=[-0.1, 0.2]), r"path_values\[0\] = -0.1"),
        (dict(routes=np.zeros((2, 3, 5), bool)), r"routes has shape \(2, 3, 5\), expected \(2, 3, 4\)"),
        (dict(routes=np.zeros((3, 4), bool)), r"routes has shape \(3, 4\), expected \(2, 3, 4\)"),
        (dict(root_routes=np.zeros(4, bool)), r"root_routes must be \[num_layers, num_experts\], got shape \(4,\)"),
        (dict(cost=CostModel((1.0,) * 5, 0.1)), r"has 5 intercepts .* max_nodes=7 needs 8"),
        (dict(max_nodes=-1), "max_nodes must be an int >= 0, got -1"),
        (dict(cost=CostModel((0.0,) * 8, 0.0)), "zero cycle time"),
    ],
)
def test_bad_inputs_raise_helpful_errors(change, message):
    with pytest.raises(ValueError, match=message):
        select_subtree(**{**good_inputs(), **change})


# ---- the module itself -----------------------------------------------------------------------------------------


def test_docstring_examples_run():
    assert doctest.testmod(specfit.selection.selector).failed == 0


def test_rules_import_no_torch():
    code = "import sys, specfit.selection.selector, specfit.selection.cost_model; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
