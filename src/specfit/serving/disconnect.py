"""An ASGI middleware that cancels the handling of a request when its client leaves before the answer is complete,
so that a request waiting for the model is not run for nobody (transformers 5.25's app has its own; the 5.24 seam
adds this one)."""

from __future__ import annotations

import asyncio


class CancelOnDisconnect:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        handling = asyncio.current_task()
        messages: asyncio.Queue = asyncio.Queue()
        answered = False

        async def send_and_note_the_end(message) -> None:
            nonlocal answered
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True

        async def pass_messages_on() -> None:
            while True:
                message = await receive()
                messages.put_nowait(message)
                if message["type"] == "http.disconnect":
                    if not answered:
                        handling.cancel()
                    return

        watcher = asyncio.create_task(pass_messages_on())
        try:
            await self.app(scope, messages.get, send_and_note_the_end)
        except asyncio.CancelledError:
            if not watcher.done():  # the server stopping, not the client leaving
                raise
            handling.uncancel()
        finally:
            watcher.cancel()
