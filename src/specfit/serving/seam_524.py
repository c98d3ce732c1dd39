"""The seam to transformers 5.24's serving stack (``transformers serve``: FastAPI app, OpenAI schema, handlers that
ask a generation manager for each request, ``DirectStreamer``). Specialised, each for a stated reason:

- ``PinnedModels``: their ``ModelManager`` loads models by hub id on demand; ours hands out the one model SpecFit
  already loaded and enabled, under one name.
- ``Manager``: in place of their ``GenerateManager`` (one inference thread), SpecFit's ``Engine`` (``engine.py``:
  its thread, the request's settings, batches, admission, counters).
- ``Chat`` / ``Completion`` / ``Response``: their handlers with SpecFit's request rules (``handlers.py``) and the
  request's sampling settings on their generation config (5.24 never set ``do_sample``).
- ``CancelOnDisconnect`` (``disconnect.py``): 5.24's app does not stop a non-streaming request whose client left.

Everything else is theirs: routes, schema, chat templates, response parsing, SSE chunks, usage. The audio and System
One endpoints answer 404 (``Unserved``)."""

from __future__ import annotations

import asyncio

from fastapi import HTTPException
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.utils import GenerationState

from .handlers import SpecFitHandling, Unserved, current_settings, endpoint_handlers, sampling_settings
from .streams import ReplyQueue, content_strips


def require() -> None:
    """The 5.24 names this seam uses, imported now (a release without them raises ``releases.unsupported``)."""
    import transformers

    from .releases import unsupported

    try:
        from transformers.cli.serving.server import build_server  # noqa: F401
        from transformers.cli.serving.utils import DirectStreamer, _StreamError, get_response_template  # noqa: F401
    except ImportError as error:
        raise unsupported(transformers.__version__, str(error)) from error


class PinnedModels(ModelManager):
    """One loaded, SpecFit-enabled model under one name; nothing is loaded or unloaded on request."""

    def __init__(self, name: str, model, tokenizer):  # their __init__ would resolve devices and preload by hub id
        self.force_model, self.model, self.tokenizer = name, model, tokenizer
        self.loaded_models = {name: None}

    @staticmethod
    def process_model_name(model_id: str) -> str:
        return model_id

    def load_model_and_processor(self, model_id_and_revision: str, **_):
        return self.model, self.tokenizer

    def list_models(self, cache_dir=None) -> list[dict]:
        return [{"id": self.force_model, "object": "model", "created": 0, "owned_by": "specfit",
                 "status": {"value": "loaded"}}]

    async def load_model_streaming(self, model_id_and_revision: str, gguf_file=None):
        raise HTTPException(status_code=400, detail=f"this server serves {self.force_model!r} only; it loads no "
                                                    f"other model")

    def shutdown(self) -> None:
        pass  # the model belongs to the caller of serve(); the engine stops with the server (server.py)


class FlatStreamer:
    """Their ``DirectStreamer`` (incremental text, response parsing) behind SpecFit's rules: every token of a
    ``[1, n]`` put counted (flattened), and the call stopped at its next put once the request is cancelled."""

    def __init__(self, inner, call, engine):
        self.inner, self.call, self.engine = inner, call, engine

    def put(self, value) -> None:
        if self.call.cancelled.is_set():
            from .engine import Stopped

            raise Stopped()
        self.inner.put(value.reshape(-1))  # their first put (the prompt) is skipped by them

    def end(self) -> None:
        self.inner.end()

    def cancel(self) -> None:  # the handler's: the client left mid-stream
        self.inner.cancel()
        self.engine.abandon(self.call)

    @property
    def total_tokens(self) -> int:
        return self.inner.total_tokens


class Manager:
    """What 5.24's handlers ask of a generation manager, over SpecFit's engine."""

    def __init__(self, engine, strips: bool):
        self.engine, self.strips = engine, strips

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        from transformers.cli.serving.utils import DirectStreamer, _StreamError

        call = self.engine.admit(inputs, {"generation_config": gen_config}, current_settings(self.engine))
        out = ReplyQueue(strip=self.strips and response_parser is not None)
        tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
        streamer = FlatStreamer(DirectStreamer(tokenizer, asyncio.get_running_loop(), out,
                                               response_parser=response_parser), call, self.engine)

        def finished(done: asyncio.Future) -> None:  # a success ended the queue itself (their streamer's end())
            if done.cancelled() or call.cancelled.is_set():
                out.put_nowait(None)
            elif done.exception() is not None:
                out.put_nowait(_StreamError(str(done.exception())))

        self.engine.stream(call, streamer).add_done_callback(finished)
        return out, streamer

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        import torch

        call = self.engine.admit(inputs, {"generation_config": gen_config}, current_settings(self.engine))
        tokens = torch.tensor(await self.engine.generate(call), dtype=torch.long)
        return processor.decode(tokens, skip_special_tokens=True), call.prompt, tokens


class Generation(GenerationState):
    """Their generation state, with SpecFit's manager for the pinned model (no continuous batching)."""

    def __init__(self, manager: Manager):
        super().__init__(continuous_batching=False)
        self.manager = manager

    def get_manager(self, model_id: str, use_cb: bool = False) -> Manager:
        return self.manager


class Rules(SpecFitHandling):
    """5.24's hook: the request's sampling settings on the generation config their handler built."""

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        config = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
        for name, value in sampling_settings(self.engine).items():
            setattr(config, name, value)
        return config



def build_app(engine, name: str):
    """transformers' FastAPI app around ``engine`` (SpecFit's), serving it as ``name``."""
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.utils import get_response_template

    from .disconnect import CancelOnDisconnect

    models = PinnedModels(name, engine.model, engine.tokenizer)
    state = Generation(Manager(engine, content_strips(get_response_template(engine.tokenizer, engine.model))))
    handlers = endpoint_handlers(Rules, models, state, engine)
    app = build_server(models, *handlers, transcription_handler=Unserved("/v1/audio/transcriptions"),
                       systemone_handler=Unserved("/v1/systemone"), generation_state=state)
    app.add_middleware(CancelOnDisconnect)
    return app
