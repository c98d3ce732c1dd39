"""Greedy decoding in bf16 and fp16 against plain ``generate()``: identical except at near-ties, measured.

In fp32 an assistant's greedy output equals plain greedy ``generate()`` token for token. In bf16 and fp16 a forward's
rounding depends on its shape: a position computed inside a multi-token verify forward (other rows in the same
matmuls, a tree mask, a KV cache written by earlier multi-token forwards) gets logits a few ulps away from the same
position computed one token at a time, as plain decoding computes it. Where plain's top two logits are closer than
that, the argmax can flip and the texts part. That is rounding, not a wrong result; a wrong expert, a wrong mask or
wrong KV moves logits by far more. To tell them apart every comparison is measured against a *noise unit* taken from
plain transformers alone (no SpecFit code):

- ``shape_noise``: the plain model's greedy continuation fed back through the plain model as small trees (a chain of
  its tokens with a sibling beside each node, the verify forward's shape: several positions per forward, an additive
  tree mask, a KV cache written by multi-token forwards), against the logits plain ``generate()`` computed one token
  at a time. Per position: the largest absolute logit difference over the vocabulary. The noise unit
  (``noise_unit``) is the largest of them over every measured position (prompts pooled), and at least one ulp of the
  largest logit.
- ``judge``: one assistant's greedy output against plain's. The prefill gives the first token, and SpecFit computes
  the prompt's forward as plain ``generate()`` does, so the first token must be identical. Up to and including the
  first divergence the prefixes are identical, so the assistant's logits at each of those positions
  (``output_logits``) are compared with plain's: the largest deviation, in noise units. At the first divergence,
  plain's logit gap between its own token and the assistant's token is the margin that flipped. Each logit moves by at
  most the deviation at that position, so a pair's gap moves by at most twice it: with deviations inside the noise
  unit, only gaps up to 2 units can flip. So ``k = 2`` (the default): a divergence is a *near-tie* when that gap is at
  most 2 noise units, and every compared position's deviation must be at most 2 units too (twice the largest plain
  transformers itself shows). Measured on the embedded model in bf16 (``python benchmarks/run.py quality
  near-ties``, BENCHMARKS.md): the assistants' deviations stay below 1 unit and their divergences sit at gaps below
  0.2 units, several of them exact ties in bf16; a wrong expert or a wrong tree mask on the tiny test model shows as
  deviations of 7 to several hundred units (``tests/test_near_ties.py`` injects both). Only the first divergence of
  a pair of texts is comparable: after it the prefixes differ.
- ``near_tie_rate``: the share of plain's positions whose top-1/top-2 gap is at most ``k`` noise units (how often a
  flip is possible at all).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..drafting.tree import ancestor_matrix, tree_mask

K = 2.0  # a divergence is a near-tie at plain's gap <= K noise units (see the module's docstring)


def new_tokens(out, prompt_len: int) -> list[int]:
    """The generated token ids of a ``generate(..., return_dict_in_generate=True)`` result (batch 1)."""
    return out.sequences[0, prompt_len:].tolist()


def step_logits(out) -> torch.Tensor:
    """[n, V] float32 logits of each generated token (``output_logits=True``)."""
    return torch.cat([row.float() for row in out.logits], dim=0)


@torch.no_grad()
def shape_noise(model, sequence: torch.Tensor, prompt_len: int, ar_logits: torch.Tensor,
                width: int = 4) -> list[float]:
    """Per generated position after the first: max |logit difference| between plain one-token decoding
    (``ar_logits`` [n, V], plain ``generate()``'s ``output_logits``) and the same positions computed inside tree
    forwards, on ``model``, a plain transformers model. ``sequence`` [1, prompt_len + n]: the prompt and plain's
    greedy tokens. Each tree: ``width`` of those tokens as a chain (the first one the root) and a sibling leaf beside
    every chain node below the root (``2 * width - 1`` positions, about a verify forward's root + 7 nodes), with
    depth-based positions and the additive tree mask a verify forward passes. The chain comes first, so the KV it
    keeps is the tree forward's own (the siblings' is cropped, as compaction drops rejected nodes). The first
    position comes from the prefill in both: left out."""
    from transformers import DynamicCache

    n, vocab = ar_logits.shape
    dtype = model.get_input_embeddings().weight.dtype
    device = sequence.device
    cache = DynamicCache(config=model.config)
    model(sequence[:, :prompt_len], cache=cache, use_cache=True, logits_to_keep=1)
    noise = []
    start = prompt_len  # input positions start..: their logits predict positions start+1..
    while start < prompt_len + n - 1:
        w = min(width, prompt_len + n - 1 - start)
        chain = sequence[0, start:start + w].tolist()
        parents = [-1] + list(range(w - 1)) + list(range(w - 1))  # the chain, then a sibling of nodes 1..w-1
        tokens = chain + [(t + 1) % vocab for t in chain[1:]]  # a sibling's token is not the chain's
        depths = list(range(w)) + list(range(1, w))
        mask = tree_mask(torch.as_tensor(ancestor_matrix(parents), device=device), start, start + len(parents),
                         dtype)[None, None]  # [1, 1, q, start + q]
        logits = model(torch.tensor([tokens], device=device), cache=cache,
                       position_ids=torch.tensor([[start + d for d in depths]], device=device), attention_mask=mask,
                       use_cache=True).logits[0, :w].float()  # [w, V]: the chain's rows
        if w > 1:
            cache.crop(-(w - 1))  # the siblings' KV
        want = ar_logits[start + 1 - prompt_len:start + 1 - prompt_len + w]  # [w, V]
        noise += (logits - want).abs().amax(-1).tolist()
        start += w
    return noise


def noise_unit(noise: list[float], ar_logits: torch.Tensor, dtype: torch.dtype) -> float:
    """The noise unit: the largest ``shape_noise`` value, and at least one ulp of plain's largest logit in the
    model's ``dtype`` (logits are rounded to it: a smaller difference cannot be told apart; short texts often show
    no shape noise at all)."""
    top = float(ar_logits.abs().max())
    ulp = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(torch.tensor(max(top, 1e-30)))).item()
    return max(max(noise, default=0.0), ulp)


def near_tie_rate(ar_logits: torch.Tensor, threshold: float) -> float:
    """Share of positions whose top-1/top-2 logit gap (``ar_logits`` [n, V]) is at most ``threshold``."""
    top = ar_logits.float().topk(2, dim=-1).values  # [n, 2]
    return float(((top[:, 0] - top[:, 1]) <= threshold).float().mean())


@dataclass
class Verdict:
    """One assistant's greedy output against plain's (see the module's docstring); logits in the model's units,
    ``*_units`` in noise units."""

    first_token_equal: bool
    compared: int  # positions compared: up to and including the first divergence, else all (identical prefixes)
    divergence: int | None  # index of the first differing generated token, None when identical
    gap: float | None  # plain's logit gap between its token and the assistant's, at the divergence
    gap_units: float | None
    max_deviation: float  # largest |logit difference| at the positions compared (identical prefixes)
    deviation_units: float
    near_tie: bool  # the output is explained by rounding: no divergence, or one at a near-tie
    ok: bool  # first token equal, deviations within k units, any divergence a near-tie

    def as_dict(self) -> dict:
        return asdict(self)


def judge(want: list[int], want_logits: torch.Tensor, got: list[int], got_logits: torch.Tensor, noise: float,
          k: float = K) -> Verdict:
    """``want``/``want_logits``: plain greedy ``generate()``'s tokens and logits [n, V]; ``got``/``got_logits``: the
    assistant's (``output_logits=True``); ``noise``: the noise unit (``shape_noise``'s largest value)."""
    if noise <= 0:
        raise ValueError(f"the noise unit must be positive, got {noise}: measure it with shape_noise (a model that "
                         f"rounds nothing, e.g. fp32 on a short text, may need a floor)")
    n = min(len(want), len(got))
    divergence = next((i for i in range(n) if want[i] != got[i]), None)
    if divergence is None and len(want) != len(got):
        divergence = n  # one stopped (eos) where the other went on
    same = n if divergence is None else divergence
    seen = min(n, same + 1)  # at the divergence the prefixes are still identical: its logits compare too
    deviation = float((got_logits[:seen].float() - want_logits[:seen].float()).abs().amax()) if seen else 0.0
    gap = None
    if divergence is not None and divergence < n:
        row = want_logits[divergence].float()
        gap = float(row[want[divergence]] - row[got[divergence]])
    elif divergence is not None:
        gap = float("inf")  # a length difference: not explained by a logit gap
    near = gap is None or gap <= k * noise
    return Verdict(first_token_equal=bool(want[:1] == got[:1]), compared=same + (divergence is not None),
                   divergence=divergence, gap=gap, gap_units=None if gap is None else gap / noise,
                   max_deviation=deviation, deviation_units=deviation / noise, near_tie=near,
                   ok=bool(want[:1] == got[:1]) and near and deviation <= k * noise)
