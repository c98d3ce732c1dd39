"""The server's rules without a server (specfit.serving.requests, admission, streams, ledger): what a request body may
hold, how its sampling fields set the generation, the context check and queue limit, the reply stream stripped as
the whole reply is, a streamer that counts every token of a put, and the counters' ways and totals."""

import asyncio
from types import SimpleNamespace

import pytest

from specfit.serving.admission import Queue, fitted_length
from specfit.serving.ledger import STATS_KEPT, Ledger, ways_of
from specfit.serving.requests import Refusal, parse, sampling
from specfit.serving.streams import ReplyQueue, content_strips

KNOWN = {"specfit", "eagle3"}
CHAT = {"model": "specfit", "messages": [{"role": "user", "content": "hi"}]}


def refused(body, kind="chat"):
    with pytest.raises(Refusal) as caught:
        parse(body, kind, "specfit", KNOWN)
    return caught.value


@pytest.mark.parametrize("body,status,words", [
    ({"model": "specfit"}, 400, "messages is required"),
    ({"model": "specfit", "messages": []}, 400, "messages must be a non-empty list"),
    ({"model": "specfit", "messages": "hi"}, 400, "messages must be a non-empty list"),
    ({"model": "specfit", "messages": [{"content": "hi"}]}, 400, "messages[0]"),
    ({**CHAT, "n": 2}, 400, "n=2"),
    ({**CHAT, "logprobs": True}, 400, "logprobs"),
    ({**CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ({**CHAT, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({**CHAT, "max_tokens": 0}, 400, "max_tokens must be an integer >= 1"),
    ({**CHAT, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ({**CHAT, "max_tokens": 2.5}, 400, "max_tokens"),
    ({**CHAT, "temperature": -1}, 400, "temperature"),
    ({**CHAT, "temperature": "hot"}, 400, "temperature"),
    ({**CHAT, "top_p": 0}, 400, "top_p"),
    ({**CHAT, "top_p": 1.5}, 400, "top_p"),
    ({**CHAT, "top_k": -1}, 400, "top_k"),
    ({**CHAT, "top_k": 2.0}, 400, "top_k"),
    ({**CHAT, "seed": "7"}, 400, "seed"),
    ({**CHAT, "seed": True}, 400, "seed"),
    ({**CHAT, "assistant": "medusa"}, 400, "medusa"),
    ({**CHAT, "generation_config": '{"seed": 3}'}, 400, "seed"),
    ({**CHAT, "generation_config": "{not json"}, 400, "generation_config"),
])
def test_a_body_the_server_cannot_honour_is_refused_naming_the_field(body, status, words):
    refusal = refused(body)
    assert refusal.status == status and words in refusal.message


def test_the_other_endpoints_prompts_and_lengths():
    assert "prompt must be a non-empty string" in refused({"model": "specfit"}, "completion").message
    assert "prompt" in refused({"model": "specfit", "prompt": ["a", "b"]}, "completion").message
    assert "echo" in refused({"model": "specfit", "prompt": "a", "echo": True}, "completion").message
    assert "best_of" in refused({"model": "specfit", "prompt": "a", "best_of": 3}, "completion").message
    assert "logprobs" in refused({"model": "specfit", "prompt": "a", "logprobs": 2}, "completion").message
    assert "input is required" in refused({"model": "specfit"}, "response").message
    assert "max_output_tokens" in refused({"model": "specfit", "input": "a", "max_output_tokens": 0},
                                          "response").message


def test_spec_fit_fields_are_read_and_taken_out_of_the_body():
    body = {**CHAT, "assistant": "eagle3", "seed": 5, "top_k": 3, "temperature": 0.5, "top_p": 0.9, "n": 1,
            "logprobs": False, "max_tokens": 4}
    settings, rest = parse(body, "chat", "specfit", KNOWN)
    assert (settings.assistant, settings.seed, settings.top_k, settings.temperature, settings.top_p) == \
        ("eagle3", 5, 3, 0.5, 0.9)
    assert settings.max_tokens_field == "max_tokens"
    assert not {"assistant", "seed", "top_k"} & set(rest) and rest["temperature"] == 0.5
    assert parse(CHAT, "chat", "specfit", KNOWN)[0].assistant == "specfit"  # the server's default
    assert parse(CHAT, "chat", None, KNOWN)[0].assistant is None
    for plain in (None, "none"):
        assert parse({**CHAT, "assistant": plain}, "chat", "specfit", KNOWN)[0].assistant is None
    assert parse(CHAT, "chat", "specfit", KNOWN)[0].max_tokens_field is None
    both = {**CHAT, "max_tokens": 4, "max_completion_tokens": 9}  # transformers reads max_completion_tokens
    assert parse(both, "chat", "specfit", KNOWN)[0].max_tokens_field == "max_completion_tokens"
    prompt = {"model": "specfit", "prompt": "a", "max_tokens": 3}
    assert parse(prompt, "completion", "specfit", KNOWN)[0].max_tokens_field == "max_tokens"
    assert parse({"model": "specfit", "input": "a", "max_output_tokens": 3}, "response", "specfit",
                 KNOWN)[0].max_tokens_field == "max_output_tokens"


def test_sampling_fields_sample_and_temperature_zero_is_greedy():
    def of(**fields):
        return sampling(parse({**CHAT, **fields}, "chat", "specfit", KNOWN)[0])

    assert of() == {}  # the model's generation config decides
    assert of(temperature=0.8) == {"do_sample": True, "temperature": 0.8}
    assert of(temperature=1, top_p=0.9, top_k=5) == {"do_sample": True, "temperature": 1.0, "top_p": 0.9,
                                                       "top_k": 5}
    assert of(top_k=5) == {"do_sample": True, "top_k": 5}
    assert of(top_p=0.5) == {"do_sample": True, "top_p": 0.5}
    assert of(temperature=0, top_p=0.5) == {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}


def test_the_context_check_and_the_queue_limit():
    assert fitted_length(10, 8, 1024, None) == 8
    assert fitted_length(1023, 1024, 1024, None) == 1  # one token shorter than the context: admitted, fitted
    assert fitted_length(1000, 1024, 1024, None) == 24
    assert fitted_length(5, 4096, None, None) == 4096
    for prompt in (1024, 1025):
        with pytest.raises(Refusal, match="the model's context is 1024 tokens") as caught:
            fitted_length(prompt, 1, 1024, None)
        assert caught.value.status == 400
    with pytest.raises(Refusal, match="max_tokens 30 .* ask for at most 24"):
        fitted_length(1000, 30, 1024, "max_tokens")
    assert fitted_length(1000, 24, 1024, "max_tokens") == 24
    queue = Queue(2)
    queue.admit()
    queue.admit()
    with pytest.raises(Refusal, match="queue is full") as caught:
        queue.admit()
    assert caught.value.status == 429
    queue.release()
    queue.admit()
    with pytest.raises(ValueError, match="max_queue must be an integer >= 1"):
        Queue(0)


def strip_stream(chunks, strip=True):
    async def run():
        queue = ReplyQueue(strip)
        for chunk in chunks:
            queue.put_nowait(chunk)
        queue.put_nowait(None)
        out = []
        while (item := queue.get_nowait()) is not None:
            out.append(item)
        return out

    return asyncio.run(run())


def test_a_reply_stream_is_stripped_as_the_whole_reply_is():
    chunks = [" ", " They", " get", " 36", " ", "apples.", "\n", " "]
    assert "".join(strip_stream(chunks)) == "".join(chunks).strip() == "They get 36 apples."
    assert "".join(strip_stream(chunks, strip=False)) == "".join(chunks)
    assert strip_stream(["\n", "  "]) == []
    assert "".join(strip_stream(["a", "  ", "\n", "b "])) == "a  \nb"  # inner whitespace kept, in order
    plain = {"fields": {"content": {"content": "text"}}}
    assert content_strips(plain) and not content_strips(None)
    assert not content_strips({"fields": {"content": {"content": "text", "content_args": {"strip": False}}}})
    assert not content_strips({"fields": {"content": {"content": "json"}}})


def test_a_streamer_counts_every_token_of_a_put_and_stops_a_cancelled_call():
    torch = pytest.importorskip("torch")
    from specfit.serving.engine import Call, Stopped
    from specfit.serving.requests import Settings
    from specfit.serving.streams import TokenStreamer

    call = Call({}, {}, Settings(assistant=None), 3)
    got = []
    streamer = TokenStreamer(call, got.extend)
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt
    streamer.put(torch.tensor([[6, 7, 8]]))  # an assistant's accepted chunk: three tokens
    streamer.put(torch.tensor([9]))  # plain decoding's one token
    assert got == [6, 7, 8, 9]
    call.cancelled.set()
    with pytest.raises(Stopped):
        streamer.put(torch.tensor([[10]]))


def counters(**fields):
    base = dict(cycles=10, guard_eagle_cycles=2, plain_cycles=3, prefill_seconds=0.5, decode_seconds=1.5,
                tokens_per_cycle=2.0, copies=8, host_experts=4, hit_rate=0.75, demand=40, hits=30,
                copy_busy_seconds=0.08)
    base.update(fields)
    return SimpleNamespace(**base)


def test_ways_split_a_calls_cycles_by_how_they_ran():
    c = counters()
    assert ways_of(c, "specfit") == {"specfit": 5, "eagle3": 2, "plain": 3}
    assert ways_of(c, "eagle3") == {"specfit": 0, "eagle3": 7, "plain": 3}
    assert ways_of(c, "ar") == {"specfit": 0, "eagle3": 0, "plain": 10}
    older = SimpleNamespace(cycles=4, guard_eagle_cycles=1)  # a Counters without plain_cycles
    assert ways_of(older, "specfit") == {"specfit": 3, "eagle3": 1, "plain": 0}


def test_the_ledger_counts_requests_own_tokens_and_keeps_the_last_1024():
    ledger = Ledger()
    runtime = SimpleNamespace(stats=SimpleNamespace(last_generate=counters(), last_method="specfit"))
    ledger.record(runtime, [("a", "specfit", 10, 3), ("b", "specfit", 12, 5)])  # a batch of two rows
    a = ledger.get("a")
    assert a["tokens"] == 3 and a["batch"] == 2 and a["call_tokens"] == 8 and a["call"] == 1
    assert a["tokens_per_second"] == pytest.approx(8 / 2.0) and a["copies_per_token"] == pytest.approx(1.0)
    assert a["ways"] == {"specfit": 5, "eagle3": 2, "plain": 3} and ledger.get("b")["tokens"] == 5
    t = ledger.summary()
    assert (t["requests"], t["tokens"], t["prompt_tokens"], t["calls"], t["batched_calls"]) == (2, 8, 22, 1, 1)
    assert t["hit_rate"] == pytest.approx(0.75) and t["host_experts_per_token"] == pytest.approx(0.5)
    assert t["ms_per_copy"] == pytest.approx(10.0) and t["ways"] == {"specfit": 5, "eagle3": 2, "plain": 3}
    for i in range(STATS_KEPT):
        ledger.record(runtime, [(f"r{i}", None, 1, 1)])
    assert ledger.get("a") is None and ledger.get("r0") is not None and ledger.get(f"r{STATS_KEPT - 1}")
    assert ledger.summary()["calls"] == STATS_KEPT + 1
    assert ledger.summary()["batched_calls"] == 1  # a call of one request is not a batch
    assert ledger.get("r0")["batch"] == 1
