"""`specfit serve` through the real `openai` client against a server on 127.0.0.1 (a free port, one per module,
stopped at the end): greedy answers equal plain generate() token for token, streaming and not; 8 concurrent
clients x 3 requests; every bad request a 4xx with its message, the server serving after each; the queue limit and a
client that goes away mid-stream; Ctrl-C on the command."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")

from specfit import embedded  # noqa: E402
from specfit.serving import Server, build_app  # noqa: E402
from specfit.serving.seam import PLAIN_TEMPLATE  # noqa: E402

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


def reference(model, tokenizer, prompt: str, n: int) -> list[int]:
    """Plain greedy generate() (no assistant) on the prompt: the tokens every assistant must reproduce."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    tokens = out[0, ids.shape[1]:].tolist()
    return tokens[:tokens.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in tokens else tokens


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def test_plain_template_renders_the_trained_prompt_format(served):
    _, tokenizer, _, _ = served
    assert tokenizer.chat_template == PLAIN_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        "Be brief.\nQuestion: What is 2+2?\nAnswer:"


def test_greedy_chat_equals_generate_streaming_and_not(served):
    model, tokenizer, server, client = served
    expected = reference(model, tokenizer, chat_prompt(tokenizer, QUESTIONS[0]), 16)
    text = tokenizer.decode(expected, skip_special_tokens=True).strip()  # a chat reply, stripped (seam.py)
    reply = client.chat.completions.create(model="specfit", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                           max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens == len(expected)
    assert reply.usage.prompt_tokens == len(tokenizer(chat_prompt(tokenizer, QUESTIONS[0])).input_ids)
    stats = reply.model_extra["specfit"]
    assert stats["method"] == "specfit" and stats["tokens"] == len(expected) and stats["cycles"] >= 1
    assert stats["tokens_per_second"] > 0 and stats["tokens_per_cycle"] >= 1 and stats["copies_per_token"] >= 0
    # token for token: the server's tokens re-encode to the reference's
    assert tokenizer(reply.choices[0].message.content).input_ids == tokenizer(text).input_ids

    stream = client.chat.completions.create(model="specfit", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                            max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # transformers' streaming parser keeps the reply's leading space, its whole-reply parser strips it
    assert streamed.lstrip() == text and streamed == tokenizer.decode(expected, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(expected)
    side = httpx.get(f"{server.url}/specfit/stats/{chunks[0].id}").json()  # the side route, for streamed requests
    assert side["method"] == "specfit" and side["tokens"] == len(expected)


def test_completions_and_plain_decoding_on_request(served):
    model, tokenizer, server, client = served
    prompt = f"Question: {QUESTIONS[4]}\nAnswer:"
    expected = tokenizer.decode(reference(model, tokenizer, prompt, 12), skip_special_tokens=True)
    for assistant in ("specfit", None):
        reply = client.completions.create(model="specfit", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"assistant": assistant})
        assert reply.choices[0].text == expected
        assert reply.model_extra["specfit"]["method"] == (assistant or "ar")  # what the call really ran
    chunks = list(client.completions.create(model="specfit", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected  # raw text: exactly equal


def test_seeded_sampling_repeats_and_stop_cuts(served):
    model, tokenizer, server, client = served
    ask = dict(model="specfit", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=12,
               temperature=0.9, top_p=0.9, seed=7)
    first = client.chat.completions.create(**ask).choices[0].message.content
    assert client.chat.completions.create(**ask).choices[0].message.content == first
    greedy = tokenizer.decode(reference(model, tokenizer, chat_prompt(tokenizer, QUESTIONS[1]), 16),
                              skip_special_tokens=True).strip()
    stop = greedy.strip().split()[1]  # the second word of the greedy answer
    cut = client.chat.completions.create(model="specfit", messages=[{"role": "user", "content": QUESTIONS[1]}],
                                         max_tokens=16, temperature=0, stop=[stop])
    text = cut.choices[0].message.content
    assert text.endswith(stop) and greedy.startswith(text) and len(text) < len(greedy)
    assert cut.choices[0].finish_reason == "stop"


def test_eight_clients_three_requests_each(served):
    model, tokenizer, server, _ = served
    lengths = (2, 3, 4)
    greedy = {q: reference(model, tokenizer, chat_prompt(tokenizer, q), max(lengths)) for q in QUESTIONS}
    expected = {(q, n): tokenizer.decode(greedy[q][:n], skip_special_tokens=True).strip()  # greedy: prefixes
                for q in QUESTIONS for n in lengths}

    def client_run(question):
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
        got = []
        for n in lengths:
            reply = client.chat.completions.create(model="specfit", max_tokens=n, temperature=0,
                                                   messages=[{"role": "user", "content": question}])
            got.append(((question, n), reply.choices[0].message.content, reply.id))
        return got

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(client_run, QUESTIONS) for r in rs]
    assert len(results) == 24 and len({r[2] for r in results}) == 24  # none lost, each its own id
    for key, text, _ in results:
        assert text == expected[key], key  # none crossed


def test_requests_that_wait_together_run_as_one_batch_and_each_gets_its_own_row(served):
    """Five non-streaming clients at once, 20 tokens each: the server (max_batch 4) runs the ones that wait together
    as one left-padded call; each answer equals plain greedy generate() on its own prompt, usage counts its own row
    (through its end-of-sequence token), and the counters say how many rows shared the call."""
    model, tokenizer, server, _ = served
    questions = QUESTIONS[:5]
    expected = {q: reference(model, tokenizer, chat_prompt(tokenizer, q), 20) for q in questions}

    def ask(question):
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
        return question, client.chat.completions.create(model="specfit", max_tokens=20, temperature=0,
                                                        messages=[{"role": "user", "content": question}])

    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        replies = list(pool.map(ask, questions))
    batches = []
    for question, reply in replies:
        assert reply.choices[0].message.content == tokenizer.decode(expected[question],
                                                                    skip_special_tokens=True).strip(), question
        assert reply.usage.completion_tokens == len(expected[question])
        stats = reply.model_extra["specfit"]
        assert stats["tokens"] == len(expected[question]) and stats["method"] == "specfit"
        batches.append(stats["batch"])
    assert max(batches) > 1, batches  # at least two requests shared a call
    assert max(batches) <= 4  # never more rows than max_batch
    for size in set(batches):  # a call of k rows answered k of these requests
        assert batches.count(size) % size == 0, batches


def test_streaming_and_seeded_requests_run_alone(served):
    _, _, server, client = served
    seeded = client.chat.completions.create(model="specfit", messages=[{"role": "user", "content": QUESTIONS[6]}],
                                            max_tokens=3, temperature=0.8, seed=3)
    assert seeded.model_extra["specfit"]["batch"] == 1
    chunks = list(client.chat.completions.create(model="specfit", max_tokens=3, temperature=0, stream=True,
                                                 messages=[{"role": "user", "content": QUESTIONS[7]}]))
    assert httpx.get(f"{server.url}/specfit/stats/{chunks[0].id}").json()["batch"] == 1


BAD = [  # (body or raw bytes, status, words of the message)
    (b'{"model": "specfit", "messages": [', 422, "json"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 400, "gpt-4"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "two " * 1100}], "max_tokens": 4}, 400,
     "shorten it"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1020}, 400, "context"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "top_k": 5}, 422, "top_k"),
    ({"model": "specfit", "messages": [{"role": "user", "content": "hi"}], "assistant": "medusa"}, 400, "medusa"),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=["malformed-json", "unknown-model", "negative-max-tokens",
                                                        "prompt-past-context", "max-tokens-past-context",
                                                        "unknown-sampling-field", "unknown-assistant"])
def test_bad_request_gets_4xx_and_server_keeps_serving(served, body, status, words):
    _, _, server, client = served
    url = f"{server.url}/chat/completions"
    started = time.perf_counter()
    if isinstance(body, bytes):
        answer = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        answer = httpx.post(url, json=body, timeout=30)
    assert time.perf_counter() - started <= 1.0
    assert answer.status_code == status, answer.text
    assert words in answer.text.lower()
    reply = client.chat.completions.create(model="specfit", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens >= 1


def test_queue_limit_and_disconnect_free_the_slot(served):
    _, _, server, client = served
    manager = server.config.app.state.specfit_manager
    manager.max_queue = 1
    try:
        body = {"model": "specfit", "messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 400,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as long_one:
            lines = long_one.iter_lines()
            while not next(lines).startswith("data: {"):  # the first chunk: it runs
                pass
            assert manager.pending == 1
            full = httpx.post(f"{server.url}/chat/completions", json={**body, "stream": False}, timeout=30)
            assert full.status_code == 429 and "queue is full" in full.text
        deadline = time.monotonic() + 30  # the client went away mid-stream: its generation stops, the slot frees
        while manager.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager.pending == 0
        reply = client.chat.completions.create(model="specfit", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens >= 1
    finally:
        manager.max_queue = 16


def test_models_lists_the_served_model(served):
    _, _, _, client = served
    assert [m.id for m in client.models.list().data] == ["specfit"]


def test_command_refuses_bad_options_early():
    from specfit.cli import main

    assert main(["serve", "--slots", "0"]) == 2
    assert main(["serve", "--max-queue", "0"]) == 2
    assert main(["serve", "--max-batch", "0"]) == 2
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        build_app(None, None, max_batch=0)
    assert main(["serve", "--port", "70000"]) == 2


def test_command_serves_and_stops_on_ctrl_c():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "specfit.cli", "serve", "--host", "127.0.0.1", "--port",
                                str(port), "--link-ms", "0", "--slots", "12"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                                    json={"model": "specfit", "prompt": "Question: What is 2+2?\nAnswer:",
                                          "max_tokens": 3, "temperature": 0})
                break
            except httpx.ConnectError:
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
                time.sleep(0.2)
        assert answer.status_code == 200 and json.loads(answer.text)["usage"]["completion_tokens"] >= 1
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err and "stopped" in out
