"""`specfit serve` on the CUDA stand-in's two devices (issue 52): the server's batches and single requests through
the public API and the real `openai` client, with the model on a device distinct from the host (transformers moves
each request's ids to the model's device; the server pads the batch; SpecFit's loop takes it from there). Every
answer equals plain greedy generate() on its own prompt, and requests that wait together share a call."""

import concurrent.futures

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from specfit.serving import Server, build_app  # noqa: E402

QUESTIONS = ["What is 7 times 8?", "A class has 28 students. Half of them play football. How many play football?",
             "Sara buys 4 notebooks at 3 dollars each. How much does she pay?"]
TOKENS = 8


@pytest.fixture(scope="module")
def served(standin_embedded):
    model, tokenizer = standin_embedded
    server = Server(build_app(model, tokenizer, max_batch=2), host="127.0.0.1", port=0).start()
    try:
        yield model, tokenizer, server
    finally:
        server.stop()


def plain(model, tokenizer, question: str) -> str:
    """Plain greedy generate() (transformers' loop) on the chat prompt, decoded as the server decodes."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, T] on the host
    tokens = model.generate(ids, max_new_tokens=TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[:tokens.index(tokenizer.eos_token_id) + 1]
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def test_concurrent_requests_and_a_batch_on_the_two_devices(served):
    model, tokenizer, server = served
    expected = {q: plain(model, tokenizer, q) for q in QUESTIONS}

    def ask(question):
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
        return question, client.chat.completions.create(model="specfit", max_tokens=TOKENS, temperature=0,
                                                        messages=[{"role": "user", "content": question}])

    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        replies = list(pool.map(ask, QUESTIONS * 2))
    batches = []
    for question, reply in replies:
        assert reply.choices[0].message.content == expected[question], question
        batches.append(reply.model_extra["specfit"]["batch"])
    assert max(batches) == 2, batches  # requests that waited together shared a call (max_batch 2)
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    streamed = client.chat.completions.create(model="specfit", max_tokens=TOKENS, temperature=0, stream=True,
                                              messages=[{"role": "user", "content": QUESTIONS[0]}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text.strip() == expected[QUESTIONS[0]]
