"""Streaming, the same on every transformers release: the streamer ``generate()`` writes a request's tokens to, and
the queue its reply's text goes through on the way to the client."""

from __future__ import annotations

import asyncio

from .engine import Stopped


class TokenStreamer:
    """``generate()``'s streamer for one request (``call``): skips the prompt's put, counts every token of a put
    (an assistant puts each accepted chunk as ``[1, n]``: transformers 5.25's own streamer counted it as one token,
    so streamed usage and finish reasons were wrong), hands them to ``emit`` (on the model's thread), and stops the
    call at its next put once the request is cancelled."""

    def __init__(self, call, emit):
        self.call, self.emit, self.prompt = call, emit, True

    def put(self, value) -> None:
        if self.call.cancelled.is_set():
            raise Stopped()
        if self.prompt:
            self.prompt = False
            return
        tokens = value.reshape(-1).tolist()
        if tokens:
            self.emit(tokens)

    def end(self) -> None:
        pass  # the request's end is its call's end (the engine settles it)


def content_strips(template: dict | None) -> bool:
    """Whether a response template's whole-reply parse strips the reply's surrounding whitespace (a ``text``
    content field strips unless its ``content_args`` say ``strip: false``)."""
    field = ((template or {}).get("fields") or {}).get("content")
    if not isinstance(field, dict) or field.get("content", "text") != "text":
        return False
    return bool((field.get("content_args") or {}).get("strip", True))


class ReplyQueue(asyncio.Queue):
    """A streamed reply's queue. With ``strip``, the reply's text (plain ``str`` items: reasoning text and tool calls
    pass unchanged) loses its leading whitespace and the whitespace at its end, as the whole-reply parser strips a
    non-streamed reply, so the streamed text equals the non-streamed one exactly (transformers streamed the reply's
    leading space). Whitespace is held back until more text follows it; at the end (``None``) it is dropped."""

    def __init__(self, strip: bool):
        super().__init__()
        self.strip, self._started, self._held = strip, False, ""

    def put_nowait(self, item) -> None:
        if self.strip and type(item) is str:
            text = self._held + item if self._started else item.lstrip()
            body = text.rstrip()
            if not body:
                self._held = text if self._started else ""
                return
            self._started, self._held = True, text[len(body):]
            item = body
        super().put_nowait(item)
