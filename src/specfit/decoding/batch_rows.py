"""The rows of a batch: one candidate generator per row (its own drafter state), their pools and chosen subtrees,
and the batch's output padded as plain ``generate()`` pads it."""

from __future__ import annotations

import torch

from ..drafting.tree import DraftTree


class RowTrees:
    """One generator per prompt row (``assistant(model)``), each drafting from its own committed tokens; the
    drafter module is shared (its per-row state is the row's ``TreeDrafter`` cache)."""

    def __init__(self, model, assistant, rows: int):
        self.gens = [assistant(model) for _ in range(rows)]
        self.pool, self.expected, self.predicted = 0, 0.0, None

    def draft_and_select(self, active: list[int], cycles) -> list[tuple[DraftTree, tuple[int, ...]]]:
        """Every active row's pool and the subtree of it to verify (each row's generator decides)."""
        chosen = []
        for b, cycle in zip(active, cycles):
            gen = self.gens[b]
            tree = gen.draft(cycle)
            chosen.append((tree, tuple(sorted(gen.select(tree, cycle)))))
        self.pool = sum(len(tree) for tree, _ in chosen)
        self.expected = sum(self.gens[b].expected_tokens for b in active)
        return chosen

    def timed(self, active, seconds, forward, committed) -> None:
        """A batch cycle's clock belongs to every row at once: no row's cost model learns from it."""


def pad_token(config) -> int:
    """The token padding fills with: the generation config's pad token, else its first EOS token, else 0."""
    for value in (getattr(config, "_pad_token_tensor", None), config.pad_token_id, config.eos_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, torch.Tensor):
            value = value.reshape(-1)[0].item() if value.numel() else None
        if value is not None:
            return int(value)
    return 0


def padded_sequences(runs, config, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, longest] every row's tokens, the shorter rows filled with the pad token after they stopped (as plain
    ``generate()`` fills a finished row)."""
    longest = max(run.length for run in runs)
    fill = pad_token(config)
    rows = [run.tokens + [fill] * (longest - run.length) for run in runs]
    return torch.tensor(rows, dtype=input_ids.dtype, device=input_ids.device)
