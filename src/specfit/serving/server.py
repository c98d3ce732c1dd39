"""``specfit.serve``: transformers' FastAPI app (``transformers serve``, 5.24 or 5.25: ``seam.py`` chooses) around a
SpecFit-enabled model and SpecFit's engine (``engine.py``), run by uvicorn. ``build_app`` makes the app; ``Server``
runs it on a thread (tests, notebooks, benchmarks); ``serve`` runs it in the foreground until Ctrl-C."""

from __future__ import annotations

import threading
import time

DEFAULT_NAME = "specfit"
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BATCH = 4  # rows per generate() call for requests that wait together (docs/serve.md)


def build_app(model, tokenizer, *, name: str = DEFAULT_NAME, max_queue: int = DEFAULT_MAX_QUEUE,
              assistant: str | None = "specfit", max_batch: int = DEFAULT_MAX_BATCH):
    """The OpenAI-compatible app serving ``model`` (enabled by SpecFit) as ``name``: /v1/chat/completions,
    /v1/completions, /v1/responses, /v1/models, /health; GET /v1/specfit/stats (totals since start) and
    GET /v1/specfit/stats/{id} (the SpecFit counters of a request, by its response id). Every request is decoded with
    ``assistant`` ("specfit", "eagle3", or None / "none": plain decoding) unless it sets the field ``assistant``
    itself. Non-streaming, unseeded requests with equal settings that wait for the model together run as one batch
    of up to ``max_batch`` rows (1: every request alone)."""
    from fastapi import HTTPException

    from ..decoding.assistants import ASSISTANTS
    from .admission import Queue
    from .batching import Lines
    from .engine import Engine
    from .ledger import STATS_KEPT
    from .seam import SEAM
    from .templates import install_plain_template

    Queue(max_queue), Lines(max_batch)  # their checks, before anything is built
    assistant = None if assistant == "none" else assistant
    if assistant is not None and assistant not in ASSISTANTS:
        raise ValueError(f"assistant {assistant!r} is not one of {sorted(ASSISTANTS)} (or None / 'none': plain "
                         f"decoding)")
    if tokenizer is None:
        raise ValueError("serve needs the model's tokenizer (the checkpoint has none): pass tokenizer=")
    if assistant is not None and getattr(model, "specfit", None) is None:
        raise ValueError(f"assistant={assistant!r} needs a model enabled by SpecFit (specfit.enable or "
                         f"specfit.from_pretrained); serve a plain model with assistant=None")
    install_plain_template(tokenizer)  # the embedded model has no chat template: a plain one (templates.py)
    engine = Engine(model, tokenizer, default_assistant=assistant, max_queue=max_queue, max_batch=max_batch)
    app = SEAM.build_app(engine, name)

    @app.get("/v1/specfit/stats")
    def totals():
        return engine.summary()

    @app.get("/v1/specfit/stats/{request_id}")
    def request_stats(request_id: str):
        stats = engine.ledger.get(request_id)
        if stats is None:
            raise HTTPException(status_code=404, detail=f"no finished request {request_id!r} (the counters of the "
                                                        f"last {STATS_KEPT} finished requests are kept)")
        return stats

    app.state.specfit_engine = engine
    return app


class Server:
    """uvicorn serving ``app`` on a daemon thread; ``start()`` returns once it accepts connections."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 30.0) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.config.host}:{self.config.port}")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        _close(self.config.app)


def _close(app) -> None:
    engine = getattr(app.state, "specfit_engine", None)
    if engine is not None:
        engine.close()


def serve(model, tokenizer, *, host: str = "localhost", port: int = 8000, name: str = DEFAULT_NAME,
          max_queue: int = DEFAULT_MAX_QUEUE, assistant: str | None = "specfit", log_level: str = "warning",
          background: bool = False, max_batch: int = DEFAULT_MAX_BATCH):
    """Serve ``model`` (enabled by SpecFit) with an OpenAI-compatible API on ``host:port``. In the foreground until
    Ctrl-C (returns then, without a traceback); ``background=True``: on a thread, returns the running ``Server``
    (``.url``, ``.stop()``). Every request is decoded with ``assistant`` unless it names another; requests that
    wait together share calls of up to ``max_batch`` rows (``build_app``)."""
    import uvicorn
    from transformers.utils import logging

    logging.get_logger("transformers").setLevel(logging.log_levels[log_level])  # as `transformers serve` does
    app = build_app(model, tokenizer, name=name, max_queue=max_queue, assistant=assistant, max_batch=max_batch)
    if background:
        return Server(app, host=host, port=port, log_level=log_level).start()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    try:
        server.run()  # uvicorn turns SIGINT / SIGTERM into a graceful shutdown
    except KeyboardInterrupt:
        pass
    finally:
        _close(app)
    return None
