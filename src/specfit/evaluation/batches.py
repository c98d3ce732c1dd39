"""Prompts in left-padded batches, as a serving loop or a user with several prompts would pass them to generate()."""

from __future__ import annotations

import torch


def left_padded(prompt_ids: list[torch.Tensor], batch: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive groups of ``batch`` prompts ([1, T_i] each; the last group may be smaller) as (input_ids [B, T],
    attention_mask [B, T]), left-padded with ``pad``.

    >>> [(i.tolist(), m.tolist()) for i, m in left_padded([torch.tensor([[5, 6]]), torch.tensor([[7]])], 2, 0)]
    [([[5, 6], [0, 7]], [[1, 1], [0, 1]])]
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    groups = []
    for start in range(0, len(prompt_ids), batch):
        rows = [p.reshape(-1) for p in prompt_ids[start:start + batch]]
        width = max(len(r) for r in rows)
        device = rows[0].device  # the batch where its prompts are (a GPU model's, or the host's for generate())
        ids = torch.full((len(rows), width), pad, dtype=rows[0].dtype, device=device)  # [B, T]
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # [B, T]
        for b, r in enumerate(rows):
            ids[b, width - len(r):], mask[b, width - len(r):] = r, 1
        groups.append((ids, mask))
    return groups


def pad_id(model) -> int:
    """The token a batch is padded with: the model's pad token, else its (first) EOS token, else 0."""
    from ..decoding.batch_rows import pad_token

    return pad_token(model.generation_config)
