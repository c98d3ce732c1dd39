"""What SpecFit adds to transformers' endpoint handlers, the same on every transformers release: the body checked
first (``requests.py``: a 4xx naming the field, never a 500), SpecFit's own fields taken out and honoured, the
request's settings handed to the engine (``REQUEST``, a context variable: the release's handler calls the engine
from inside ``handle_request``), and the request's counters added to a non-streaming response (``specfit``)."""

from __future__ import annotations

import asyncio
import json
import logging
from contextvars import ContextVar

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from .requests import Refusal, Settings, parse, sampling

logger = logging.getLogger("specfit.serve")

REQUEST: ContextVar[Settings | None] = ContextVar("specfit_request", default=None)


def current_settings(engine) -> Settings:
    """The settings of the request being handled (the server's defaults outside a SpecFit handler)."""
    settings = REQUEST.get()
    return settings if settings is not None else Settings(assistant=engine.default_assistant)


def sampling_settings(engine) -> dict:
    """The generation settings the current request's sampling fields set (``requests.sampling``)."""
    return sampling(current_settings(engine))


class SpecFitHandling:
    """Mixed in before transformers' chat, completion or response handler (of either release). ``kind``: the
    endpoint ("chat", "completion", "response"); ``engine``: set by the seam that builds the handler."""

    kind = "chat"
    engine = None

    async def handle_request(self, body: dict, request_id: str):
        from ..decoding.assistants import ASSISTANTS

        try:
            settings, body = parse(body, self.kind, self.engine.default_assistant, ASSISTANTS)
        except Refusal as refusal:
            raise HTTPException(status_code=refusal.status, detail=refusal.message) from None
        settings.request_id = request_id
        token = REQUEST.set(settings)
        try:
            return await super().handle_request(body, request_id)
        except Refusal as refusal:  # admission: the context, the queue
            raise HTTPException(status_code=refusal.status, detail=refusal.message) from None
        except ValueError as error:  # the request's fault (generate() refused a setting): a 400 on every release
            raise HTTPException(status_code=400, detail=str(error)) from None
        finally:
            REQUEST.reset(token)

    async def _non_streaming(self, request_id: str, *args, **kwargs):
        try:
            response = await super()._non_streaming(request_id, *args, **kwargs)
        except (HTTPException, Refusal, ValueError, asyncio.CancelledError):
            raise
        except Exception as error:  # a failed call answers 500 with its reason; the connection stays usable
            logger.exception("specfit serve: request %s failed", request_id)
            return JSONResponse({"detail": f"generation failed: {type(error).__name__}: {error}"}, status_code=500)
        stats = self.engine.ledger.get(request_id)
        if stats is None:
            return response
        data = json.loads(response.body)
        data["specfit"] = stats  # an extra field: the openai client keeps it (model_extra)
        return JSONResponse(data)


def endpoint_handlers(rules: type, models, state, engine) -> list:
    """transformers' chat, completion and response handlers (same modules and constructors in 5.24 and 5.25) with a
    release's ``rules`` (a ``SpecFitHandling`` subclass with its hooks) mixed in before them, serving ``engine``."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler

    made = []
    for kind, base in (("chat", ChatCompletionHandler), ("completion", CompletionHandler),
                       ("response", ResponseHandler)):
        handler = type(f"SpecFit{base.__name__}", (rules, base), {"kind": kind})(models, state)
        handler.engine = engine
        made.append(handler)
    return made


class Unserved:
    """An endpoint of transformers' app this server does not serve (audio transcription, System One): a 404."""

    def __init__(self, what: str):
        self.what = what

    async def handle_request(self, *args, **kwargs):
        raise HTTPException(status_code=404, detail=f"this server serves text generation only (chat, completions, "
                                                    f"responses); {self.what} is not served")
