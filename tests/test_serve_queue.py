"""`specfit serve`'s queue through HTTP, on the installed transformers release: a streaming request holds the model
(a "blocker") while others wait; what the waiting requests then get is read from their answers, their counters
(``specfit``: ``batch``, ``call``, ``tokens``) and the totals (``GET /v1/specfit/stats``). Requests that differ only
in temperature or top_p never share a call; a drain takes exactly ``max_batch``; a request whose client left while
waiting is not run; the queue limit answers 429 and a client leaving mid-stream frees its place; a batched row that
ends early returns its tokens through its end token only; the context's edge; the threads the server was built with
are kept."""

import concurrent.futures
import contextlib
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")

from specfit import embedded  # noqa: E402
from specfit.serving import Server, build_app  # noqa: E402
from specfit.serving.templates import install_plain_template  # noqa: E402

QUESTIONS = ["A class has 28 students. Half of them play football. How many play football?",
             "What is 7 times 8?", "Anna reads 12 pages a day. How many pages does she read in a week?",
             "What is 100 minus 37?", "A shop sells 5 pens for 10 dollars. What does one pen cost?"]


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    model, tokenizer = embedded.load(32)
    install_plain_template(tokenizer)  # as the server gives it (the tests read the prompts it renders)
    return model, tokenizer


@contextlib.contextmanager
def serving(loaded, **options):
    model, tokenizer = loaded
    server = Server(build_app(model, tokenizer, **options), host="127.0.0.1", port=0).start()
    try:
        yield server
    finally:
        server.stop()


def totals(server) -> dict:
    return httpx.get(f"{server.url}/specfit/stats", timeout=10).json()


def until(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@contextlib.contextmanager
def blocker(server):
    """A streaming request that holds the model (its end token suppressed) until the block ends; leaving the block
    closes its connection, which stops its call at its next token."""
    body = {"model": "specfit", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 900,
            "temperature": 0, "stream": True, "generation_config": '{"min_new_tokens": 900}'}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=120) as held:
        assert held.status_code == 200
        lines = held.iter_lines()
        while '"content"' not in next(lines):  # its first token: it runs
            pass
        yield


def post(server, body: dict, request_id: str | None = None, timeout: float = 300):
    headers = {"x-request-id": request_id} if request_id else {}
    return httpx.post(f"{server.url}/chat/completions", json=body, headers=headers, timeout=timeout)


def chat(question: str, **fields) -> dict:
    return {"model": "specfit", "messages": [{"role": "user", "content": question}], "max_tokens": 4, **fields}


def queued(server, bodies: list[dict]) -> list:
    """Send ``bodies`` one after the other, each once the one before waits (so their order is their arrival order);
    the blocker must hold the model. Returns the futures of their answers."""
    pool = concurrent.futures.ThreadPoolExecutor(len(bodies))
    futures = []
    for i, body in enumerate(bodies):
        futures.append(pool.submit(post, server, body))
        until(lambda: totals(server)["queue"]["waiting"] == i + 1, f"request {i} did not queue")
    pool.shutdown(wait=False)
    return futures


def test_requests_that_differ_only_in_temperature_or_top_p_never_share_a_call(loaded):
    settings = [dict(temperature=0.7, top_p=1.0), dict(temperature=0.9, top_p=1.0), dict(temperature=0.7, top_p=0.5)]
    bodies = [chat(q, **settings[i % 3]) for i, q in enumerate(QUESTIONS + QUESTIONS[:1])]  # two of each
    with serving(loaded, max_batch=4) as server:
        with blocker(server):
            futures = queued(server, bodies)
        answers = [f.result().json() for f in futures]
    calls = {}
    for i, answer in enumerate(answers):
        stats = answer["specfit"]
        calls.setdefault(stats["call"], set()).add(i % 3)
        assert stats["batch"] == 2, (i, stats)  # each with the one other request of its settings
    assert sorted(map(sorted, calls.values())) == [[0], [1], [2]]  # one call per setting, never mixed


def test_a_drain_takes_exactly_max_batch_oldest_first(loaded):
    with serving(loaded, max_batch=2) as server:
        with blocker(server):
            futures = queued(server, [chat(q, temperature=0) for q in QUESTIONS])
        stats = [f.result().json()["specfit"] for f in futures]
    assert [s["batch"] for s in stats] == [2, 2, 2, 2, 1]
    first = stats[0]["call"]
    assert [s["call"] - first for s in stats] == [0, 0, 1, 1, 2]  # arrival order: the oldest leave first


def test_a_request_whose_client_left_while_waiting_is_not_run(loaded):
    with serving(loaded, max_batch=4) as server:
        before = totals(server)
        with blocker(server):
            with pytest.raises(httpx.TimeoutException):  # the client gives up while it waits: its connection closes
                post(server, chat(QUESTIONS[0], temperature=0), request_id="left-early", timeout=1.0)
            until(lambda: totals(server)["left_waiting"] == 1, "the server did not notice the client leave")
            with pytest.raises(httpx.TimeoutException):  # a seeded one (never batched) too
                post(server, chat(QUESTIONS[1], temperature=0.5, seed=3), request_id="left-seeded", timeout=1.0)
            until(lambda: totals(server)["left_waiting"] == 2, "the server did not notice the client leave")
            assert totals(server)["queue"]["waiting"] == 0  # their places are free
        stayed = post(server, chat(QUESTIONS[2], temperature=0), request_id="stayed")
        assert stayed.status_code == 200
        after = totals(server)
        assert after["requests"] - before["requests"] == 1  # the one that stayed; the blocker was stopped
        assert httpx.get(f"{server.url}/specfit/stats/left-early").status_code == 404
        assert httpx.get(f"{server.url}/specfit/stats/left-seeded").status_code == 404
        assert httpx.get(f"{server.url}/specfit/stats/stayed").json()["batch"] == 1


def test_the_queue_limit_answers_429_and_a_client_leaving_mid_stream_frees_its_place(loaded):
    with serving(loaded, max_queue=1) as server:
        with blocker(server):
            assert totals(server)["queue"]["running"] == 1
            started = time.perf_counter()
            full = post(server, chat(QUESTIONS[0], temperature=0))
            assert time.perf_counter() - started <= 1.0
            assert full.status_code == 429 and "queue is full" in full.text and "--max-queue 1" in full.text
        until(lambda: totals(server)["queue"]["running"] == 0, "the call of the client that left did not stop")
        reply = post(server, chat(QUESTIONS[0], temperature=0))
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("assistant", ["specfit", "none"])
def test_a_batched_row_that_ends_early_returns_tokens_through_its_end_token_only(loaded, assistant):
    model, tokenizer = loaded
    expected = {}
    for question in QUESTIONS[:2]:  # question 1 ends (its end token) within 64 tokens, question 0 runs longer
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=False)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        tokens = model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:].tolist()
        expected[question] = tokens[:tokens.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in tokens \
            else tokens
    assert len(expected[QUESTIONS[1]]) < 64 == len(expected[QUESTIONS[0]])
    with serving(loaded, max_batch=4) as server:
        before = totals(server)
        with blocker(server):
            futures = queued(server, [chat(q, temperature=0, max_tokens=64, assistant=assistant)
                                      for q in QUESTIONS[:2]])
        answers = [f.result().json() for f in futures]
        after = totals(server)
    for question, answer in zip(QUESTIONS[:2], answers):
        own = expected[question]
        assert answer["choices"][0]["message"]["content"] == tokenizer.decode(own, skip_special_tokens=True).strip()
        assert answer["usage"]["completion_tokens"] == len(own) == answer["specfit"]["tokens"]
        assert answer["specfit"]["batch"] == 2 and answer["specfit"]["call_tokens"] == sum(map(len, expected.values()))
        assert answer["specfit"]["method"] == ("ar" if assistant == "none" else assistant)
    assert answers[1]["choices"][0]["finish_reason"] == "stop" and answers[0]["choices"][0]["finish_reason"] == "length"
    assert after["tokens"] - before["tokens"] == sum(map(len, expected.values()))  # padding is never counted


def test_a_prompt_of_the_contexts_length_is_refused_and_one_token_shorter_is_admitted(loaded):
    _, tokenizer = loaded
    with serving(loaded) as server:
        for n, status in ((1024, 400), (1023, 200)):
            prompt = " two" * n
            assert len(tokenizer(prompt).input_ids) == n
            answer = httpx.post(f"{server.url}/completions", json={"model": "specfit", "prompt": prompt}, timeout=120)
            assert answer.status_code == status, answer.text
            if status == 400:
                assert "the model's context is 1024 tokens" in answer.text and "1024" in answer.text
            else:
                assert answer.json()["usage"]["completion_tokens"] == 1  # the default length, fitted to the context
        over = httpx.post(f"{server.url}/completions", json={"model": "specfit", "prompt": " two" * 1000,
                                                             "max_tokens": 30}, timeout=30)
        assert over.status_code == 400 and "ask for at most 24" in over.text


def test_the_threads_the_server_was_built_with_are_kept(loaded):
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with serving(loaded) as server:
            try:  # what transformers 5.25's serving does after loading a model on an accelerator
                from transformers.cli.serving.utils import set_torch_threads_for_serving
                set_torch_threads_for_serving(torch.device("meta"))
            except ImportError:  # 5.24 has no such call: the same reset by hand
                torch.set_num_threads(1)
            assert torch.get_num_threads() == 1 and totals(server)["threads"] is None  # no call yet
            assert post(server, chat(QUESTIONS[1], temperature=0)).status_code == 200
            assert totals(server)["threads"] == 2  # what the call ran with, on the engine's thread
    finally:
        torch.set_num_threads(previous)
