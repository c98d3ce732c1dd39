"""Lossless sampling: tree speculative sampling reproduces the target's distribution.

Each test compares sampled frequencies with the EXACT target probabilities by a chi-square goodness-of-fit test at
significance 1e-3 (cells with expected count < 5 merged): a correct implementation fails a given seed with
probability 0.001 (the false-alarm rate). Seeds are fixed, so the outcome is reproducible.
"""

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe
from scipy.stats import chisquare

import specfit
from specfit.decoding.acceptance import walk

ALPHA = 1e-3


def goodness_of_fit(counts: dict, probs: dict, n: int) -> float:
    keys = sorted(probs, key=lambda k: -probs[k])
    observed, expected = [], []
    rest_obs = rest_exp = 0.0
    for k in keys:
        e = probs[k] * n
        if e >= 5:
            observed.append(counts.get(k, 0))
            expected.append(e)
        else:
            rest_obs += counts.get(k, 0)
            rest_exp += e
    assert sum(counts.values()) == n and set(counts) <= set(probs), "a sample outside the target's support"
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    expected = np.array(expected) * n / np.sum(expected)
    return chisquare(observed, expected).pvalue


def test_walk_reproduces_target_joint():
    """A hand-made verify tree over a 4-token vocabulary with known target distributions at every prefix."""
    V = 4
    rng = np.random.default_rng(0)
    dist = {(): rng.dirichlet(np.ones(V))}
    for a in range(V):
        dist[(a,)] = rng.dirichlet(np.ones(V))
        for b in range(V):
            dist[(a, b)] = rng.dirichlet(np.ones(V))
    # tree indices: 0 root; 1 -> token 0 and 2 -> token 1 (children of root); 3 -> token 2, 4 -> token 3 under 1;
    # 5 -> token 0 under 2
    parents = [-1, 0, 0, 1, 1, 2]
    tokens = [None, 0, 1, 2, 3, 0]
    prefix_of = {0: (), 1: (0,), 2: (1,), 3: (0, 2), 4: (0, 3), 5: (1, 0)}
    children = lambda t: [c for c, p in enumerate(parents) if p == t]
    scores_at = lambda t, acc: torch.tensor(np.log(dist[prefix_of[t]]), dtype=torch.float32)

    torch.manual_seed(0)
    gen = np.random.default_rng(1)
    n = 20000
    counts = {}
    for _ in range(n):
        out = walk(children, tokens, scores_at, do_sample=True)
        seq = tuple(out.tokens)
        while len(seq) < 3:  # finish with plain sampling, as the next cycle would
            seq += (int(gen.choice(V, p=dist[seq])),)
        key = seq[:3]
        counts[key] = counts.get(key, 0) + 1
    probs = {(a, b, c): dist[()][a] * dist[(a,)][b] * dist[(a, b)][c]
             for a in range(V) for b in range(V) for c in range(V)}
    assert goodness_of_fit(counts, probs, n) > ALPHA


def test_greedy_walk_is_argmax_path():
    parents, tokens = [-1, 0, 0, 1], [None, 5, 6, 7]
    logits = {0: torch.tensor([0.0] * 6 + [1.0, 0.0]), 2: torch.tensor([0.0] * 7 + [2.0]),
              1: torch.zeros(8), 3: torch.zeros(8)}
    out = walk(lambda t: [c for c, p in enumerate(parents) if p == t], tokens, lambda t, acc: logits[t], False)
    assert out.path == [2] and out.tokens == [6, 7]


@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_generate_sampling_matches_target(assistant):
    """First two sampled tokens with temperature 0.8 and top_k 4: the second comes out of the first tree walk."""
    prompt = torch.randint(2, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    reference = tiny_moe()

    def processed(ids):
        with torch.no_grad():
            logits = reference(ids).logits[0, -1] / 0.8
        keep = logits.topk(4).indices
        p = torch.zeros_like(logits)
        p[keep] = torch.softmax(logits[keep], -1)
        return p

    p1 = processed(prompt)
    probs = {}
    for a in p1.nonzero().flatten().tolist():
        p2 = processed(torch.cat([prompt, torch.tensor([[a]])], 1))
        for b in p2.nonzero().flatten().tolist():
            probs[(a, b)] = float(p1[a] * p2[b])
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=int(prompt[0, 0]), sharpen=30.0),
                   cost_model=specfit.CostModel((1.0,) * 8, 0.01), depth=2, pool_nodes=6,
                   guard=False)  # the tree walk every cycle (the guard may run plain ones)
    torch.manual_seed(123)
    n = 400
    counts, accepted = {}, 0
    for _ in range(n):
        out = model.generate(prompt, max_new_tokens=3, do_sample=True, temperature=0.8, top_k=4, top_p=1.0,
                             assistant=assistant)
        key = tuple(out[0, prompt.shape[1]:prompt.shape[1] + 2].tolist())
        counts[key] = counts.get(key, 0) + 1
        # the first cycle commits 2 tokens (the 2nd and 3rd) exactly when it accepted a draft node
        accepted += model.specfit.stats.last_generate.tokens_committed == 2 and \
            model.specfit.stats.last_generate.cycles == 1
    assert accepted > 50  # the draft was accepted often enough for the accept branch to matter
    assert goodness_of_fit(counts, probs, n) > ALPHA


def test_walk_greedy_equals_walk_on_raw_logits():
    """The fast greedy walk (argmax of every tree index at once) takes the same path as the general one."""
    from specfit.decoding.acceptance import walk_greedy

    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        n = int(torch.randint(1, 9, (), generator=gen))
        parents = [-1] + [int(torch.randint(0, t, (), generator=gen)) for t in range(1, n)]
        logits = torch.randn(n, 6, generator=gen)
        tokens = [0] + [int(torch.randint(0, 6, (), generator=gen)) for _ in range(1, n)]
        for t in range(1, n):  # make acceptance likely: often the child is its parent's argmax
            if torch.rand((), generator=gen) < 0.6:
                tokens[t] = int(logits[parents[t]].argmax())

        def children(t):
            return [c for c in range(n) if parents[c] == t]

        slow = walk(children, tokens, lambda t, acc: logits[t], do_sample=False)
        fast = walk_greedy(children, tokens, logits.argmax(-1).tolist(), lambda t: logits[t])
        assert (fast.tokens, fast.path) == (slow.tokens, slow.path)
        assert all(torch.equal(a, b) for a, b in zip(fast.scores, slow.scores))
