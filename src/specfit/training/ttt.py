"""Model-side pieces of EAGLE-3 training: the frequency-based draft vocabulary and the training-time-test (TTT) loss.

Shift conventions. One sequence holds tokens t_0..t_{T-1} (``input_ids[b]``); sequences are right-padded.

    aux_hidden[:, k]     the target's three captured layer outputs at token t_k (they have seen t_0..t_k)  [B, T, 3Ht]
    target_logits[:, k]  the target's logits at position k, i.e. its distribution of token t_{k+1}        [B, T, V]
    loss_mask[:, k]      1 where token t_k is to be learned (e.g. assistant tokens), 0 elsewhere/padding  [B, T]

Step j = 0..steps-1 at drafter position i:

    hidden     j = 0: fc(aux_hidden[:, i]);  j > 0: the state step j-1 fed back at position i (its pre-norm output,
               or that output's norm for a ``normed_feedback`` drafter)
    token      t_{i+1+j} (ground truth at every step, embedded with the frozen target embedding)
    position   position_ids[:, i] + j
    predicts   t_{i+2+j}; the target distribution is softmax(target_logits[:, i+1+j][t2d]) over the draft vocab
    mask       loss_mask[:, i+2+j] and argmax(target_logits[:, i+1+j]) in the draft vocab (t2d)
    attention  step-0 keys at positions <= i, plus the keys of steps 1..j at position i only

Positions with i+2+j >= T have nothing to predict and are left out. The attention is what a chain drafted from
context position i sees at inference: the context KV (step 0, causal) and its own ancestors (steps 1..j at i).
It is computed by appending each earlier step's diagonal score q_i.k_i to the causal scores before the softmax.

The attention and RoPE are the reference trainers' (EAGLE ``traineagle3``, SpecForge's EAGLE-3 model): both used to
hide the step-0 keys at positions i-j+1..i at step j, a shifted mask EAGLE removed in 2025-09 (SafeAILab/EAGLE
09b1628, after SafeAILab/EAGLE#247) and SpecForge after it (sgl-project/SpecForge#245, #244); step j now sees the
whole causal context plus its own ancestors, as at inference, at RoPE position i+j (their ``position_ids + lck``).

Differences from the reference trainers, on purpose:
* they weight position i at step j with the unshifted loss_mask[:, i+j]; here the mask of the predicted token;
* they average over all B*T positions; here each step's loss is the mean over its masked positions.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ..drafting.drafter import Eagle3Drafter, repeat_kv


def draft_vocab_from_counts(token_counts, draft_vocab_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Frequency-based draft vocabulary, as SpecForge's ``process_token_dict_to_mappings``.

    Keep the ``draft_vocab_size`` most frequent target ids, padded with the lowest unseen ids when fewer were seen,
    sorted. Ties go to the lower id (SpecForge's ``Counter.most_common`` keeps insertion order instead). Example: counts {5: 10, 2: 7, 9: 7, 1: 1}, Vd=3 -> used [2, 5, 9],
    d2t = [2, 4, 7], t2d marks 2, 5, 9.

    Args:
        token_counts: {token id: count} (e.g. a Counter over loss-masked tokens) or a [V] tensor / sequence of counts.
        draft_vocab_size: Vd.
        vocab_size: V, the target vocab.

    Returns:
        d2t int64 [Vd] offsets (target id = draft id + d2t[draft id]), t2d bool [V].
    """
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} exceeds vocab_size={vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    if isinstance(token_counts, Mapping):
        for token, n in token_counts.items():
            if not 0 <= int(token) < vocab_size:
                raise ValueError(f"token id {token} is outside [0, vocab_size={vocab_size})")
            counts[int(token)] = float(n)
    else:
        given = torch.as_tensor(token_counts, dtype=torch.float64).flatten()
        if given.numel() > vocab_size:
            raise ValueError(f"{given.numel()} counts for vocab_size={vocab_size}")
        counts[: given.numel()] = given
    # seen ids by count (a stable sort keeps ties in id order), then the unseen ids in id order
    seen = (counts > 0).nonzero().flatten()
    by_count = seen[torch.sort(counts[seen], descending=True, stable=True).indices]
    order = torch.cat([by_count, (counts <= 0).nonzero().flatten()])
    used = order[:draft_vocab_size].sort().values  # [Vd] target ids
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def _ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [B, nh, T, D] of step j; keys/values per step 0..j [B, nkv, T, D] -> [B, nh, T, D]."""
    t, d = q.shape[2], q.shape[3]
    n_rep = q.shape[1] // keys[0].shape[1]
    scale = d**-0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = (q @ repeat_kv(keys[0], n_rep).transpose(-1, -2)).float() * scale  # [B, nh, T, T]
    scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
    # steps 1..j: each query sees only the key of its own position
    diagonal = [(q * repeat_kv(k, n_rep)).sum(-1, keepdim=True).float() * scale for k in keys[1:]]  # [B, nh, T, 1]
    weights = torch.cat([scores, *diagonal], dim=-1).softmax(dim=-1).to(q.dtype)  # [B, nh, T, T + j]
    out = weights[..., :t] @ repeat_kv(values[0], n_rep)
    for s, v in enumerate(values[1:]):
        out = out + weights[..., t + s, None] * repeat_kv(v, n_rep)
    return out


def _shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T] -> [B, T] with x[:, i + n] at i, zero-filled on the right."""
    return torch.cat([x[:, n:], x.new_zeros(x.shape[0], min(n, x.shape[1]))], dim=1)


def ttt_unroll(
    drafter: Eagle3Drafter,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    steps: int = 7,
    position_ids: torch.Tensor | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (logits [B, T, Vd], fed-back hidden [B, T, H]) for TTT steps 0..steps-1 (conventions: module docstring).

    A generator so that a caller can reduce each step's logits before the next step allocates its own.
    """
    b, t = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
    hidden = drafter.fc(aux_hidden.to(drafter.fc.weight.dtype))  # [B, T, H]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def attend(q, k, v):
        keys.append(k)
        values.append(v)
        return _ttt_attention(q, keys, values)

    for j in range(steps):
        with torch.no_grad():  # the embedding is the target's, frozen
            emb = drafter.embed(_shift_left(input_ids, 1 + j))  # token t_{i+1+j} at position i
        logits, hidden = drafter.head(drafter.midlayer(emb, hidden, position_ids + j, attend))
        yield logits, hidden


def ttt_loss(
    drafter: Eagle3Drafter,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    steps: int = 7,
    decay: float = 0.8,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE-3 training-time-test loss: sum_j decay**j * loss_j, loss_j a masked soft cross-entropy (module docstring).

    Args:
        drafter: the drafter being trained (its embedding is used frozen).
        aux_hidden: [B, T, 3Ht] target features; input_ids: [B, T]; target_logits: [B, T, V] (full target vocab);
        loss_mask: [B, T] per-token mask; position_ids: [B, T], default arange(T).

    Returns:
        the scalar loss and metrics of detached [steps] tensors: ``loss`` (per step), ``acc`` (top-1 of the draft
        argmax mapped through d2t against the target argmax, over masked positions) and ``count`` (masked positions).
    """
    t = input_ids.shape[1]
    with torch.no_grad():
        t2d = drafter.t2d.to(target_logits.device)
        target_p = target_logits[..., t2d].float().softmax(dim=-1)  # [B, T, Vd]
        target_top = target_logits.argmax(dim=-1)  # [B, T] target ids
        in_draft = t2d[target_top]  # [B, T]
        loss_mask = loss_mask.bool()
    total = aux_hidden.new_zeros((), dtype=torch.float32)
    metrics = torch.zeros(3, steps, device=target_logits.device)  # rows: loss, acc, count; stays on device (no sync)
    for j, (logits, _) in enumerate(ttt_unroll(drafter, aux_hidden, input_ids, steps, position_ids)):
        n = t - 2 - j  # positions i with a token t_{i+2+j} to predict
        if n <= 0:
            break
        with torch.no_grad():
            mask = loss_mask[:, 2 + j :] & in_draft[:, 1 + j : t - 1]  # [B, n]
            count = mask.sum().clamp(min=1)
        logp = logits[:, :n].float().log_softmax(dim=-1)  # [B, n, Vd]
        cross_entropy = -(target_p[:, 1 + j : t - 1] * logp).sum(-1)  # [B, n]
        step_loss = (cross_entropy * mask).sum() / count
        total = total + decay**j * step_loss
        with torch.no_grad():
            hits = (drafter.to_target_ids(logits[:, :n].argmax(-1)) == target_top[:, 1 + j : t - 1]) & mask
            metrics[:, j] = torch.stack([step_loss.detach(), hits.sum() / count, mask.sum().float()])
    return total, {"loss": metrics[0], "acc": metrics[1], "count": metrics[2]}
