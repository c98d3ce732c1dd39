"""Server batching: non-streaming requests that wait for the inference thread together, with equal settings, run as
one left-padded ``generate()`` call (docs/batch.md), up to ``max_batch`` rows.

Arrival order is kept: each request adds itself to its settings' line and submits one "drain" to the inference
thread; a drain takes up to ``max_batch`` waiting requests of its line (the oldest first), and finds nothing when
earlier drains took them all. A request that finds the thread free runs alone, as before; the ones that arrive while
it runs wait together and leave in one call. Not batched: streaming requests (a streamer takes one row), seeded ones
(a seed repeats one request's draws, not a batch's), and ones with stop strings (a row stopped by a string is
filled with the pad token, which can be the end-of-sequence token: its length would be ambiguous).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field


@dataclass
class Waiting:
    """One admitted request waiting for a batch: its inputs (``input_ids`` [1, T]) and where its row goes."""
    inputs: dict
    gen_config: object
    admitted: dict
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)


def batch_key(gen_config, admitted: dict) -> str | None:
    """Requests with equal keys may share a call; ``None``: this one runs alone."""
    if admitted["seed"] is not None or getattr(gen_config, "stop_strings", None):
        return None
    return f"{admitted['assistant']}|{gen_config.to_json_string(use_diff=False)}"


class Lines:
    """Waiting requests by settings, in arrival order; touched by the event loop (add, drop) and the inference
    thread (take), under one lock."""

    def __init__(self, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (rows per generate() call; 1: no batching), got {max_batch}")
        self.max_batch = max_batch
        self._lines: dict[str, list[Waiting]] = {}
        self._lock = threading.Lock()

    def add(self, key: str, waiting: Waiting) -> None:
        with self._lock:
            self._lines.setdefault(key, []).append(waiting)

    def drop(self, key: str, waiting: Waiting) -> None:
        """A request given up before its batch ran (its client went away): it is not run."""
        with self._lock:
            line = self._lines.get(key, [])
            if waiting in line:
                line.remove(waiting)

    def take(self, key: str) -> list[Waiting]:
        with self._lock:
            line = self._lines.get(key, [])
            taken, self._lines[key] = line[:self.max_batch], line[self.max_batch:]
            if not self._lines[key]:
                del self._lines[key]
            return taken


def left_padded(rows: list[dict], pad_id: int) -> dict:
    """One batch from single-row inputs: ``input_ids`` and ``attention_mask`` [B, T_max], padded on the left."""
    import torch

    ids = [r["input_ids"].reshape(-1) for r in rows]  # each [T_b]
    width = max(len(t) for t in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=ids[0].dtype)  # [B, T_max]
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)  # [B, T_max]
    for b, t in enumerate(ids):
        input_ids[b, width - len(t):] = t
        mask = rows[b].get("attention_mask")
        attention_mask[b, width - len(t):] = 1 if mask is None else mask.reshape(-1)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def row_tokens(row, eos_ids: set[int]) -> list[int]:
    """A batch row's new tokens as its own call would return them: through its first end-of-sequence token (rows
    that finish early are filled with the pad token after it), else all of them (it ran to max_new_tokens)."""
    tokens = row.tolist()
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i + 1]
    return tokens


def eos_set(gen_config) -> set[int]:
    eos = gen_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
