"""Server batching: non-streaming requests that wait for the model together, with equal settings, run as one
left-padded ``generate()`` call (docs/batch.md), up to ``max_batch`` rows. The same on every transformers release.

Arrival order is kept: each request adds itself to its settings' line and submits one "drain" to the model's
thread; a drain takes up to ``max_batch`` waiting requests of its line (the oldest first), and finds nothing when
earlier drains took them all. A request that finds the thread free runs alone; the ones that arrive while it runs
wait together and leave in one call. Not batched: streaming requests (a streamer takes one row), seeded ones (a
seed fixes one request's draws: a batch shares one random stream, so a row would not get the text its seed gives
alone), and ones with stop strings (a row stopped by a string is filled with the pad token, which can be the
end-of-sequence token: its length would be ambiguous). Unseeded sampling requests may share a call: each row is an
independent draw, as it is alone (docs/serve.md).
"""

from __future__ import annotations

import json
import threading


def _described(value):
    return value.to_json_string(use_diff=False) if hasattr(value, "to_json_string") else value


def stop_strings(kwargs: dict):
    config = kwargs.get("generation_config")
    return kwargs.get("stop_strings") or getattr(config, "stop_strings", None)


def batch_key(kwargs: dict, assistant: str | None, seed: int | None) -> str | None:
    """Requests with equal keys may share a call (every generation setting equal: length, sampling, penalties, and
    the assistant); ``None``: this one runs alone."""
    if seed is not None or stop_strings(kwargs):
        return None
    settings = {name: _described(value) for name, value in kwargs.items()}
    return json.dumps({"assistant": assistant, "settings": settings}, sort_keys=True, default=repr)


def call_eos(kwargs: dict, model_generation_config):
    """The end-of-sequence token(s) a call stops at: its own setting, else the model's."""
    config = kwargs.get("generation_config")
    if config is not None and config.eos_token_id is not None:
        return config.eos_token_id
    if kwargs.get("eos_token_id") is not None:
        return kwargs["eos_token_id"]
    return model_generation_config.eos_token_id


def pad_token(kwargs: dict, tokenizer, model_generation_config, eos: set[int]) -> int:
    config = kwargs.get("generation_config")
    for candidate in (getattr(config, "pad_token_id", None), kwargs.get("pad_token_id"),
                      getattr(tokenizer, "pad_token_id", None), model_generation_config.pad_token_id, *sorted(eos)):
        if candidate is not None:
            return int(candidate)
    raise ValueError("a batch needs a pad token: the model and its tokenizer name neither a pad nor an end token")


class Lines:
    """Waiting requests by settings, in arrival order; touched by the event loop (add, drop) and the model's thread
    (take), under one lock. A request taken by a drain is ``started``: it can no longer be dropped."""

    def __init__(self, max_batch: int):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1 (rows per generate() call; 1: no batching), got "
                             f"{max_batch!r}")
        self.max_batch = max_batch
        self._lines: dict[str, list] = {}
        self._lock = threading.Lock()

    def add(self, key: str, call) -> None:
        with self._lock:
            self._lines.setdefault(key, []).append(call)

    def drop(self, key: str, call) -> bool:
        """A request given up before its batch ran (its client went away): it is not run. False when a drain
        already took it."""
        with self._lock:
            line = self._lines.get(key, [])
            if call not in line:
                return False
            line.remove(call)
            if not line:
                del self._lines[key]
            return True

    def take(self, key: str) -> list:
        with self._lock:
            line = self._lines.get(key, [])
            taken, rest = line[:self.max_batch], line[self.max_batch:]
            if rest:
                self._lines[key] = rest
            else:
                self._lines.pop(key, None)
            for call in taken:
                call.started = True
            return taken

    def waiting(self) -> int:
        with self._lock:
            return sum(len(line) for line in self._lines.values())


def left_padded(rows: list[dict], pad_id: int) -> dict:
    """One batch from single-row inputs: ``input_ids`` and ``attention_mask`` [B, T_max], padded on the left, on the
    rows' device (transformers and the server move each request's inputs to the model's device first)."""
    import torch

    device = rows[0]["input_ids"].device
    ids = [r["input_ids"].reshape(-1).to(device) for r in rows]  # each [T_b]
    width = max(len(t) for t in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=ids[0].dtype, device=device)  # [B, T_max]
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long, device=device)  # [B, T_max]
    for b, t in enumerate(ids):
        input_ids[b, width - len(t):] = t
        mask = rows[b].get("attention_mask")
        attention_mask[b, width - len(t):] = 1 if mask is None else mask.reshape(-1).to(device)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def row_tokens(row, eos_ids: set[int]) -> list[int]:
    """A batch row's new tokens as its own call would return them: through its first end-of-sequence token (rows
    that finish early are filled with the pad token after it), else all of them (it ran to max_new_tokens)."""
    tokens = row.tolist()
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i + 1]
    return tokens


def eos_set(eos) -> set[int]:
    """End-of-sequence ids as a set, from an id, a list of ids, or None."""
    if eos is None:
        return set()
    return {int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])}
