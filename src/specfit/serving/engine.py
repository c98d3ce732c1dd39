"""The server's engine, the same on every transformers release: one thread that runs ``model.generate()`` for the
requests in arrival order (SpecFit's per-model lock serialises the model anyway), with SpecFit's per-request
settings (the assistant, the seed set on this thread just before the call), batches of waiting non-streaming
requests (``batching.py``), the queue limit and context check (``admission.py``) and the counters (``ledger.py``).

The release seams (``seam_524.py``, ``seam_525.py``) adapt transformers' handlers to it: they hand it a ``Call``
(the request's inputs and its ``generate()`` settings, in the release's form: a ``generation_config`` or the
settings themselves) and, when it streams, a streamer.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from .admission import Queue, fitted_length
from .batching import Lines, batch_key, call_eos, eos_set, left_padded, pad_token, row_tokens
from .ledger import Ledger
from .requests import Refusal, Settings

logger = logging.getLogger("specfit.serve")


@dataclass(eq=False)
class Call:
    """One admitted request: ``inputs`` (``input_ids`` [1, T], ``attention_mask`` [1, T]), ``kwargs`` (its
    ``generate()`` settings), ``prompt`` tokens. ``started``: the model's thread took it (it runs, or ran);
    ``cancelled``: its client went away."""
    inputs: dict
    kwargs: dict
    settings: Settings
    prompt: int
    key: str | None = None
    streamer: object = None
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None
    started: bool = False
    released: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)


class Stopped(Exception):
    """Raised by a streamer's ``put`` once its request is cancelled: ``generate()`` stops there."""


def call_length(kwargs: dict) -> int:
    config = kwargs.get("generation_config")
    return config.max_new_tokens if config is not None else kwargs["max_new_tokens"]


def set_call_length(kwargs: dict, n: int) -> None:
    config = kwargs.get("generation_config")
    if config is not None:
        config.max_new_tokens = n
    else:
        kwargs["max_new_tokens"] = n


def _deliver(call: Call, result, error) -> None:
    """On the event loop: a request's result (or error), unless its client already went away."""
    if call.future.done():
        return
    if error is not None and not call.cancelled.is_set():
        call.future.set_exception(error)
    else:
        call.future.set_result(result)


class Engine:
    """One model behind the server: admission on the event loop, ``generate()`` on a thread of its own."""

    def __init__(self, model, tokenizer, *, default_assistant: str | None, max_queue: int, max_batch: int):
        import torch

        self.model, self.tokenizer = model, tokenizer
        self.runtime = getattr(model, "specfit", None)
        self.default_assistant = default_assistant
        self.queue = Queue(max_queue)
        self.lines = Lines(max_batch)
        self.ledger = Ledger()
        self.context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        # the threads set when the server was built (by the user or `specfit serve --threads`), the host lane's
        # included: set on this engine's thread for every call, whatever reset torch's count meanwhile (transformers
        # 5.25's serving sets one thread after loading a model on an accelerator; a new thread takes the count
        # current when it first runs torch)
        self.threads = torch.get_num_threads()
        self.call_threads: int | None = None  # the count the last call ran with, read on the engine's thread
        self.running = 0  # rows of the call in progress
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="specfit-serve", daemon=True)
        self.thread.start()

    # ----- on the event loop -----

    def admit(self, inputs: dict, kwargs: dict, settings: Settings) -> Call:
        """A request's ``Call``, its length fitted to the model's context; refused (``Refusal``) when it cannot fit
        or the queue is full."""
        prompt = int(inputs["input_ids"].shape[-1])
        set_call_length(kwargs, fitted_length(prompt, call_length(kwargs), self.context, settings.max_tokens_field))
        if settings.assistant is not None and self.runtime is None:
            raise Refusal(400, f"assistant {settings.assistant!r} needs a model enabled by SpecFit "
                               f"(specfit.enable); this one decodes plainly only (assistant: null)")
        self.queue.admit()
        return Call(inputs, kwargs, settings, prompt)

    async def generate(self, call: Call) -> list[int]:
        """A non-streaming request's new tokens. Batched with the requests waiting with equal settings; not run at
        all when its client goes away before it starts."""
        loop = asyncio.get_running_loop()
        call.loop, call.future = loop, loop.create_future()
        if self.lines.max_batch > 1:
            call.key = batch_key(call.kwargs, call.settings.assistant, call.settings.seed)
        if call.key is None:
            self._jobs.put(("one", call))
        else:
            self.lines.add(call.key, call)
            self._jobs.put(("drain", call.key))  # a drain: it may find this request already taken
        try:
            return await call.future
        except asyncio.CancelledError:
            self.abandon(call)
            raise

    def stream(self, call: Call, streamer) -> asyncio.Future:
        """Queue a streaming request (``streamer`` receives its tokens); the future resolves when it ends."""
        loop = asyncio.get_running_loop()
        call.loop, call.future, call.streamer = loop, loop.create_future(), streamer
        self._jobs.put(("one", call))
        return call.future

    def abandon(self, call: Call) -> None:
        """The request's client went away: a waiting request is not run (its place frees now); a running one stops
        at its streamer's next token, or runs to its end when it does not stream."""
        call.cancelled.set()
        if call.key is not None:
            waiting = self.lines.drop(call.key, call)
        else:
            with self._lock:
                waiting = not call.started
        if waiting:
            self.ledger.left_waiting()
            self._release(call)

    def summary(self) -> dict:
        totals = self.ledger.summary()
        running = self.running
        totals["queue"] = {"running": running, "waiting": max(0, self.queue.pending - running),
                           "max_queue": self.queue.limit, "max_batch": self.lines.max_batch}
        totals["threads"] = self.call_threads
        totals["link"] = None if self.runtime is None else self.runtime.link_label
        totals["assistant"] = self.default_assistant
        return totals

    def close(self) -> None:
        self._jobs.put(None)

    # ----- on the model's thread -----

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, target = job
            try:
                self._run_one(target) if kind == "one" else self._run_batch(target)
            except BaseException:  # noqa: BLE001 - the thread serves on; the request already heard why
                logger.exception("specfit serve: a call failed outside generate()")

    def _release(self, call: Call) -> None:
        with self._lock:
            if call.released:
                return
            call.released = True
        self.queue.release()

    def _settle(self, call: Call, result, error) -> None:
        try:
            call.loop.call_soon_threadsafe(_deliver, call, result, error)
        except RuntimeError:  # the server's event loop is closed: nobody waits
            pass

    def _on_device(self, inputs: dict) -> dict:
        device = self.model.device
        return {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}

    def _generate(self, inputs: dict, call: Call, streamer=None):
        import torch

        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        self.call_threads = torch.get_num_threads()
        kwargs = {**inputs, **call.kwargs, "tokenizer": self.tokenizer}
        if streamer is not None:
            kwargs["streamer"] = streamer
        if self.runtime is not None:
            kwargs["assistant"] = call.settings.assistant
        return self.model.generate(**kwargs)

    def _record(self, calls: list[Call], outputs: list[list[int]]) -> None:
        if self.runtime is not None:
            self.ledger.record(self.runtime, [(c.settings.request_id, c.settings.assistant, c.prompt, len(out))
                                              for c, out in zip(calls, outputs)])

    def _run_one(self, call: Call) -> None:
        import torch

        with self._lock:
            if call.cancelled.is_set():  # its client left while it waited: released by abandon()
                return
            call.started = True
        self.running = 1
        try:
            if call.settings.seed is not None:
                torch.manual_seed(call.settings.seed)  # on this thread, just before the request's own call
            inputs = self._on_device(call.inputs)
            sequences = self._generate(inputs, call, call.streamer)
            tokens = sequences[0, inputs["input_ids"].shape[-1]:].tolist()
            self._record([call], [tokens])
            self._settle(call, tokens, None)
        except Exception as error:  # the request hears why (a cancelled one: nobody listens); the thread serves on
            self._settle(call, None, error)
        finally:
            self.running = 0
            self._release(call)

    def _run_batch(self, key: str) -> None:
        """Up to ``max_batch`` waiting requests of one line in one left-padded call; each gets its own row (its new
        tokens through its first end-of-sequence token)."""
        taken = self.lines.take(key)
        if not taken:  # an earlier drain took them
            return
        self.running = len(taken)
        first = taken[0]  # the line's settings: equal for every request in it
        try:
            eos = eos_set(call_eos(first.kwargs, self.model.generation_config))
            rows = [self._on_device(c.inputs) for c in taken]
            inputs = rows[0] if len(rows) == 1 else left_padded(
                rows, pad_token(first.kwargs, self.tokenizer, self.model.generation_config, eos))
            sequences = self._generate(inputs, first)
            width = inputs["input_ids"].shape[-1]
            outputs = [sequences[0, width:].tolist()] if len(rows) == 1 else [
                row_tokens(sequences[b, width:], eos) for b in range(len(rows))]
            self._record(taken, outputs)
            for call, tokens in zip(taken, outputs):
                self._settle(call, tokens, None)
        except Exception as error:  # every request of the batch hears why; the thread serves on
            for call in taken:
                self._settle(call, None, error)
        finally:
            self.running = 0
            for call in taken:
                self._release(call)
