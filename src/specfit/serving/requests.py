"""A request's body checked before anything runs, the same on every transformers release: what the server cannot
honour is a 4xx naming the field (never a 500, never silently ignored), and the fields SpecFit honours itself
(``assistant``, ``seed``, ``top_k`` and the sampling switch) are read into ``Settings``.

Pure rules: no torch, no transformers. ``parse`` raises ``Refusal`` (the handlers turn it into an HTTP answer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# fields the server takes out of the body and honours itself (transformers' schema has no top_k or assistant; its
# seed handling sets the seed on the wrong thread in 5.24)
OURS = ("assistant", "seed", "top_k")

# (field, what the server can take, why): fields of the OpenAI schema transformers accepts and ignores. Each changes
# the answer or its shape, so a value other than the harmless one is refused rather than ignored.
NOT_HONOURED = {
    "n": ("1", "this server returns one choice per request: send the request n times"),
    "best_of": ("1", "this server returns one choice per request"),
    "logprobs": ("false or null", "this server returns no log-probabilities"),
    "top_logprobs": ("null", "this server returns no log-probabilities"),
    "echo": ("false or null", "the reply never repeats the prompt"),
    "presence_penalty": ("0 or null", "no presence penalty is applied (frequency_penalty is)"),
    "response_format": ('{"type": "text"} or null', "no structured output is enforced"),
    "prediction": ("null", "predicted outputs are not used"),
    "audio": ("null", "the model generates text only"),
    "modalities": ('["text"] or null', "the model generates text only"),
    "reasoning_effort": ("null", "no reasoning effort is applied"),
    "web_search_options": ("null", "the server has no web search"),
    "functions": ("null", "use tools"),
    "function_call": ("null", "use tools"),
    "tool_choice": ('"auto" or null', "tool use is left to the model"),
}

HARMLESS = {"n": (1,), "best_of": (1,), "logprobs": (False, 0), "echo": (False,), "presence_penalty": (0, 0.0),
            "response_format": ({"type": "text"},), "modalities": (["text"],), "tool_choice": ("auto",)}

# the length fields of each endpoint, in transformers' order: the first one given is the one it reads
MAX_TOKEN_FIELDS = {"chat": ("max_completion_tokens", "max_tokens"), "completion": ("max_tokens",),
                    "response": ("max_output_tokens",)}


class Refusal(Exception):
    """A request the server answers with ``status`` and ``message`` (a 4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Settings:
    """What SpecFit honours of one request. ``assistant``: the decoding (None: plain), the server's default when the
    request names none. ``max_tokens_field``: the length field the request set (None: the server's default length,
    fitted to the context)."""
    assistant: str | None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens_field: str | None = None
    request_id: str = ""


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_input(body: dict, kind: str) -> None:
    """The prompt of the endpoint: chat ``messages`` (a non-empty list of messages with a role), completion
    ``prompt`` (a non-empty string), response ``input`` (present, not empty)."""
    if kind == "chat":
        if "messages" not in body:
            raise Refusal(400, "messages is required: a non-empty list of messages such as "
                               '[{"role": "user", "content": "..."}]')
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise Refusal(400, f"messages must be a non-empty list of messages such as "
                               f'[{{"role": "user", "content": "..."}}], got {json.dumps(messages)[:80]}')
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise Refusal(400, f"messages[{i}] must be an object with a role (and content), got "
                                   f"{json.dumps(message)[:80]}")
    elif kind == "completion":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise Refusal(400, f"prompt must be a non-empty string (one prompt per request), got "
                               f"{json.dumps(prompt)[:80]}")
    elif body.get("input") in (None, "", []):
        raise Refusal(400, "input is required: a string or a non-empty list of input items")


def check_not_honoured(body: dict) -> None:
    for name, (allowed, why) in NOT_HONOURED.items():
        value = body.get(name)
        if value is None or value in HARMLESS.get(name, ()):
            continue
        raise Refusal(400, f"{name}={json.dumps(value)} is not supported: {why} (send {allowed})")


def check_lengths(body: dict, kind: str) -> str | None:
    given = None
    for name in MAX_TOKEN_FIELDS[kind]:
        value = body.get(name)
        if value is None:
            continue
        if not _integer(value) or value < 1:
            raise Refusal(400, f"{name} must be an integer >= 1 (new tokens at most), got {json.dumps(value)}")
        given = given or name
    return given


def check_sampling(body: dict) -> tuple[float | None, float | None, int | None]:
    temperature, top_p, top_k = body.get("temperature"), body.get("top_p"), body.get("top_k")
    if temperature is not None and (not _number(temperature) or temperature < 0):
        raise Refusal(400, f"temperature must be a number >= 0 (0: greedy), got {json.dumps(temperature)}")
    if top_p is not None and (not _number(top_p) or not 0 < top_p <= 1):
        raise Refusal(400, f"top_p must be a number in (0, 1], got {json.dumps(top_p)}")
    if top_k is not None and (not _integer(top_k) or top_k < 0):
        raise Refusal(400, f"top_k must be an integer >= 0 (0: no top-k cut), got {json.dumps(top_k)}")
    return temperature, top_p, top_k


def check_assistant(body: dict, default: str | None, known) -> str | None:
    if "assistant" not in body:
        return default
    name = body["assistant"]
    if name is None or name == "none":
        return None
    if not isinstance(name, str) or name not in known:
        raise Refusal(400, f"assistant {json.dumps(name)} is not one of {sorted(known)} (or \"none\" / null: plain "
                           f"decoding)")
    return name


def parse(body: dict, kind: str, default_assistant: str | None, known_assistants) -> tuple[Settings, dict]:
    """``(settings, body)``: the request's settings, and the body without SpecFit's own fields (``OURS``), for
    transformers' handler. Raises ``Refusal`` on anything the server cannot honour."""
    if not isinstance(body, dict):
        raise Refusal(400, "the request body must be a JSON object")
    check_input(body, kind)
    check_not_honoured(body)
    length_field = check_lengths(body, kind)
    temperature, top_p, top_k = check_sampling(body)
    seed = body.get("seed")
    if seed is not None and not _integer(seed):
        raise Refusal(400, f"seed must be an integer, got {json.dumps(seed)}")
    if body.get("generation_config") is not None:
        try:
            extra = json.loads(body["generation_config"])
        except (TypeError, ValueError) as error:
            raise Refusal(400, f"generation_config must be a JSON object as a string: {error}") from None
        for name in ("seed", "assistant"):
            if isinstance(extra, dict) and name in extra:
                raise Refusal(400, f"generation_config sets {name!r}: send it as the request's own field {name!r}")
    settings = Settings(assistant=check_assistant(body, default_assistant, known_assistants), seed=seed,
                        temperature=temperature, top_p=top_p, top_k=top_k, max_tokens_field=length_field)
    return settings, {k: v for k, v in body.items() if k not in OURS}


def sampling(settings: Settings) -> dict:
    """The generation settings a request's sampling fields set: {} when it sets none (the model's generation config
    decides, as in transformers); temperature 0 is greedy whatever else is set; any other temperature, top_p or
    top_k samples (``do_sample=True``: transformers' handlers never set it, so such requests decoded greedily)."""
    if settings.temperature is not None and settings.temperature == 0:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    asked = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k}
    asked = {name: value for name, value in asked.items() if value is not None}
    if not asked:
        return {}
    if "temperature" in asked:
        asked["temperature"] = float(asked["temperature"])
    return {"do_sample": True, **asked}
