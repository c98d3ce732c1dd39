"""The seam between transformers' serving stack (``transformers serve``: FastAPI app, OpenAI schema, request
validation, SSE streaming, ``DirectStreamer``) and a SpecFit-enabled model. Only three of its classes are
specialised, each for a stated reason; everything else (routes, schema, chunking, usage, tool parsing) is theirs.

- ``PinnedModels``: their ``ModelManager`` loads models by hub id on demand; ours hands out the one model SpecFit
  already loaded and enabled (offloaded experts, drafter), under one name.
- ``SpecFitGenerateManager``: their ``GenerateManager`` runs ``model.generate`` on one inference thread (FIFO, so
  requests are served in arrival order, one at a time, under the model's own lock). Ours adds, per request:
  ``assistant="specfit"`` unless the request asks otherwise, the request's seed set on that thread just before its
  call, the context check, a queue limit (429 when full) and the call's SpecFit counters; and batching
  (``batching.py``): non-streaming requests that wait with equal settings leave in one left-padded call of up to
  ``max_batch`` rows (their ``CBGenerateManager`` runs a paged-attention loop of its own, which has no assistant).
- ``SpecFitChat`` / ``SpecFitCompletion``: their handlers, plus the fields ``assistant`` and early 400s for values
  their schema types accept but decoding cannot (negative ``max_tokens``, an unknown assistant), and the request's
  SpecFit counters as the extra field ``specfit`` of a non-streaming response.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections import OrderedDict

from fastapi import HTTPException
from fastapi.responses import JSONResponse

TESTED_TRANSFORMERS = "5.24"  # the minor release whose serving stack this seam was written and tested against

try:
    from transformers.cli.serving.chat_completion import (ChatCompletionHandler,
                                                           TransformersCompletionCreateParamsStreaming)
    from transformers.cli.serving.completion import CompletionHandler, TransformersTextCompletionCreateParams
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import (DirectStreamer, GenerateManager, GenerationState,
                                                _GenerationCancelled, _StreamError, set_torch_seed)
except ImportError as error:  # another release moved its internals: say which one works, not a bare ImportError
    import transformers
    raise ImportError(f"specfit serve runs on transformers' serving stack as of {TESTED_TRANSFORMERS}.x; the "
                      f"installed transformers {transformers.__version__} does not have it ({error}). Install the "
                      f"tested release: pip install 'transformers=={TESTED_TRANSFORMERS}.*'") from error

from .batching import Lines, Waiting, batch_key, eos_set, left_padded, row_tokens  # noqa: E402


def _settle(future: asyncio.Future, row, error) -> None:
    """On the event loop: a batched request's row (or the batch's error), unless its client already went away."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(row)


# The embedded model has no chat template of its own: this plain template renders messages in the prompt format it
# was trained on ("Question: ...\nAnswer:"), a system message as a plain first line. Stated as such in docs/serve.md.
PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Question: {{ m['content'] }}\n"
    "{% else %}Answer: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Answer:{% endif %}"
)

# ... and the response template that goes with it (transformers' hook for parsing a reply: without one it would use
# its Qwen3 fallback for this model type, which looks for "<|im_start|>assistant"): the reply is the text after the
# prompt's "Answer:", up to end-of-text, its surrounding whitespace stripped as chat replies are.
PLAIN_RESPONSE = {"defaults": {"role": "assistant"}, "start_anchor": "Answer:",
                  "fields": {"content": {"close_pattern": r"<\|endoftext\|>", "content": "text"}}}

STATS_KEPT = 1024  # per-request counters kept for GET /v1/specfit/stats/{id}, oldest dropped first


class ChatParams(TransformersCompletionCreateParamsStreaming, total=False):
    assistant: str | None  # "specfit" (default), another registered assistant, or null: plain decoding


class CompletionParams(TransformersTextCompletionCreateParams, total=False):
    assistant: str | None


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
        pass  # the model belongs to the caller of serve()


class TokenStreamer(DirectStreamer):
    """Their streamer counts one token per ``put`` of a 1-D tensor (plain decoding's one token per step); an
    assistant puts each accepted chunk as ``[1, n]``: flattened here, so ``usage`` counts every token."""

    def put(self, value) -> None:
        super().put(value.reshape(-1))


class SpecFitGenerateManager(GenerateManager):
    """Their sequential manager, with SpecFit's per-request settings, a queue limit, per-request counters and
    batches of waiting non-streaming requests (``max_batch`` rows per call; 1: each request alone)."""

    def __init__(self, model, max_queue: int, default_assistant: str | None, max_batch: int = 1):
        super().__init__()
        self.max_queue, self.default_assistant = max_queue, default_assistant
        self.lines = Lines(max_batch)  # non-streaming requests waiting to share a call (batching.py)
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.pending = 0  # admitted requests not finished (running + waiting), changed on the event loop only
        self.requests: dict[int, dict] = {}  # id(gen_config) -> the request's settings, from the handler
        self.stats: OrderedDict[str, dict] = OrderedDict()
        self._stats_lock = threading.Lock()

    # ----- admission: on the event loop, before anything is queued -----

    def _admit(self, model, inputs: dict, gen_config, request_id: str) -> dict:
        settings = self.requests.pop(id(gen_config), {})
        prompt = int(inputs["input_ids"].shape[-1])
        if self.context is not None:
            room = self.context - prompt
            if room < 1:
                raise HTTPException(status_code=400, detail=f"the prompt is {prompt} tokens; the model's context "
                                                            f"is {self.context}: shorten it below {self.context}")
            if gen_config.max_new_tokens > room:
                if settings.get("max_tokens_given"):
                    raise HTTPException(status_code=400, detail=(
                        f"max_tokens {gen_config.max_new_tokens} + the prompt's {prompt} tokens exceed the "
                        f"model's context of {self.context}: ask for at most {room}"))
                gen_config.max_new_tokens = room  # the server's default length, fitted to the context
        if self.pending >= self.max_queue:
            raise HTTPException(status_code=429, detail=(
                f"the server's queue is full ({self.pending} requests running or waiting, --max-queue "
                f"{self.max_queue}); retry later"))
        self.pending += 1
        assistant = settings.get("assistant", self.default_assistant)
        if assistant is not None:
            gen_config.assistant = assistant
        return {"seed": settings.get("seed"), "request_id": request_id, "assistant": assistant}

    def _release(self, loop) -> None:
        loop.call_soon_threadsafe(self._decrement)

    def _decrement(self) -> None:
        self.pending -= 1

    # ----- on the inference thread -----

    def _call(self, model, kwargs: dict, admitted: dict, batch: list[dict] | None = None):
        if admitted["seed"] is not None:
            set_torch_seed(admitted["seed"])
        try:
            return model.generate(**kwargs)
        finally:
            self._record(model, batch or [admitted])

    def _record(self, model, admitted: list[dict]) -> None:
        """Each request's counters: the call's figures (a batch's are the whole call's: every row's tokens over its
        wall clock), with ``batch`` its rows and ``tokens`` the request's own (filled in by the batch's runner)."""
        runtime = getattr(model, "specfit", None)
        if runtime is None:
            return
        c = runtime.stats.last_generate  # this call's: calls run one at a time on this thread
        figures = {"assistant": admitted[0]["assistant"], "method": runtime.stats.last_method,
                   "tokens": c.new_tokens, "batch": len(admitted), "call_tokens": c.new_tokens,
                   "tokens_per_second": c.end_to_end_tokens_per_second, "tokens_per_cycle": c.tokens_per_cycle,
                   "copies_per_token": c.copies_per_token, "cycles": c.cycles}
        figures = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in figures.items()}
        with self._stats_lock:
            for request in admitted:
                self.stats[request["request_id"]] = dict(figures)
            while len(self.stats) > STATS_KEPT:
                self.stats.popitem(last=False)

    def _run_batch(self, model, processor, key: str) -> None:
        """On the inference thread: up to ``max_batch`` waiting requests of one line in one left-padded call; each
        request's future gets its own row (its new tokens through its first end-of-sequence token)."""
        import torch

        taken = self.lines.take(key)
        if not taken:  # an earlier drain took them
            return
        config = taken[0].gen_config  # the line's settings: equal for every request in it
        eos = eos_set(config)
        try:
            if len(taken) == 1:
                inputs = taken[0].inputs
            else:
                tokenizer = getattr(processor, "tokenizer", processor)
                pad = next(p for p in (config.pad_token_id, tokenizer.pad_token_id, *sorted(eos)) if p is not None)
                inputs = left_padded([w.inputs for w in taken], pad)
            admitted = [w.admitted for w in taken]
            sequences = self._call(model, {**inputs, "generation_config": config, "tokenizer": processor},
                                   admitted[0], batch=admitted)
            width = inputs["input_ids"].shape[-1]
            rows = [sequences[0, width:]] if len(taken) == 1 else [
                torch.tensor(row_tokens(sequences[b, width:], eos), dtype=sequences.dtype)
                for b in range(len(taken))]
            with self._stats_lock:
                for w, row in zip(taken, rows):
                    if w.admitted["request_id"] in self.stats:
                        self.stats[w.admitted["request_id"]]["tokens"] = int(row.numel())
            for w, row in zip(taken, rows):
                w.loop.call_soon_threadsafe(_settle, w.future, row, None)
        except Exception as err:  # every request of the batch hears why; the thread goes on serving
            for w in taken:
                w.loop.call_soon_threadsafe(_settle, w.future, None, err)

    # ----- their interface -----

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        admitted = self._admit(model, inputs, gen_config, request_id)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        streamer = TokenStreamer(getattr(processor, "tokenizer", processor)._tokenizer, loop, queue,
                                  response_parser=response_parser)
        kwargs = {**inputs, "streamer": streamer, "generation_config": gen_config, "tokenizer": processor}

        def run() -> None:
            try:
                self._call(model, kwargs, admitted)
            except _GenerationCancelled:  # the client went away: the slot is free for the next request
                loop.call_soon_threadsafe(queue.put_nowait, None)
            except Exception as err:
                loop.call_soon_threadsafe(queue.put_nowait, _StreamError(str(err)))
            finally:
                self._release(loop)

        self.submit(run)
        return queue, streamer

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        admitted = self._admit(model, inputs, gen_config, request_id)
        key = batch_key(gen_config, admitted) if self.lines.max_batch > 1 else None
        try:
            if key is None:
                kwargs = {**inputs, "generation_config": gen_config, "tokenizer": processor}
                sequences = await self.async_submit(self._call, model, kwargs, admitted)
                generated = sequences[0, inputs["input_ids"].shape[-1]:]
            else:
                generated = await self._in_batch(model, processor, inputs, gen_config, admitted, key)
        finally:
            self.pending -= 1
        return processor.decode(generated, skip_special_tokens=True), inputs["input_ids"].shape[-1], generated

    async def _in_batch(self, model, processor, inputs, gen_config, admitted, key):
        loop = asyncio.get_running_loop()
        waiting = Waiting(inputs, gen_config, admitted, loop, loop.create_future())
        self.lines.add(key, waiting)
        self.submit(self._run_batch, model, processor, key)  # a drain: it may find this request already taken
        try:
            return await waiting.future
        except asyncio.CancelledError:  # the client went away before its batch ran: it is not run
            self.lines.drop(key, waiting)
            raise


class SpecFitGeneration(GenerationState):
    """Their generation state, with one ``SpecFitGenerateManager`` for the pinned model (no continuous batching:
    their CB manager runs its own paged-attention generation loop, which has no assistant)."""

    def __init__(self, manager: SpecFitGenerateManager):
        super().__init__(continuous_batching=False)
        self.manager = manager

    def get_manager(self, model_id: str, use_cb: bool = False):
        return self.manager


class _SpecFitRequests:
    """Shared by both handlers: the ``assistant`` field, early 400s, the seed and the counters in the response."""

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        from ..decoding.assistants import ASSISTANTS

        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise HTTPException(status_code=400, detail=f"{key} must be an integer >= 1, got {value!r}")
        settings = {"max_tokens_given": body.get("max_tokens") is not None
                    or body.get("max_completion_tokens") is not None}
        if "assistant" in body:
            assistant = body["assistant"]
            if assistant is not None and assistant not in ASSISTANTS:
                raise HTTPException(status_code=400, detail=f"assistant {assistant!r} is not one of "
                                                            f"{sorted(ASSISTANTS)} (or null: plain decoding)")
            settings["assistant"] = assistant
        seed = body.pop("seed", None)  # set on the inference thread just before this request's call, not now
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise HTTPException(status_code=400, detail=f"seed must be an integer, got {seed!r}")
            settings["seed"] = seed
        for key in ("temperature", "top_p"):
            value = body.get(key)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise HTTPException(status_code=400, detail=f"{key} must be a number >= 0, got {value!r}")
        config = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
        self.generation_state.manager.requests[id(config)] = settings
        return config

    async def _non_streaming(self, request_id, *args, **kwargs):
        response = await super()._non_streaming(request_id, *args, **kwargs)
        stats = self.generation_state.manager.stats.get(request_id)
        if stats is None:
            return response
        data = json.loads(response.body)
        data["specfit"] = stats  # an extra field: the openai client keeps it (model_extra)
        return JSONResponse(data)


class SpecFitChat(_SpecFitRequests, ChatCompletionHandler):
    _valid_params_class = ChatParams


class SpecFitCompletion(_SpecFitRequests, CompletionHandler):
    _valid_params_class = CompletionParams
