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

