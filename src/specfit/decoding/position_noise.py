"""Seeded sampling that repeats: Gumbel noise per sequence position, keyed by a seed drawn once per call.

The token sampled at absolute position ``i`` is ``argmax(scores_i + g_i)``, where ``scores_i`` are the processed
scores there (log-probabilities up to a constant: temperature, top-k, top-p applied) and ``g_i`` is standard Gumbel
noise generated from ``(seed, i)`` alone. That is an exact sample of ``softmax(scores_i)`` (the Gumbel-max trick),
and positions get independent noise, so a whole sequence is an exact sample of the target. Because ``g_i`` does not
depend on how the token was reached, the committed token at each position does not depend on the tree that proposed
it: the same seed gives the same text whatever the slot cache, the acceptance model or the backoff hold, and whatever
the assistant (``"eagle3"`` and ``"specfit"`` agree), up to near-ties of the perturbed scores under the verify
forward's rounding (as greedy decoding is, see ``evaluation/near_ties.py``).

Verifying a one-hot draft becomes: accept the child whose token is ``argmax(scores + g)``; if none, that token is the
bonus token. A child with token ``x`` is accepted with probability ``p(x)``, its acceptance model label.

The seed is one draw from torch's global CPU generator per ``generate()`` call (``torch.manual_seed`` before a call
fixes it); the noise itself comes from a generator of its own on the scores' device, so the text repeats on the same
device type (CPU and CUDA generators differ).
"""

from __future__ import annotations

import torch

from ..transfer import device_generator

_MASK = (1 << 64) - 1


def draw_seed() -> int:
    """One 63-bit seed from torch's global CPU generator (what ``torch.manual_seed`` sets)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def position_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for ``position`` under the call's ``seed`` (SplitMix64's finaliser over the pair, so
    neighbouring positions and seeds get unrelated streams).

    >>> position_seed(1, 5) == position_seed(1, 5), position_seed(1, 5) == position_seed(1, 6)
    (True, False)
    """
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class PositionNoise:
    """Gumbel noise per absolute position of one call: ``noise(i, scores)`` -> float64 [V] on ``scores``' device;
    ``sample(i, scores)`` -> the token sampled at position ``i`` (an int)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @classmethod
    def drawn(cls) -> "PositionNoise":
        """Noise keyed by a seed drawn now from torch's global generator (one draw per call)."""
        return cls(draw_seed())

    def noise(self, position: int, scores: torch.Tensor) -> torch.Tensor:
        """Standard Gumbel noise [V] (float64, V = scores' last dimension) for ``position``: -log(-log(u)), u uniform
        in (0, 1) with 53 random bits, so the noise's tail is not cut off where the argmax could notice."""
        device = scores.device
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = device_generator(device)
        generator.manual_seed(position_seed(self.seed, position))
        u = torch.rand(scores.shape[-1], generator=generator, device=device, dtype=torch.float64)
        return -torch.log(-torch.log(u.clamp_(min=torch.finfo(torch.float64).tiny)))

    def sample(self, position: int, scores: torch.Tensor) -> int:
        """argmax(scores + noise): a sample of softmax(scores) (scores [V]; -inf where a processor filtered)."""
        return int(torch.argmax(scores.double() + self.noise(position, scores)))
