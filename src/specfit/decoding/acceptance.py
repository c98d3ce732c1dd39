"""Which verified draft tokens the target accepts: the longest agreeing path, then the bonus token.

Vocabulary: *accepted* tokens are draft nodes on the path the target agrees with; the *bonus* token is the target's
own choice after the last accepted node (the next root). Greedy: follow the child whose token is the target's
argmax. Sampling (lossless tree speculative sampling with the draft treated as one-hot): at each node the target's
token is sampled by the Gumbel-max trick, ``argmax(scores + g)`` with the Gumbel noise ``g`` of that node's sequence
position (``position_noise.py``), and the walk follows the child holding that token; when none does, it is the bonus
token. Every committed token is then an exact sample of the target given the tokens before it, so the output
distribution equals the target's, and the token at a position depends on the seed and the position only, not on the
tree: seeded sampling repeats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .position_noise import PositionNoise, draw_seed


@dataclass
class Acceptance:
    path: list[int] = field(default_factory=list)  # tree indices of the accepted nodes, root excluded
    tokens: list[int] = field(default_factory=list)  # accepted tokens, then the bonus token
    scores: list[torch.Tensor] = field(default_factory=list)  # [V] processed scores each token was chosen from


def walk(children: Callable[[int], list[int]], tokens: list[int], scores_at: Callable[[int, list[int]], torch.Tensor],
         do_sample: bool, sample: Callable[[int, torch.Tensor], int] | None = None) -> Acceptance:
    """Walk the verify tree from the root (tree index 0).

    children(t): tree indices of t's children. tokens[t]: the token of tree index t. scores_at(t, accepted_tokens):
    processed scores [V] at t, given the accepted tokens so far (logits processors see the prefix).
    sample(i, scores): the token sampled from ``scores`` as the walk's i-th token (sampling only; the loop passes
    ``PositionNoise.sample`` at the sequence position of that token). Without it, noise keyed by a seed drawn now from
    torch's global generator: an exact sample that repeats only under the same global seed.
    """
    if do_sample and sample is None:
        noise = PositionNoise(draw_seed())
        sample = noise.sample
    acc = Acceptance()
    t = 0
    while True:
        scores = scores_at(t, acc.tokens)
        choice = sample(len(acc.tokens), scores) if do_sample else int(torch.argmax(scores))
        acc.tokens.append(choice)
        acc.scores.append(scores)
        nxt = next((c for c in children(t) if tokens[c] == choice), None)
        if nxt is None:
            return acc
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
    processed scores. The walk treats the draft as one-hot: it accepts the child holding the token the target samples
    there (``argmax(scores + g)``, Gumbel-max), which is ``x`` with probability ``p(x)`` whatever the siblings.
    (``min(1, p/q)`` is the rule for a draft *sampled* from ``q``, which this loop does not do.) The probabilities of
    every labelled child come to the host in one transfer per cycle.

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
