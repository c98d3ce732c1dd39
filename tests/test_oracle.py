"""The acceptance oracle (a measurement device): lossless, every verified node accepted, its look-ahead untracked and
timed apart, greedy only, and a row of the harness."""

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.decoding import oracle
from specfit.evaluation import harness

PROMPT = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(3))


def enabled(noise: float = 0.4, slots: int = 4):
    model = tiny_moe()
    specfit.enable(model, cache_slots=slots, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=noise))
    return model


def test_greedy_output_equals_plain_generate_and_every_verified_node_is_accepted():
    model = enabled()
    plain = model.generate(PROMPT, max_new_tokens=24, do_sample=False)
    trace = model.specfit.stats.start_trace()
    out = model.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant="acceptance-oracle")
    assert torch.equal(out, plain)
    rows = trace.rows()
    assert len(rows) > 2 and any(r["n_nodes"] > 0 for r in rows)
    # every cycle commits its whole verified path plus the bonus token (the last may be cut by max_new_tokens)
    assert all(r["committed"] == r["n_nodes"] + 1 for r in rows[:-1]), rows
    # some node of the pool was rejected, so the oracle verifies less than the pool (it is choosing)
    assert any(r["n_nodes"] < r["pool"] for r in rows)
    c = model.specfit.stats.last_generate
    assert model.specfit.stats.last_method == "acceptance-oracle"
    assert c.expected_tokens == sum(r["n_nodes"] + 1 for r in rows)  # it expects its whole path and the bonus


def test_the_look_ahead_is_untracked_and_timed_apart():
    model = enabled()
    trace = model.specfit.stats.start_trace()
    model.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant="acceptance-oracle")
    c = model.specfit.stats.last_generate
    # only the loop's verify forwards are counted (one per cycle, plus the first token's), not the look-aheads
    assert c.forwards == c.cycles
    drafted = [r for r in trace.rows() if r["pool"] > 0]
    assert drafted and all(r["measurement_seconds"] > 0 for r in drafted)
    assert c.measurement_seconds == pytest.approx(sum(r["measurement_seconds"] for r in trace.rows()))
    assert 0 < c.measurement_seconds < c.decode_seconds  # inside the call's wall clock
    assert c.tokens_per_second_excluding_measurement > c.tokens_per_second


def test_the_look_ahead_finds_the_greedy_chain_through_the_tree():
    from specfit.drafting.tree import DraftTree
    from specfit.selection.route_sources import Cycle
    from transformers import DynamicCache

    model = enabled(noise=0.0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        first = int(model(PROMPT, cache=cache, use_cache=True).logits[0, -1].argmax())
        greedy = model.generate(PROMPT, max_new_tokens=3, do_sample=False)[0, -3:].tolist()
    assert greedy[0] == first
    # a pool with a wrong sibling before the right one at each level: pool nodes 1, 3, 4 are the greedy chain
    tree = DraftTree()
    wrong = (greedy[1] + 1) % 256
    tree.add(-1, wrong, 0.5)  # 0
    tree.add(-1, greedy[1], 0.4)  # 1
    tree.add(1, (greedy[2] + 7) % 256, 0.2)  # 2
    tree.add(1, greedy[2], 0.1)  # 3
    cycle = Cycle(model, cache, base=PROMPT.shape[1], root=first)
    length = cache.get_seq_length()
    assert oracle.accepted_path(cycle, tree) == (1, 3)
    assert cache.get_seq_length() == length  # no KV left behind
    assert cycle.measurement_seconds > 0
    assert oracle.accepted_path(cycle, DraftTree()) == ()


def test_sampling_is_refused_with_what_to_use_instead():
    model = enabled()
    with pytest.raises(ValueError, match=r"acceptance-oracle.*greedy.*do_sample=False.*'specfit'"):
        model.generate(PROMPT, max_new_tokens=8, do_sample=True, assistant="acceptance-oracle")
    plain = model.generate(PROMPT, max_new_tokens=8, do_sample=False)  # the model still works afterwards
    assert torch.equal(model.generate(PROMPT, max_new_tokens=8, do_sample=False, assistant="acceptance-oracle"), plain)


def test_it_is_a_harness_method_and_never_a_default():
    method = harness.METHODS["acceptance-oracle"]
    assert method.assistant == oracle.NAME and "oracle" in method.label.lower()
    assert "acceptance-oracle" not in harness.PAPER_METHODS
    from specfit.evaluation.comparison import DEFAULT_METHODS

    assert "acceptance-oracle" not in DEFAULT_METHODS
