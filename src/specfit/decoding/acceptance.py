"""Which verified draft tokens the target accepts: the longest agreeing path, then the bonus token.

Vocabulary: *accepted* tokens are draft nodes on the path the target agrees with; the *bonus* token is the target's
own choice after the last accepted node (the next root). Greedy: follow the child whose token is the target's
argmax. Sampling (lossless tree speculative sampling with the draft treated as one-hot, as in EAGLE-2/3): at each
node, try the children in turn; child x is accepted with probability p(x), else p(x) is set to 0 and p renormalised;
when no child is left, the bonus token is sampled from what remains of p. The output distribution equals the
target's (SafeAILab/EAGLE#110 explains why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Acceptance:
    path: list[int] = field(default_factory=list)  # tree indices of the accepted nodes, root excluded
    tokens: list[int] = field(default_factory=list)  # accepted tokens, then the bonus token
    scores: list[torch.Tensor] = field(default_factory=list)  # [V] processed scores each token was chosen from


def walk(children: Callable[[int], list[int]], tokens: list[int], scores_at: Callable[[int, list[int]], torch.Tensor],
         do_sample: bool) -> Acceptance:
    """Walk the verify tree from the root (tree index 0).

    children(t): tree indices of t's children, in the order to try them (highest draft probability first).
    tokens[t]: the token of tree index t. scores_at(t, accepted_tokens): processed scores [V] at t, given the
    accepted tokens so far (logits processors see the prefix).
    """
    acc = Acceptance()
    t = 0
    while True:
        scores = scores_at(t, acc.tokens)
        kids = children(t)
        if not do_sample:
            choice = int(torch.argmax(scores))
            acc.tokens.append(choice)
            acc.scores.append(scores)
            nxt = next((c for c in kids if tokens[c] == choice), None)
            if nxt is None:
                return acc
            acc.path.append(nxt)
            t = nxt
            continue
        p = torch.softmax(scores, -1)
        nxt = None
        for c in kids:
            x = tokens[c]
            if torch.rand((), device=p.device) < p[x]:
                nxt = c
                break
            p[x] = 0.0
            p = p / p.sum()
        acc.scores.append(scores)
        if nxt is None:
            acc.tokens.append(int(torch.multinomial(p, 1)))
            return acc
        acc.tokens.append(tokens[nxt])
        acc.path.append(nxt)
        t = nxt


def walk_greedy(children: Callable[[int], list[int]], tokens: list[int], choices: list[int],
                scores_at: Callable[[int], torch.Tensor]) -> Acceptance:
    """Greedy walk when the scores are the raw logits (no logits processors): ``choices[t]`` is the argmax at every
    tree index, taken in one transfer for the whole tree, so the walk itself is plain Python. Same result as
    ``walk(..., do_sample=False)`` on the same logits."""
    acc = Acceptance()
    t = 0
    while True:
        choice = choices[t]
        acc.tokens.append(choice)
        acc.scores.append(scores_at(t))
        nxt = next((c for c in children(t) if tokens[c] == choice), None)
        if nxt is None:
            return acc
        acc.path.append(nxt)
        t = nxt



def child_labels(tree, layout, acc: Acceptance, choices: list[int] | None, sampling: bool):
    """Labels for the acceptance model: what the target did with each drafted child of a tree position it scored.

    Which positions: with ``choices`` (plain greedy: the target's argmax at every tree position, already on the host
    for ``walk_greedy``), the root and every verified node; otherwise the positions the walk scored, the root and the
    accepted nodes (logits processors run there only: they read the accepted prefix). Every *pool* child of such a
    position is labelled, verified or not, so the model also learns from children the selector left out.

    A label is the chance that the child is accepted once its parent is. Greedy: 1.0 when the child's token is the
    target's choice at the parent, else 0.0 (under processors the choice is the argmax of the processed scores, which
    is what the walk accepts). Sampling: the target's probability ``p(x)`` of the child's token, softmax of the
    processed scores. The walk treats the draft as one-hot: a child is tried only when its earlier siblings were
    rejected (probability ``1 - sum of their p``) and then accepted with ``p(x) / (1 - sum of their p)``, so its
    chance is ``p(x)`` whatever its place. (``min(1, p/q)`` is the rule for a draft *sampled* from ``q``, which this
    loop does not do.) The probabilities of every labelled child come to the host in one transfer per cycle.

    Args:
        tree: the pool (``DraftTree``); layout: its ``VerifyLayout``; acc: the walk's ``Acceptance``.
    Returns:
        (pool nodes, labels), parallel lists.
    """
    if choices is not None:
        scored, picks = range(len(layout.parents)), choices
    else:
        scored, picks = [0] + acc.path, acc.tokens
    kids: dict[int, list[int]] = {}
    for v, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(v)
    nodes, rows = [], []  # rows: the position in `scored` of each labelled node's parent
    for i, t in enumerate(scored):
        for c in kids.get(-1 if t == 0 else layout.nodes[t - 1], ()):
            nodes.append(c)
            rows.append(i)
    if not nodes:
        return [], []
    tokens = tree.tokens
    if not sampling:
        return nodes, [1.0 if tokens[c] == picks[i] else 0.0 for c, i in zip(nodes, rows)]
    scores = torch.stack(acc.scores[: len(scored)])  # [scored, V], processed scores at each scored position
    index = torch.tensor([rows, [tokens[c] for c in nodes]], device=scores.device)  # [2, labelled]
    probs = torch.softmax(scores.float(), -1)[index[0], index[1]]  # [labelled]
    return nodes, probs.tolist()
