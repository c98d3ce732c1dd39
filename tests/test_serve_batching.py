"""The server's batching rules (specfit.serving.batching), without a server: which requests may share a call, the
order and size of what a drain takes, the left-padded batch, and each row cut back to what its own call returns."""

import asyncio

import pytest

torch = pytest.importorskip("torch")
from transformers import GenerationConfig  # noqa: E402

from specfit.serving.batching import Lines, Waiting, batch_key, eos_set, left_padded, row_tokens  # noqa: E402


def admitted(seed=None, assistant="specfit", request_id="r"):
    return {"seed": seed, "assistant": assistant, "request_id": request_id}


def waiting(name):
    loop = asyncio.new_event_loop()
    try:
        return Waiting({"input_ids": torch.tensor([[1]])}, None, admitted(request_id=name), loop, loop.create_future())
    finally:
        loop.close()


def test_equal_settings_share_a_key_and_seeds_or_stop_strings_run_alone():
    greedy = GenerationConfig(max_new_tokens=8, do_sample=False)
    assert batch_key(greedy, admitted()) == batch_key(GenerationConfig(max_new_tokens=8, do_sample=False), admitted())
    assert batch_key(greedy, admitted()) != batch_key(GenerationConfig(max_new_tokens=9, do_sample=False), admitted())
    assert batch_key(greedy, admitted()) != batch_key(greedy, admitted(assistant="eagle3"))
    assert batch_key(greedy, admitted(seed=7)) is None
    assert batch_key(GenerationConfig(max_new_tokens=8, stop_strings=["."]), admitted()) is None


def test_a_drain_takes_the_oldest_up_to_max_batch_and_a_dropped_request_is_not_taken():
    lines = Lines(2)
    a, b, c, d = (waiting(n) for n in "abcd")
    for w in (a, b, c):
        lines.add("k", w)
    lines.add("other", d)
    lines.drop("k", b)
    assert lines.take("k") == [a, c]
    assert lines.take("k") == []  # a later drain finds its request already taken
    assert lines.take("other") == [d]
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        Lines(0)


def test_left_padded_batch_and_rows_cut_at_their_first_end_token():
    rows = [{"input_ids": torch.tensor([[5, 6, 7]])}, {"input_ids": torch.tensor([[8]]),
                                                       "attention_mask": torch.tensor([[1]])}]
    batch = left_padded(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    eos = eos_set(GenerationConfig(eos_token_id=[2, 3]))
    assert eos == {2, 3}
    assert row_tokens(torch.tensor([9, 3, 2, 2]), eos) == [9, 3]  # through the first end token, pad dropped
    assert row_tokens(torch.tensor([9, 9, 9]), eos) == [9, 9, 9]  # ran to max_new_tokens
    assert eos_set(GenerationConfig()) == set()
