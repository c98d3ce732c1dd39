"""`specfit serve` through the real `openai` client against a server on 127.0.0.1 (a free port, one per module,
stopped at the end), on the installed transformers release (5.24 or 5.25): greedy answers equal plain generate()
token for token; sampling samples, with every assistant, and repeats per seed; streamed text and usage equal the
non-streamed ones; 8 concurrent clients x 3 requests each get the answer the request gets alone; every bad request
a 4xx naming the field within a second, the connection and server still serving; the counters and totals."""

import concurrent.futures
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")

from specfit import embedded  # noqa: E402
from specfit.serving import Server, build_app  # noqa: E402
from specfit.serving.templates import PLAIN_TEMPLATE  # noqa: E402

QUESTIONS = ["Tom has 3 boxes with 12 apples in each box. How many apples does he have?",
             "A train travels 60 km in one hour. How far does it travel in 3 hours?",
             "Sara buys 4 notebooks at 3 dollars each. How much does she pay?",
             "A class has 28 students. Half of them play football. How many play football?",
             "What is 7 times 8?", "Anna reads 12 pages a day. How many pages does she read in a week?",
             "A shop sells 5 pens for 10 dollars. What does one pen cost?", "What is 100 minus 37?"]


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(1)
    model, tokenizer = embedded.load(32)  # no emulated link: the tests check outputs, not speed
    server = Server(build_app(model, tokenizer, max_queue=16), host="127.0.0.1", port=0).start()
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    yield model, tokenizer, server, client
    server.stop()
    assert not server.thread.is_alive()


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def alone(model, tokenizer, prompt: str, n: int, seed=None, assistant=None, **sampling) -> list[int]:
    """What generate() returns for the prompt alone: plain greedy by default (the tokens every assistant must
    reproduce), or sampled after torch.manual_seed(seed) as the server seeds a request; through its end token."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if seed is not None:
        torch.manual_seed(seed)
    kw = dict(do_sample=True, **sampling) if sampling else dict(do_sample=False)
    if assistant is not None:
        kw["assistant"] = assistant
    tokens = model.generate(ids, max_new_tokens=n, **kw)[0, ids.shape[1]:].tolist()
    return tokens[:tokens.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in tokens else tokens


def reply_text(tokenizer, tokens) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()  # a chat reply, stripped


def ask(client, question, **kw):
    return client.chat.completions.create(model="specfit", messages=[{"role": "user", "content": question}], **kw)


def streamed(client, question, **kw):
    chunks = list(ask(client, question, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, usage[-1], finish[-1], chunks[0].id


def test_plain_template_renders_the_trained_prompt_format(served):
    _, tokenizer, _, _ = served
    assert tokenizer.chat_template == PLAIN_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        "Be brief.\nQuestion: What is 2+2?\nAnswer:"


def test_greedy_chat_equals_generate_and_the_stream_equals_the_reply(served):
    model, tokenizer, server, client = served
    for question, n in ((QUESTIONS[0], 16), (QUESTIONS[4], 64)):  # 64: the reply ends with its end token
        expected = alone(model, tokenizer, chat_prompt(tokenizer, question), n)
        reply = ask(client, question, max_tokens=n, temperature=0)
        assert reply.choices[0].message.content == reply_text(tokenizer, expected)
        assert reply.usage.completion_tokens == len(expected)
        assert reply.usage.prompt_tokens == len(tokenizer(chat_prompt(tokenizer, question)).input_ids)
        stats = reply.model_extra["specfit"]
        assert stats["method"] == "specfit" and stats["tokens"] == len(expected) and stats["cycles"] >= 1
        assert stats["tokens_per_second"] > 0 and stats["tokens_per_cycle"] >= 1 and stats["copies_per_token"] >= 0
        assert sum(stats["ways"].values()) == stats["cycles"]
        text, usage, finish, stream_id = streamed(client, question, max_tokens=n, temperature=0)
        assert text == reply.choices[0].message.content  # exactly: no leading space in the stream
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
            (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens)
        assert finish == reply.choices[0].finish_reason == ("length" if len(expected) == n else "stop")
        side = httpx.get(f"{server.url}/specfit/stats/{stream_id}").json()  # the side route, for streamed ones
        assert side["method"] == "specfit" and side["tokens"] == len(expected) and side["batch"] == 1


def test_completions_and_plain_decoding_on_request(served):
    model, tokenizer, server, client = served
    prompt = f"Question: {QUESTIONS[4]}\nAnswer:"
    expected = tokenizer.decode(alone(model, tokenizer, prompt, 12), skip_special_tokens=True)
    for assistant, method in (("specfit", "specfit"), ("eagle3", "eagle3"), (None, "ar"), ("none", "ar")):
        reply = client.completions.create(model="specfit", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"assistant": assistant})
        assert reply.choices[0].text == expected
        assert reply.model_extra["specfit"]["method"] == method  # what the call really ran
        stats = reply.model_extra["specfit"]
        assert sum(stats["ways"].values()) == stats["cycles"] >= 1  # every cycle ran one way
        if method != "specfit":  # SpecFit's guard may run a cycle any of the three ways; the others run their own
            assert stats["ways"]["plain" if method == "ar" else "eagle3"] >= 1 and stats["ways"]["specfit"] == 0
    chunks = list(client.completions.create(model="specfit", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected  # raw text: exactly equal
    assert [c.usage.completion_tokens for c in chunks if c.usage][-1] == reply.usage.completion_tokens


@pytest.mark.parametrize("assistant", ["specfit", "eagle3", None])
def test_sampling_samples_repeats_per_seed_and_differs_across_seeds(served, assistant):
    model, tokenizer, _, client = served
    question = QUESTIONS[1]
    settings = dict(max_tokens=12, temperature=1.0, top_p=0.95, extra_body={"assistant": assistant, "top_k": 40})
    texts = {seed: ask(client, question, seed=seed, **settings).choices[0].message.content for seed in (0, 1, 2)}
    assert ask(client, question, seed=1, **settings).choices[0].message.content == texts[1]
    assert len(set(texts.values())) >= 2, texts  # different seeds draw different texts
    greedy = reply_text(tokenizer, alone(model, tokenizer, chat_prompt(tokenizer, question), 12))
    assert any(text != greedy for text in texts.values()), texts  # temperature 1 samples
    # exactly what the request's own generate() call draws after torch.manual_seed(seed): every setting honoured,
    # seed 0 too (a seed, not "no seed")
    for seed in (0, 2):
        expected = alone(model, tokenizer, chat_prompt(tokenizer, question), 12, seed=seed, assistant=assistant,
                         temperature=1.0, top_p=0.95, top_k=40)
        assert texts[seed] == reply_text(tokenizer, expected), seed
    # top_k=1 keeps only the likeliest token: greedy text at any temperature (top_k is honoured, not ignored)
    assert ask(client, question, seed=4, max_tokens=12, temperature=1.5,
               extra_body={"assistant": assistant, "top_k": 1}).choices[0].message.content == greedy


def test_a_sampled_stream_equals_the_reply_for_its_seed(served):
    _, _, _, client = served
    for question in QUESTIONS[2:4]:
        kw = dict(max_tokens=20, temperature=0.9, seed=11)
        reply = ask(client, question, **kw)
        text, usage, finish, _ = streamed(client, question, **kw)
        assert text == reply.choices[0].message.content
        assert usage.completion_tokens == reply.usage.completion_tokens and finish == reply.choices[0].finish_reason


def test_stop_strings_cut_the_reply_and_finish_it(served):
    model, tokenizer, _, client = served
    greedy = reply_text(tokenizer, alone(model, tokenizer, chat_prompt(tokenizer, QUESTIONS[1]), 16))
    stop = greedy.split()[1]  # the second word of the greedy answer
    for stream in (False, True):
        if stream:
            text, _, finish, _ = streamed(client, QUESTIONS[1], max_tokens=16, temperature=0, stop=[stop])
        else:
            cut = ask(client, QUESTIONS[1], max_tokens=16, temperature=0, stop=[stop])
            text, finish = cut.choices[0].message.content, cut.choices[0].finish_reason
        assert text.endswith(stop) and greedy.startswith(text) and len(text) < len(greedy), (stream, text)
        assert finish == "stop"


def test_eight_clients_three_requests_each_get_the_answer_they_get_alone(served):
    model, tokenizer, server, _ = served
    lengths = (2, 3, 4)
    greedy = {q: alone(model, tokenizer, chat_prompt(tokenizer, q), max(lengths)) for q in QUESTIONS}
    expected = {(q, n): reply_text(tokenizer, greedy[q][:n]) for q in QUESTIONS for n in lengths}
    sampled = {q: reply_text(tokenizer, alone(model, tokenizer, chat_prompt(tokenizer, q), 3, seed=9,
                                              assistant="specfit", temperature=0.8)) for q in QUESTIONS[:2]}

    def client_run(question):
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
        got = []
        for n in lengths:
            reply = ask(client, question, max_tokens=n, temperature=0)
            got.append(((question, n), reply.choices[0].message.content, reply.id))
        if question in sampled:  # a seeded request among them runs alone: its seed's text
            reply = ask(client, question, max_tokens=3, temperature=0.8, seed=9)
            got.append((question, reply.choices[0].message.content, reply.id))
        return got

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(client_run, QUESTIONS) for r in rs]
    assert len(results) == 26 and len({r[2] for r in results}) == 26  # none lost, each its own id
    for key, text, _ in results:
        assert text == (sampled[key] if isinstance(key, str) else expected[key]), key  # none crossed


def test_requests_that_wait_together_run_as_one_batch_and_each_gets_its_own_row(served):
    """Five non-streaming clients at once, 20 tokens each: the server (max_batch 4) runs the ones that wait together
    as one left-padded call; each answer equals plain greedy generate() on its own prompt, usage counts its own row,
    and the counters say how many rows shared the call."""
    model, tokenizer, server, _ = served
    questions = QUESTIONS[:5]
    expected = {q: alone(model, tokenizer, chat_prompt(tokenizer, q), 20) for q in questions}

    def one(question):
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
        return question, ask(client, question, max_tokens=20, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        replies = list(pool.map(one, questions))
    calls = {}
    for question, reply in replies:
        assert reply.choices[0].message.content == reply_text(tokenizer, expected[question]), question
        assert reply.usage.completion_tokens == len(expected[question])
        stats = reply.model_extra["specfit"]
        assert stats["tokens"] == len(expected[question]) and stats["method"] == "specfit"
        calls.setdefault(stats["call"], []).append(stats)
    assert max(len(rows) for rows in calls.values()) > 1, calls  # at least two requests shared a call
    for rows in calls.values():  # a call of k rows answered k of these requests, and says so
        assert all(r["batch"] == len(rows) <= 4 for r in rows)
        assert all(r["call_tokens"] == sum(x["tokens"] for x in rows) for r in rows)


BAD = [  # (body or raw bytes, status, words of the message)
    (b'{"model": "specfit", "messages": [', 422, "json"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 400, "gpt-4"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "two " * 1100}], "max_tokens": 4}, 400,
     "context"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1020}, 400, "context"),
    ({"model": "specfit", "messages": []}, 400, "messages"),
    ({"model": "specfit"}, 400, "messages"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n=2"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, 400,
     "temperature"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "top_k": -2}, 400, "top_k"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "assistant": "medusa"}, 400, "medusa"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop_me": 1}, 422,
     "stop_me"),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[
    "malformed-json", "unknown-model", "negative-max-tokens", "zero-max-tokens", "prompt-past-context",
    "max-tokens-past-context", "empty-messages", "no-messages", "n-2", "logprobs", "negative-temperature",
    "negative-top-k", "unknown-assistant", "unknown-field"])
def test_bad_request_gets_4xx_and_the_connection_keeps_serving(served, body, status, words):
    _, _, server, _ = served
    url = f"{server.url}/chat/completions"
    with httpx.Client(timeout=30) as http:  # one keep-alive connection: the bad request must not close it
        started = time.perf_counter()
        if isinstance(body, bytes):
            answer = http.post(url, content=body, headers={"content-type": "application/json"})
        else:
            answer = http.post(url, json=body)
        assert time.perf_counter() - started <= 1.0
        assert answer.status_code == status, answer.text
        assert words in answer.text.lower()
        assert answer.headers.get("connection", "").lower() != "close"
        reply = http.post(url, json={"model": "specfit", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


def test_top_k_and_assistant_none_are_accepted(served):
    model, tokenizer, _, client = served
    reply = ask(client, QUESTIONS[7], max_tokens=6, temperature=0, extra_body={"top_k": 5, "assistant": "none"})
    assert reply.model_extra["specfit"]["method"] == "ar" and reply.model_extra["specfit"]["assistant"] is None
    assert reply.choices[0].message.content == reply_text(
        tokenizer, alone(model, tokenizer, chat_prompt(tokenizer, QUESTIONS[7]), 6))


def test_totals_since_start_and_the_stats_limit(served):
    _, _, server, client = served
    before = httpx.get(f"{server.url}/specfit/stats").json()
    replies = [ask(client, q, max_tokens=5, temperature=0, extra_body={"assistant": a})
               for q, a in ((QUESTIONS[5], "specfit"), (QUESTIONS[6], "eagle3"), (QUESTIONS[6], None))]
    after = httpx.get(f"{server.url}/specfit/stats").json()
    assert after["requests"] - before["requests"] == 3
    assert after["tokens"] - before["tokens"] == sum(r.usage.completion_tokens for r in replies)
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(r.usage.prompt_tokens for r in replies)
    for way in ("specfit", "eagle3", "plain"):
        assert after["ways"][way] - before["ways"][way] == sum(r.model_extra["specfit"]["ways"][way]
                                                               for r in replies), way
    # plain decoding: a cycle per token after the prefill's
    assert after["ways"]["plain"] - before["ways"]["plain"] >= replies[2].usage.completion_tokens - 1
    assert 0 < after["hit_rate"] <= 1 and after["tokens_per_second"] > 0 and after["copies_per_token"] >= 0
    assert after["host_experts_per_token"] >= 0 and after["busy_seconds"] > before["busy_seconds"]
    assert after["tokens_per_second"] == pytest.approx(after["tokens"] / after["busy_seconds"])
    assert after["queue"] == {"running": 0, "waiting": 0, "max_queue": 16, "max_batch": 4}
    assert after["threads"] == 1 and after["link"] == "real copies"  # the module's torch.set_num_threads(1)
    missing = httpx.get(f"{server.url}/specfit/stats/no-such-request")
    assert missing.status_code == 404 and "last 1024" in missing.text


def test_the_responses_endpoint_decodes_with_the_request_settings(served):
    model, tokenizer, server, _ = served
    body = {"model": "specfit", "input": QUESTIONS[4], "max_output_tokens": 6, "temperature": 0, "stream": False,
            "assistant": "eagle3"}
    answer = httpx.post(f"{server.url}/responses", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["specfit"]["method"] == "eagle3" and data["specfit"]["tokens"] == 6
    assert data["output"][0]["content"][0]["text"] == reply_text(
        tokenizer, alone(model, tokenizer, chat_prompt(tokenizer, QUESTIONS[4]), 6))
    for bad, words in (({**body, "max_output_tokens": 0}, "max_output_tokens"), ({"model": "specfit"}, "input")):
        refused = httpx.post(f"{server.url}/responses", json=bad, timeout=30)
        assert refused.status_code == 400 and words in refused.text


def test_models_lists_the_served_model_and_other_endpoints_answer_404(served):
    _, _, server, client = served
    assert [m.id for m in client.models.list().data] == ["specfit"]
    assert httpx.post(f"{server.url}/systemone", json={"model": "specfit"}).status_code == 404
