"""The EAGLE-3 drafter module, its TTT loss and level-by-level tree drafting, on tiny random drafters (CPU, fp32)."""

import pytest
import torch
from torch import nn

from specfit.drafting.drafter import DraftCache, Eagle3Config, Eagle3Drafter
from specfit.training.ttt import _ttt_attention, draft_vocab_from_counts, ttt_loss, ttt_unroll

V, VD, H, HT = 96, 40, 32, 24  # target vocab, draft vocab, drafter hidden, target hidden (3*HT = 72 != H)


def tiny_config(**overrides) -> Eagle3Config:
    fields = dict(
        hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, vocab_size=V, draft_vocab_size=VD,
        target_hidden_size=HT, aux_layer_ids=(0, 1, 1),
    )
    return Eagle3Config(**{**fields, **overrides})


def tiny_drafter(seed=0, **overrides) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(tiny_config(**overrides))
    c = drafter.config
    # a real (non-identity) draft vocabulary: every other id, so d2t offsets are non-zero
    counts = {i: 1000 - i for i in range(0, c.vocab_size, 2)}
    d2t, t2d = draft_vocab_from_counts(counts, c.draft_vocab_size, c.vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    for p in drafter.parameters():  # norms away from 1 so that every weight matters
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    drafter.set_embedding(nn.Embedding(c.vocab_size, c.hidden_size))  # stands in for the target's
    return drafter.eval()


def positions(start, length, batch=1):
    return torch.arange(start, start + length).expand(batch, length)


# ------------------------------------------------------------------------------------------------ module


def test_cache_in_chunks_equals_one_causal_forward():
    drafter = tiny_drafter()
    torch.manual_seed(1)
    ids, feats = torch.randint(0, V, (2, 11)), torch.randn(2, 11, 3 * HT)
    with torch.no_grad():
        full_logits, full_hidden = drafter(ids, feats, positions(0, 11, 2))
        cache, outs = DraftCache(), []
        for a, b in [(0, 4), (4, 5), (5, 11)]:
            outs.append(drafter(ids[:, a:b], feats[:, a:b], positions(a, b - a, 2), cache=cache))
    assert len(cache) == 11 and cache.keys.shape == (2, 2, 11, 8)
    torch.testing.assert_close(torch.cat([o[0] for o in outs], 1), full_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], 1), full_hidden, rtol=1e-5, atol=1e-5)


def test_tree_mask_gives_each_node_its_path_logits():
    drafter = tiny_drafter()
    torch.manual_seed(2)
    p = 6  # context length
    ctx_ids, ctx_feats = torch.randint(0, V, (1, p)), torch.randn(1, p, 3 * HT)
    parents = [-1, -1, 0, 0, 2, 1, 4]  # two roots, depth up to 4
    n = len(parents)
    node_ids, node_hidden = torch.randint(0, V, (1, n)), torch.randn(1, n, H)

    def path(i):
        return path(parents[i]) + [i] if i >= 0 else []

    depth = torch.tensor([len(path(i)) - 1 for i in range(n)])
    mask = torch.full((1, 1, n, p + n), torch.finfo(torch.float32).min)
    mask[..., :p] = 0
    for i in range(n):
        mask[0, 0, i, [p + a for a in path(i)]] = 0
    with torch.no_grad():
        cache = DraftCache()
        drafter(ctx_ids, ctx_feats, positions(0, p), cache=cache)
        tree_logits, _ = drafter(node_ids, node_hidden, p + depth[None], cache=cache, attention_mask=mask)
        for i in range(n):
            alone = DraftCache()
            drafter(ctx_ids, ctx_feats, positions(0, p), cache=alone)
            nodes = path(i)
            logits, _ = drafter(node_ids[:, nodes], node_hidden[:, nodes], positions(p, len(nodes)), cache=alone)
            torch.testing.assert_close(tree_logits[0, i], logits[0, -1], rtol=1e-5, atol=1e-5)
    cache.crop(p)
    assert len(cache) == p


def test_fc_only_for_target_features():
    drafter = tiny_drafter()
    torch.manual_seed(3)
    ids, feats = torch.randint(0, V, (1, 5)), torch.randn(1, 5, 3 * HT)
    with torch.no_grad():
        from_features, _ = drafter(ids, feats, positions(0, 5))
        from_fused, _ = drafter(ids, drafter.fc(feats), positions(0, 5))  # H-wide input bypasses fc
    torch.testing.assert_close(from_features, from_fused)
    with pytest.raises(ValueError, match="width 7"):
        drafter(ids, torch.randn(1, 5, 7), positions(0, 5))


def test_shared_embedding_is_not_a_submodule():
    drafter = tiny_drafter()
    embedding = drafter._shared_embedding
    assert not any(k.startswith("embed") or "_shared" in k for k in drafter.state_dict())
    assert all(p is not embedding.weight for p in drafter.parameters())
    drafter.to(torch.float64)
    assert embedding.weight.dtype == torch.float32 and drafter.fc.weight.dtype == torch.float64
    with pytest.raises(ValueError, match=r"\(96, 16\).*hidden_size=32"):
        drafter.set_embedding(nn.Embedding(V, 16))
    bare = Eagle3Drafter(tiny_config())
    with pytest.raises(RuntimeError, match="set_embedding"):
        bare.embed(torch.zeros(1, 1, dtype=torch.long))


def test_to_target_ids_and_identity():
    drafter = tiny_drafter()
    draft_ids = torch.tensor([[0, 1, 39]])
    assert drafter.to_target_ids(draft_ids).tolist() == [[0, 2, 78]]
    full = Eagle3Drafter(tiny_config(draft_vocab_size=V))
    assert full.to_target_ids(torch.arange(V)).tolist() == list(range(V)) and bool(full.t2d.all())


def test_bf16_forward_keeps_dtype():
    drafter = tiny_drafter().to(torch.bfloat16)
    with torch.no_grad():
        logits, hidden = drafter(torch.randint(0, V, (1, 4)), torch.randn(1, 4, 3 * HT), positions(0, 4))
    assert logits.dtype == hidden.dtype == torch.bfloat16 and logits.shape == (1, 4, VD)


def test_config_dict_round_trip_and_unsupported_rope():
    c = tiny_config()
    assert Eagle3Config.from_dict(c.to_dict()) == c and c.to_dict()["aux_layer_ids"] == [0, 1, 1]
    flags = dict(norm_before_residual=True, lm_head_norm=False, normed_feedback=True)
    assert Eagle3Config.from_dict(tiny_config(**flags).to_dict()) == tiny_config(**flags)
    old = {k: v for k, v in c.to_dict().items() if k not in flags}  # written before the norm flags existed
    assert Eagle3Config.from_dict(old) == c
    assert Eagle3Config.default_aux_layer_ids(48) == (1, 23, 44)
    assert Eagle3Config.default_aux_layer_ids(4) == (0, 1, 1)  # (1, N//2-1, N-4), in layer order
    assert tiny_config(aux_layer_ids=(3, 1, 2)).aux_layer_ids == (1, 2, 3)  # features are fused in layer order
    with pytest.raises(NotImplementedError, match="yarn"):
        Eagle3Drafter(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


# ------------------------------------------------------------------------------------------------ TTT


def ttt_batch(seed=4, b=2, t=12):
    torch.manual_seed(seed)
    ids = torch.randint(0, V, (b, t))
    aux = torch.randn(b, t, 3 * HT)
    target_logits = torch.randn(b, t, V) * 3
    loss_mask = torch.ones(b, t, dtype=torch.long)
    loss_mask[0, :3] = 0  # a "prompt"
    loss_mask[-1, -2:] = 0  # right padding
    return aux, ids, target_logits, loss_mask


def test_ttt_one_step_is_plain_soft_cross_entropy():
    drafter = tiny_drafter()
    aux, ids, target_logits, loss_mask = ttt_batch()
    t = ids.shape[1]
    loss, metrics = ttt_loss(drafter, aux, ids, target_logits, loss_mask, steps=1)
    # independent: the inference forward over (feature of t_i, token t_{i+1}) predicting t_{i+2}
    with torch.no_grad():
        logits, _ = drafter(ids[:, 1:], aux[:, :-1], positions(0, t - 1, 2))
    logits = logits[:, : t - 2]  # position i predicts t_{i+2}
    target = target_logits[:, 1 : t - 1]  # the target's distribution of t_{i+2}
    p = torch.softmax(target[..., drafter.t2d], -1)
    ce = -(p * torch.log_softmax(logits, -1)).sum(-1)
    mask = loss_mask[:, 2:].bool() & drafter.t2d[target.argmax(-1)]
    expected = (ce * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    hits = (drafter.to_target_ids(logits.argmax(-1)) == target.argmax(-1)) & mask
    assert metrics["count"][0] == mask.sum() and torch.isclose(metrics["acc"][0], hits.sum() / mask.sum())


def brute_force_unroll(drafter, aux, ids, steps):
    """TTT with an explicit [T, T*(j+1)] mask over the keys of all steps, via scaled_dot_product_attention."""
    b, t = ids.shape
    keys, values, outs = [], [], []
    hidden = drafter.fc(aux)

    def attend(q, k, v):
        keys.append(k)
        values.append(v)
        j = len(keys) - 1
        allowed = [torch.ones(t, t, dtype=torch.bool).tril()] + [torch.eye(t, dtype=torch.bool)] * j
        n_rep = q.shape[1] // k.shape[1]
        kk = torch.cat(keys, 2).repeat_interleave(n_rep, 1)
        vv = torch.cat(values, 2).repeat_interleave(n_rep, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=torch.cat(allowed, 1))

    for j in range(steps):
        shifted = torch.cat([ids[:, 1 + j :], ids.new_zeros(b, 1 + j)], 1)
        hidden = drafter.midlayer(drafter.embed(shifted), hidden, positions(j, t, b), attend)
        outs.append(drafter.logits(hidden))
    return outs


def test_ttt_attention_equals_explicit_mask():
    drafter = tiny_drafter()
    aux, ids, _, _ = ttt_batch(t=7)
    with torch.no_grad():
        fast = [logits for logits, _ in ttt_unroll(drafter, aux, ids, steps=4)]
        slow = brute_force_unroll(drafter, aux, ids, steps=4)
    for j in range(4):
        torch.testing.assert_close(fast[j], slow[j], rtol=1e-5, atol=1e-5)
    # the pattern itself: step 2 query i sees step-0 keys <= i and the step-1/2 keys at i
    torch.manual_seed(5)
    q = torch.randn(1, 2, 5, 4)
    ks, vs = [torch.randn(1, 2, 5, 4) for _ in range(3)], [torch.randn(1, 2, 5, 4) for _ in range(3)]
    eye = torch.eye(5, dtype=torch.bool)
    mask = torch.cat([torch.ones(5, 5, dtype=torch.bool).tril(), eye, eye], 1)
    expected = torch.nn.functional.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask)
    torch.testing.assert_close(_ttt_attention(q, ks, vs), expected)


@pytest.mark.parametrize(
    "flags", [{}, {"normed_feedback": True}, {"norm_before_residual": True}, {"lm_head_norm": False}]
)
def test_ttt_step_matches_chain_drafting_with_cache(flags):
    """TTT step j at position i == drafting a chain of j+1 tokens from context position i at inference, for each norm
    variant (with ``normed_feedback`` both feed the normed state back)."""
    drafter = tiny_drafter(**flags)
    aux, ids, _, _ = ttt_batch(b=1, t=10)
    with torch.no_grad():
        ttt = [(logits, hidden) for logits, hidden in ttt_unroll(drafter, aux, ids, steps=3)]
        i = 5
        cache = DraftCache()
        logits, hidden = drafter(ids[:, 1 : i + 2], aux[:, : i + 1], positions(0, i + 1), cache=cache)
        torch.testing.assert_close(logits[:, -1], ttt[0][0][:, i], rtol=1e-5, atol=1e-5)
        for j in (1, 2):
            logits, hidden = drafter(ids[:, i + 1 + j, None], hidden[:, -1:], positions(i + j, 1), cache=cache)
            torch.testing.assert_close(logits[:, -1], ttt[j][0][:, i], rtol=1e-5, atol=1e-5)


def test_ttt_training_lowers_loss_and_freezes_embedding():
    drafter = tiny_drafter().train()
    embedding = drafter._shared_embedding
    aux, ids, target_logits, loss_mask = ttt_batch()
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    history = []
    for _ in range(8):
        loss, metrics = ttt_loss(drafter, aux, ids, target_logits, loss_mask, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    assert history[-1] < history[0] - 0.1
    assert embedding.weight.grad is None and metrics["loss"].shape == (3,)
    # gradients reach fc (used at step 0 only) through the unrolled steps
    drafter.zero_grad()
    steps = ttt_unroll(drafter, aux, ids, steps=2)
    next(steps)
    logits, _ = next(steps)
    logits.sum().backward()
    assert drafter.fc.weight.grad.abs().sum() > 0


def test_draft_vocab_from_counts_hand_worked():
    d2t, t2d = draft_vocab_from_counts({5: 10, 2: 7, 9: 7, 1: 1}, 3, 12)
    assert d2t.tolist() == [2, 4, 7] and t2d.nonzero().flatten().tolist() == [2, 5, 9]
    d2t, t2d = draft_vocab_from_counts({5: 10, 2: 7, 9: 7, 1: 1}, 2, 12)  # tie 2 vs 9 -> the lower id
    assert (torch.arange(2) + d2t).tolist() == [2, 5]
    d2t, t2d = draft_vocab_from_counts(torch.tensor([0, 0, 0, 4, 0, 9]), 4, 8)  # pad with the lowest unseen ids
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 3, 5] and int(t2d.sum()) == 4


# ------------------------------------------------------------------------------------------------ tree drafting


def drafted_pool(topk=2, depth=4, seed=6):
    """A pool drafted level by level by a tiny random drafter after 7 committed pairs, with room for every node
    (so every frontier node gets all its children); returns (TreeDrafter, DraftTree, (features, next_tokens))."""
    from specfit.drafting.levels import TreeDrafter

    drafter = tiny_drafter()
    aux, ids, _, _ = ttt_batch(seed=seed, b=1, t=8)
    context = aux[:, :-1], ids[:, 1:]  # (feature of t_i, t_{i+1}) pairs; t_7 is the root
    tree_drafter = TreeDrafter(drafter, topk=topk, depth=depth, max_pool=1000)
    tree_drafter.extend(*context)
    for tree in tree_drafter.levels():
        pass
    assert tree.depth == depth
    return tree_drafter, tree, context


def test_tree_drafting_expands_the_most_probable_frontier():
    """Each level after the first expands the top-k nodes of the level before, by path probability (EAGLE-2's
    frontier), each by its top-k children. Kills the mutant: levels.py's frontier sort reversed, so the drafter
    expands its *worst* nodes."""
    topk = 2
    _, tree, _ = drafted_pool(topk=topk, depth=4)
    for depth in range(2, tree.depth + 1):
        above = tree.level(depth - 1)
        best = sorted(above, key=lambda v: tree.path_probs[v], reverse=True)[:topk]
        assert len(above) > topk or depth == 2  # from level 3 on, the frontier is a real choice
        expanded = [tree.parents[v] for v in tree.level(depth)]
        assert sorted(set(expanded)) == sorted(best), f"level {depth - 1}"
        assert all(expanded.count(v) == topk for v in best)


def test_tree_path_probabilities_are_products_along_the_path():
    """A node's path probability is the product, along its path from the root, of the drafter's softmax
    probability of each token given the tokens before it, and a node's children are the top-k tokens of that
    softmax; checked against the drafter run alone on each path as a chain (no tree mask). Kills the mutants:
    a path probability not multiplied by its parent's, and one that multiplies the parent's by ``p * p``."""
    topk = 2
    tree_drafter, tree, (features, next_tokens) = drafted_pool(topk=topk, depth=4)
    drafter = tree_drafter.drafter
    draft_id = {int(d + drafter.d2t[d]): d for d in range(drafter.config.draft_vocab_size)}  # target id -> draft id
    m = next_tokens.shape[1]

    def path(v):
        return path(tree.parents[v]) + [v] if v >= 0 else []

    def chain(tokens):
        """The drafter's softmax [Vd] after the context and then ``tokens`` drafted one by one."""
        with torch.no_grad():
            cache = DraftCache()
            logits, hidden = drafter(next_tokens, features, positions(0, m), cache=cache)
            for j, token in enumerate(tokens):
                logits, hidden = drafter(torch.tensor([[token]]), hidden[:, -1:], positions(m + j, 1), cache=cache)
        return torch.softmax(logits[0, -1].float(), -1)

    assert len(tree) == topk + 3 * topk * topk
    for v in range(len(tree)):
        tokens = [tree.tokens[a] for a in path(v)]
        expected = 1.0
        for j, token in enumerate(tokens):
            expected *= chain(tokens[:j])[draft_id[token]].item()
        assert tree.path_probs[v] == pytest.approx(expected, rel=1e-4), f"node {v}, path {tokens}"
        children = [tree.tokens[c] for c in range(len(tree)) if tree.parents[c] == v]
        if children:
            top = drafter.to_target_ids(chain(tokens).topk(topk).indices).tolist()
            assert sorted(children) == sorted(top), f"children of node {v}"
    roots = [tree.tokens[c] for c in range(len(tree)) if tree.parents[c] < 0]
    assert sorted(roots) == sorted(drafter.to_target_ids(chain([]).topk(topk).indices).tolist())
