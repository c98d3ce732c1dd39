"""Admission, the same on every transformers release: the context check (a prompt that leaves no room for an answer,
an explicit length past the context) and the queue limit (429), before a request is queued. Pure rules, no torch."""

from __future__ import annotations

import threading

from .requests import Refusal


def fitted_length(prompt: int, max_new_tokens: int, context: int | None, length_field: str | None) -> int:
    """The new tokens a request may generate: ``max_new_tokens`` when prompt and answer fit the model's context; the
    server's default length cut to the room left; a prompt of ``context`` tokens or more, or an explicit length
    (``length_field``) past the context, is refused (400, naming the context)."""
    if context is None:
        return max_new_tokens
    room = context - prompt
    if room < 1:
        raise Refusal(400, f"the prompt is {prompt} tokens; the model's context is {context} tokens, prompt and "
                           f"answer: shorten the prompt below {context} tokens")
    if max_new_tokens <= room:
        return max_new_tokens
    if length_field is not None:
        raise Refusal(400, f"{length_field} {max_new_tokens} + the prompt's {prompt} tokens exceed the model's "
                           f"context of {context} tokens: ask for at most {room}")
    return room  # the server's default length, fitted to the context


class Queue:
    """Requests admitted and not finished (running or waiting), at most ``limit``: one more is answered 429."""

    def __init__(self, limit: int):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_queue must be an integer >= 1 (requests running or waiting at once), got "
                             f"{limit!r}")
        self.limit, self.pending = limit, 0
        self._lock = threading.Lock()

    def admit(self) -> None:
        with self._lock:
            if self.pending >= self.limit:
                raise Refusal(429, f"the server's queue is full ({self.pending} requests running or waiting, "
                                   f"--max-queue {self.limit}); retry later")
            self.pending += 1

    def release(self) -> None:
        with self._lock:
            self.pending -= 1
