"""The seam to transformers 5.25's serving stack (``transformers serve``: FastAPI app, OpenAI schema, handlers that
send each request to an engine). 5.25 runs the model in a spawned process behind an ``EngineClient``; SpecFit serves
a model already loaded and enabled in this process, so an in-process ``LocalEngine`` takes the client's place: the
surface the text handlers use of it (``generate_non_streaming``, ``generate_streaming``, ``processor``,
``model_config``, ``generation_config``, ``model_id``, ``modality``, ``use_cb``), over SpecFit's ``Engine`` (its
thread runs ``generate()``). Everything else is transformers': routes, schema, chat templates, response parsing,
``Detokenizer``, SSE chunks, usage, cancellation on disconnect. Not used: the model's process (nothing crosses it),
``set_torch_threads_for_serving`` (the engine keeps the threads the server was built with), continuous batching (its
loop has no assistant). The audio and System One endpoints answer 404 (``Unserved``)."""

from __future__ import annotations

import asyncio

from fastapi import HTTPException

from .handlers import SpecFitHandling, Unserved, current_settings, endpoint_handlers, sampling_settings
from .streams import ReplyQueue, TokenStreamer, content_strips


def require() -> None:
    """The 5.25 names this seam uses, imported now (a release without them raises ``releases.unsupported``)."""
    import transformers

    from .releases import unsupported

    try:
        from transformers.cli.serving.server import build_server  # noqa: F401
        from transformers.cli.serving.utils import (Detokenizer, GenerationState, Modality,  # noqa: F401
                                                    _StreamError, get_response_template)
    except ImportError as error:
        raise unsupported(transformers.__version__, str(error)) from error


class LocalEngine:
    """One model, as 5.25's handlers use an engine, in this process (their ``EngineClient`` runs it in another)."""

    use_cb = False  # sequential generate() calls: continuous batching has no assistant
    process_running = True
    is_dead = False

    def __init__(self, engine, name: str):
        from transformers.cli.serving.utils import Modality, get_response_template

        self.engine, self.model_id = engine, name
        self.processor = engine.tokenizer
        self.model_config = engine.model.config
        self.generation_config = engine.model.generation_config
        self.modality = Modality.LLM
        self.strips = content_strips(get_response_template(self.processor, self.model_config))

    def _admit(self, inputs: dict, generation_kwargs: dict):
        kwargs = {name: value for name, value in generation_kwargs.items() if value is not None}  # as 5.25's runner
        return self.engine.admit(inputs, kwargs, current_settings(self.engine))

    async def generate_non_streaming(self, inputs: dict, generation_kwargs: dict) -> tuple[str, int, list[int]]:
        call = self._admit(inputs, generation_kwargs)
        tokens = await self.engine.generate(call)
        return self.processor.decode(tokens, skip_special_tokens=True), call.prompt, tokens

    def generate_streaming(self, inputs: dict, generation_kwargs: dict, response_parser=None):
        """The reply's queue and its ``Detokenizer`` (theirs: the tokens' text, parsed), fed token by token."""
        from transformers.cli.serving.utils import Detokenizer, _StreamError

        call = self._admit(inputs, generation_kwargs)
        out = ReplyQueue(strip=self.strips and response_parser is not None)
        tokenizer = getattr(self.processor, "tokenizer", self.processor)._tokenizer
        detokenizer = Detokenizer(tokenizer, out, response_parser=response_parser)
        loop = asyncio.get_running_loop()

        def deliver(tokens: list[int]) -> None:  # on the event loop
            if not call.future.done():
                for token in tokens:
                    detokenizer.put_token(token)

        done = self.engine.stream(call, TokenStreamer(call, lambda tokens: loop.call_soon_threadsafe(deliver,
                                                                                                      tokens)))

        async def wait_for_the_end() -> None:
            try:
                await done
                detokenizer.end()
            except asyncio.CancelledError:  # the client left (the handler cancels the streamer): stop the call
                self.engine.abandon(call)
            except Exception as error:
                out.put_nowait(_StreamError(str(error)))

        detokenizer.task = asyncio.create_task(wait_for_the_end())
        return out, detokenizer


class PinnedModels:
    """The one model served, under one name (their ``ModelManager`` loads models by id in processes of their own)."""

    is_dead = False

    def __init__(self, name: str, engine: LocalEngine):
        self.force_model, self.engine = name, engine

    def get_engine(self, model: str | None) -> LocalEngine:
        if model is not None and model != self.force_model:
            raise HTTPException(status_code=400, detail=f"Server is pinned to '{self.force_model}'; requested "
                                                        f"'{model}'.")
        return self.engine

    def list_models(self, cache_dir=None) -> list[dict]:
        return [{"id": self.force_model, "object": "model", "created": 0, "owned_by": "specfit",
                 "status": {"value": "loaded"}}]

    async def load_model_streaming(self, model: str):
        raise HTTPException(status_code=400, detail=f"this server serves {self.force_model!r} only; it loads no "
                                                    f"other model")

    def shutdown(self) -> None:
        pass  # the model belongs to the caller of serve(); the engine stops with the server (server.py)


class Rules(SpecFitHandling):
    """5.25's hooks: the request's sampling settings on top of theirs; the context check is the engine's
    (``admission.fitted_length``: it names the context and fits the default length)."""

    def _build_generation_kwargs(self, body: dict, model_generation_config) -> dict:
        kwargs = super()._build_generation_kwargs(body, model_generation_config)
        kwargs.update(sampling_settings(self.engine))
        return kwargs

    def _check_prompt_length(self, engine, inputs: dict) -> None:
        pass



def build_app(engine, name: str):
    """transformers' FastAPI app around ``engine`` (SpecFit's), serving it as ``name``."""
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.utils import GenerationState

    models = PinnedModels(name, LocalEngine(engine, name))
    state = GenerationState()
    handlers = endpoint_handlers(Rules, models, state, engine)
    return build_server(models, *handlers, transcription_handler=Unserved("/v1/audio/transcriptions"),
                        systemone_handler=Unserved("/v1/systemone"))
