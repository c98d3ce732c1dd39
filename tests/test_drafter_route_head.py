"""Drafting with a route head (SpecFit's levels): every node is processed, each through the mask rows its ancestry
gives, and its routes come back in the row of its pool index."""

import torch

from specfit.drafting.drafter import DraftCache
from specfit.drafting.levels import TreeDrafter
from test_drafter import positions, tiny_drafter, ttt_batch

LAYERS, EXPERTS = 2, 8


PROJECTION = torch.randn(32, LAYERS * EXPERTS, generator=torch.Generator().manual_seed(0))  # [H, L*E]


def make_head(center: torch.Tensor):
    """states [n, H] -> bool routes [n, LAYERS, EXPERTS]: a fixed function of the state (signs of a projection of
    its difference from ``center``, so that nodes' routes differ)."""
    return lambda states: ((states - center) @ PROJECTION).reshape(-1, LAYERS, EXPERTS) > 0


def test_every_node_is_processed_on_its_own_path_and_routed_in_its_row():
    """Each node's routes equal the head on the state of the drafter run alone on the node's path as a chain (no
    tree mask); the root's on the context's last state. Kills the mutants: a node's mask row taken from another
    node's ancestry (its state then attends to the wrong entries), and routes written to the wrong pool rows."""
    drafter = tiny_drafter()
    aux, ids, _, _ = ttt_batch(seed=3, b=1, t=8)
    features, next_tokens = aux[:, :-1], ids[:, 1:]
    tree_drafter = TreeDrafter(drafter, topk=2, depth=4, max_pool=14)
    tree_drafter.extend(features, next_tokens)
    head = tree_drafter.route_head = make_head(tree_drafter.root_state + 0.01)
    for tree in tree_drafter.levels():
        pass
    node_routes, root_routes = tree_drafter.routes()
    assert len(tree) == 14 and node_routes.shape == (14, LAYERS, EXPERTS)
    m = next_tokens.shape[1]

    def state(tokens):
        with torch.no_grad():
            cache = DraftCache()
            _, hidden = drafter(next_tokens, features, positions(0, m), cache=cache)
            for j, token in enumerate(tokens):
                _, hidden = drafter(torch.tensor([[token]]), hidden[:, -1:], positions(m + j, 1), cache=cache)
        return hidden[0, -1]

    def path(v):
        return path(tree.parents[v]) + [v] if v >= 0 else []

    assert (root_routes == head(state([])[None])[0].numpy()).all()
    processed = tree_drafter.states(list(range(len(tree))))  # [N, H]: every node was processed while drafting
    for v in range(len(tree)):
        chain = state([tree.tokens[a] for a in path(v)])
        torch.testing.assert_close(processed[v], chain, rtol=1e-4, atol=1e-5)
        assert (node_routes[v] == head(chain[None])[0].numpy()).all(), f"node {v} (depth {tree.depths[v]})"
    assert len({node_routes[v].tobytes() for v in range(len(tree))}) > 4  # rows differ: a swap would show


def test_routes_before_drafting_is_refused():
    tree_drafter = TreeDrafter(tiny_drafter(), topk=2, depth=2, max_pool=6)
    try:
        tree_drafter.routes()
    except RuntimeError as e:
        assert "route_head" in str(e)
    else:
        raise AssertionError("routes() without a drafted pool must raise")
