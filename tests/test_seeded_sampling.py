"""Seeded sampling repeats: the same torch seed gives the same sampled text on the same model, whatever the slot
cache, the acceptance model and the backoff learned in earlier calls, and whatever the assistant; and that text is the
plain target's own Gumbel-max sample at every position (so the distribution is the target's: tests/test_sampling.py
checks it by chi-square)."""

import torch
from conftest import SelfDrafter, tiny_moe
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import specfit
from specfit.decoding.position_noise import PositionNoise, draw_seed
from specfit.selection.cost_model import CostModel

PROMPT = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(9))
COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)
SAMPLING = dict(do_sample=True, temperature=0.9, top_k=8, top_p=1.0)
NEW = 16


def enabled():
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3, sharpen=2.0)
    return specfit.enable(model, cache_slots=4, drafter=drafter, cost_model=COST, depth=3, pool_nodes=8,
                          max_nodes=5)


def sampled(model, seed, assistant):
    torch.manual_seed(seed)
    return model.generate(PROMPT, max_new_tokens=NEW, assistant=assistant, **SAMPLING)[0, PROMPT.shape[1]:].tolist()


def plain_gumbel_sample(seed):
    """The plain target, one forward per token (no cache), each token argmax(processed scores + the position's
    noise) under the seed a generate() call draws after torch.manual_seed(seed)."""
    model = tiny_moe()
    torch.manual_seed(seed)
    noise = PositionNoise(draw_seed())
    processors = LogitsProcessorList([TemperatureLogitsWarper(SAMPLING["temperature"]),
                                      TopKLogitsWarper(SAMPLING["top_k"])])
    ids, all_scores = PROMPT, []
    with torch.no_grad():
        for _ in range(NEW):
            scores = processors(ids, model(ids).logits[:, -1].float())[0]
            all_scores.append(scores)
            ids = torch.cat([ids, torch.tensor([[noise.sample(ids.shape[1], scores)]])], dim=1)
    return ids[0, PROMPT.shape[1]:].tolist(), all_scores


def test_same_seed_same_text_ten_times_whatever_specfit_learned():
    """10 of 10 calls with one seed give one text, while the acceptance model and the slot cache change under them;
    EAGLE-3 (another tree every cycle) gives the same text. Fails with the old walk (random numbers drawn per tried
    child: a different tree draws different numbers)."""
    model = enabled()
    specfit.configure(model, guard=False)  # trees every cycle (the guard may settle on plain cycles)
    texts, learned = [], []
    for _ in range(10):
        texts.append(sampled(model, 1234, "specfit"))
        learned.append(model.specfit.acceptance_models["sampling"].labels_seen)
    assert all(t == texts[0] for t in texts), texts
    assert len(set(learned)) == 10  # it learned in every call: the trees had every reason to change
    assert sampled(model, 1234, "eagle3") == texts[0]
    assert sampled(model, 99, "specfit") != texts[0]  # the seed matters


def test_seeded_text_is_the_plain_targets_gumbel_sample():
    """Token for token, the assistants' sampled text is the plain model's argmax(scores + g_position): every
    committed token is the target's own sample at its position, whichever tree proposed it. The returned scores are
    the processed scores it was drawn from; eos stops the same text early; a streamer sees the same tokens."""
    from transformers.generation.streamers import BaseStreamer

    want, want_scores = plain_gumbel_sample(5)
    model = enabled()
    assert sampled(model, 5, "specfit") == want
    torch.manual_seed(5)
    out = model.generate(PROMPT, max_new_tokens=NEW, assistant="eagle3", return_dict_in_generate=True,
                         output_scores=True, **SAMPLING)
    assert out.sequences[0, PROMPT.shape[1]:].tolist() == want
    for got, expected in zip(out.scores, want_scores, strict=True):
        torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens += value.reshape(-1).tolist()

        def end(self):
            pass

    eos = want[6]
    stop = want.index(eos) + 1
    streamer = Collect()
    torch.manual_seed(5)
    got = model.generate(PROMPT, max_new_tokens=NEW, assistant="specfit", eos_token_id=eos, streamer=streamer,
                         **SAMPLING)[0, PROMPT.shape[1]:].tolist()
    assert got == want[:stop] and streamer.tokens[-stop:] == want[:stop]


def test_position_noise_is_keyed_by_seed_and_position_only():
    scores = torch.zeros(50)
    a, b = PositionNoise(7), PositionNoise(7)
    assert torch.equal(a.noise(3, scores), b.noise(3, scores))
    assert not torch.equal(a.noise(3, scores), a.noise(4, scores))
    assert not torch.equal(a.noise(3, scores), PositionNoise(8).noise(3, scores))
    filtered = torch.full((50,), float("-inf"))
    filtered[[4, 9]] = 0.0
    assert {a.sample(i, filtered) for i in range(40)} == {4, 9}  # never a token a processor filtered out
