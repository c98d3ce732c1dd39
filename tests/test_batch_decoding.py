"""Assistant decoding of a left-padded batch: every row's greedy output equals plain generate() on the same padded
batch, token for token in fp32; bad batches are refused before any work."""

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.evaluation import comparison
from specfit.selection.cost_model import CostModel

COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)
LENGTHS = (3, 9, 14)


def padded_batch(lengths=LENGTHS, seed=7):
    """Left-padded prompts (pad token 0) and their attention mask, [B, T] each."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 256, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    return ids, mask


class RowSelfDrafters(torch.nn.Module):
    """The test double of a drafter for a batch: one ``SelfDrafter`` per row, picked by the row's drafter cache (rows
    start drafting in row order, so the k-th cache seen is row k's; ``firsts``: each row's first real token)."""

    def __init__(self, target, firsts, noise):
        super().__init__()
        self.rows = torch.nn.ModuleList(SelfDrafter(target, first_token=f, noise=noise, seed=i)
                                        for i, f in enumerate(firsts))
        self.config, self.fc, self.embed_tokens = self.rows[0].config, self.rows[0].fc, None
        self.caches = []

    def set_embedding(self, embedding):
        pass

    def to_target_ids(self, draft_ids):
        return draft_ids

    def forward(self, input_ids, hidden, position_ids, cache=None, attention_mask=None):
        row = next((k for k, c in enumerate(self.caches) if c is cache), None)
        if row is None:
            row = len(self.caches)
            self.caches.append(cache)
        row %= len(self.rows)
        return self.rows[row](input_ids, hidden, position_ids, cache=cache, attention_mask=attention_mask)


def enabled(ids, mask, noise=0.3, slots=4, rows_per_prompt=1, **kw):
    model = tiny_moe()
    firsts = [int(ids[b][mask[b].bool()][0]) for b in range(ids.shape[0]) for _ in range(rows_per_prompt)]
    drafter = RowSelfDrafters(model, firsts, noise)
    return specfit.enable(model, cache_slots=slots, drafter=drafter, cost_model=COST, **kw)


@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_batch_greedy_equals_plain_generate(assistant):
    ids, mask = padded_batch()
    expected = tiny_moe().generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False)
    model = enabled(ids, mask)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, assistant=assistant)
    assert torch.equal(out, expected)
    stats = model.specfit.stats
    assert stats.last_rows == [14, 14, 14] and stats.last_generate.new_tokens == 42
    assert stats.last_generate.cycles < 3 * 14  # trees committed more than one token per row and cycle
    assert stats.last_generate.batch_row_cycles > stats.last_generate.cycles  # several rows per verify forward
    if assistant == "specfit":  # the batch rule chose the subtrees and forecast the cycles
        assert stats.last_generate.forecast_cycles > 0


def test_batch_rows_stop_on_their_own():
    """An EOS that ends one row early: it is padded as plain generate() pads it, the others go on."""
    ids, mask = padded_batch()
    reference = tiny_moe()
    free = reference.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False)
    eos = int(free[1, ids.shape[1] + 3])  # row 1's 4th new token
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=eos,
                                  pad_token_id=0)
    assert (expected == eos).any(1).tolist().count(True) >= 1 and expected.shape[1] > ids.shape[1] + 4
    model = enabled(ids, mask)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, assistant="specfit")
    assert torch.equal(out, expected)
    assert min(model.specfit.stats.last_rows) <= 4


def test_batch_sampling_repeats_with_a_seed_and_returns_sequences():
    ids, mask = padded_batch(lengths=(4, 10))
    model = enabled(ids, mask, rows_per_prompt=2)
    runs = []
    for _ in range(2):
        model.specfit.drafter.caches.clear()
        torch.manual_seed(3)
        runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                                   num_return_sequences=2, assistant="eagle3"))
    assert runs[0].shape == (4, ids.shape[1] + 8) and torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0][0], runs[0][1])  # two samples of one prompt differ
    assert torch.equal(runs[0][:, :ids.shape[1]], ids.repeat_interleave(2, 0))


@pytest.mark.parametrize("bad, message", [
    ("no_mask", "starts with the pad token"),
    ("right", "right-padded"),
    ("shape", "has shape"),
    ("empty", "all padding"),
    ("streamer", "streamer"),
])
def test_bad_batches_refused_before_any_work(bad, message):
    ids, mask = padded_batch()
    model = enabled(ids, mask)
    kw = dict(attention_mask=mask)
    if bad == "no_mask":
        kw = {}
    elif bad == "right":
        kw["attention_mask"] = mask.flip(1)
        ids = ids.flip(1)
    elif bad == "shape":
        kw["attention_mask"] = mask[:, 1:]
    elif bad == "empty":
        kw["attention_mask"] = mask.clone()
        kw["attention_mask"][0] = 0
    elif bad == "streamer":
        from transformers import TextStreamer
        kw["streamer"] = TextStreamer(tokenizer=None)
    forwards = model.specfit.stats.total.forwards
    with pytest.raises(ValueError, match=message):
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, assistant="specfit", **kw)
    assert model.specfit.stats.total.forwards == forwards  # refused before any forward


def test_compare_takes_a_batch():
    """``specfit.compare(..., batch=2)``: one generate() call per left-padded pair of prompts, every method's tokens
    equal (the harness checks it), tok/s of the batch's new tokens."""
    ids, mask = padded_batch(lengths=(5, 11))
    prompts = [ids[b][mask[b].bool()][None] for b in range(2)]
    model = enabled(ids, mask)
    result = comparison.run(model, None, prompts, max_new_tokens=6, warmup=False, batch=2)
    rows = result.rows()
    assert [r["method"] for r in rows] == ["ar", "eagle3", "specfit"]
    for row in rows:  # like with like: the row's rounded tok/s against the unrounded wall clock it came from
        seconds = result.seconds[row["method"]]
        assert row["new_tokens"] == 12 and result.counters[row["method"]].new_tokens == 12
        assert seconds > 0 and row["tok_s"] == round(12 / seconds, 1)
    rows = specfit.compare(model, None, prompts, max_new_tokens=6, warmup=False, as_frame=False, batch=2)
    assert [r["prompts"] for r in rows] == [2, 2, 2]
    with pytest.raises(ValueError, match="batch must be an integer >= 1"):
        specfit.compare(model, None, prompts, max_new_tokens=6, warmup=False, as_frame=False, batch=0)


@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_batch_drafted_together_equals_plain_generate(assistant):
    """With an ``Eagle3Drafter`` the rows draft together (one drafter forward per step for every row, the rows
    stacked) and every row's output is still plain generate()'s."""
    from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter

    ids, mask = padded_batch()
    expected = tiny_moe().generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    model = tiny_moe()
    torch.manual_seed(1)
    drafter = Eagle3Drafter(Eagle3Config.from_target(model.config, draft_vocab_size=256, intermediate_size=32))
    rows_seen = []
    drafter.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
    model = specfit.enable(model, cache_slots=4, drafter=drafter, cost_model=COST, route_source="gate")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant=assistant)
    assert torch.equal(out, expected)
    assert max(rows_seen) == 3  # the three rows in one drafter forward
    # per cycle: one catch-up forward and one per drafted level, however many rows
    assert len(rows_seen) <= (1 + model.specfit.options.depth) * model.specfit.stats.last_generate.cycles


def test_batch_rows_back_off_on_their_own_and_leave_batch_ones_backoff_alone():
    """A profile where every drafted node costs more than a whole plain step: each row's winner is its root alone,
    so each row backs off (skipping drafting, no drafter forward for it) on its own ladder; the runtime's backoff,
    which batch-1 calls keep across calls, is not touched by the batch; the output is still plain's. (The guard is
    off: its trials of EAGLE-3's way would draft.)"""
    from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter

    ids, mask = padded_batch()
    expected = tiny_moe().generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    model = tiny_moe()
    torch.manual_seed(1)
    drafter = Eagle3Drafter(Eagle3Config.from_target(model.config, draft_vocab_size=256, intermediate_size=32))
    forwards = []
    drafter.register_forward_hook(lambda module, args, out: forwards.append(args[0].shape[0]))
    steep = CostModel(intercepts=(1.0,) + tuple(50.0 * k for k in range(1, 8)), beta=0.002, copy_overhead=0.008,
                      link_share=1.0)
    model = specfit.enable(model, cache_slots=4, drafter=drafter, cost_model=steep, route_source="gate", guard=False)
    model.generate(ids[2:], attention_mask=mask[2:], max_new_tokens=2, do_sample=False, assistant="specfit")
    before = vars(model.specfit.backoff).copy()
    forwards.clear()
    model.specfit.stats.start_trace()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant="specfit")
    assert torch.equal(out, expected)
    assert vars(model.specfit.backoff) == before
    cycles = model.specfit.stats.last_generate.cycles
    idle = [r.pool == 0 for r in model.specfit.stats.trace]  # no row drafted
    assert cycles >= 11 and sum(idle) > cycles // 2  # most cycles: every row skips drafting
    assert len(forwards) < 2 * sum(not i for i in idle) + 5  # ... and those cycles ran no drafter forward
    # a row that skips inside SpecFit's way is counted, and its root alone is verified
    assert model.specfit.stats.last_generate.plain_row_cycles > 0
