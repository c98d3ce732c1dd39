"""The server's batching rules (specfit.serving.batching), without a server: which requests may share a call, the
order and size of what a drain takes, the left-padded batch on the rows' device, and each row cut back to what its
own call returns."""

import pytest

torch = pytest.importorskip("torch")
from transformers import GenerationConfig  # noqa: E402

from specfit.serving.batching import (Lines, batch_key, call_eos, eos_set, left_padded, pad_token,  # noqa: E402
                                      row_tokens)


class Waiting:
    def __init__(self, name):
        self.name, self.started = name, False


def test_equal_settings_share_a_key_and_seeds_or_stop_strings_run_alone():
    greedy = {"max_new_tokens": 8, "do_sample": False}
    assert batch_key(greedy, "specfit", None) == batch_key(dict(greedy), "specfit", None)
    assert batch_key(greedy, "specfit", None) != batch_key({**greedy, "max_new_tokens": 9}, "specfit", None)
    assert batch_key(greedy, "specfit", None) != batch_key(greedy, "eagle3", None)
    assert batch_key(greedy, "specfit", None) != batch_key(greedy, None, None)
    assert batch_key(greedy, "specfit", 7) is None
    assert batch_key({**greedy, "stop_strings": ["."]}, "specfit", None) is None
    sampled = {"max_new_tokens": 8, "do_sample": True, "temperature": 0.7, "top_p": 1.0}
    assert batch_key(sampled, "specfit", None) != batch_key({**sampled, "temperature": 0.9}, "specfit", None)
    assert batch_key(sampled, "specfit", None) != batch_key({**sampled, "top_p": 0.5}, "specfit", None)
    # transformers 5.24's form: a generation config
    config = {"generation_config": GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.7)}
    other = {"generation_config": GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.9)}
    assert batch_key(config, "specfit", None) != batch_key(other, "specfit", None)
    assert batch_key(config, "specfit", None) == batch_key(
        {"generation_config": GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.7)}, "specfit", None)
    assert batch_key({"generation_config": GenerationConfig(stop_strings=["."])}, "specfit", None) is None


def test_a_drain_takes_the_oldest_up_to_max_batch_and_a_dropped_request_is_not_taken():
    lines = Lines(2)
    a, b, c, d, e = (Waiting(n) for n in "abcde")
    for w in (a, b, c, e):
        lines.add("k", w)
    lines.add("other", d)
    assert lines.waiting() == 5
    assert lines.drop("k", b) is True and not b.started
    assert lines.take("k") == [a, c] and a.started and c.started
    assert lines.drop("k", c) is False  # taken: it runs
    assert lines.take("k") == [e]
    assert lines.take("k") == []  # a later drain finds its request already taken
    assert lines.take("other") == [d]
    assert lines.waiting() == 0
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
            Lines(bad)


def test_left_padded_batch_and_rows_cut_at_their_first_end_token():
    rows = [{"input_ids": torch.tensor([[5, 6, 7]])}, {"input_ids": torch.tensor([[8]]),
                                                       "attention_mask": torch.tensor([[1]])}]
    batch = left_padded(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    eos = eos_set(GenerationConfig(eos_token_id=[2, 3]).eos_token_id)
    assert eos == {2, 3} and eos_set(4) == {4} and eos_set(None) == set()
    assert row_tokens(torch.tensor([9, 3, 2, 2]), eos) == [9, 3]  # through the first end token, pad dropped
    assert row_tokens(torch.tensor([9, 9, 9]), eos) == [9, 9, 9]  # ran to max_new_tokens


def test_left_padded_allocates_on_the_rows_device():
    # issue 52: the batch was built with torch.full / torch.zeros on the CPU whatever the rows' device (a device
    # mismatch on CUDA); the meta device stands for a second device here
    rows = [{"input_ids": torch.tensor([[5, 6, 7]], device="meta")},
            {"input_ids": torch.tensor([[8]], device="meta"), "attention_mask": torch.ones(1, 1, device="meta")}]
    batch = left_padded(rows, pad_id=0)
    assert batch["input_ids"].device.type == "meta" and batch["attention_mask"].device.type == "meta"
    assert tuple(batch["input_ids"].shape) == (2, 3)


def test_the_end_and_pad_tokens_of_a_call():
    model = GenerationConfig(eos_token_id=0, pad_token_id=None)
    assert call_eos({"eos_token_id": [5, 6]}, model) == [5, 6]
    assert call_eos({"generation_config": GenerationConfig(eos_token_id=7)}, model) == 7
    assert call_eos({}, model) == 0

    class Tokenizer:
        pad_token_id = 9

    assert pad_token({"generation_config": GenerationConfig(pad_token_id=4)}, Tokenizer, model, {0}) == 4
    assert pad_token({}, Tokenizer, model, {0}) == 9
    Tokenizer.pad_token_id = None
    assert pad_token({}, Tokenizer, model, {3, 1}) == 1  # an end token pads (the row is cut through its first)
    with pytest.raises(ValueError, match="pad token"):
        pad_token({}, Tokenizer, model, set())
