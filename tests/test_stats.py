"""What each span of ``model.specfit.stats`` counts: ``last_prefill`` is the prompt's forward, ``last_generate`` the
decode phase only (one verify forward per cycle; the prompt's forward is not in it), and the two add up to the
call's share of ``total``."""

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.selection.cost_model import CostModel

PROMPT = torch.randint(2, 256, (1, 11), generator=torch.Generator().manual_seed(11))
EXPERT_FIELDS = ("forwards", "demand", "hits", "misses", "streamed", "bytes_copied")


@pytest.fixture(scope="module")
def model():
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3)
    cost = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.01)  # SpecFit verifies nodes
    return specfit.enable(model, cache_slots=4, drafter=drafter, cost_model=cost)


@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_last_generate_counts_the_decode_cycles_and_not_the_prompts_forward(model, assistant):
    stats = model.specfit.stats
    stats.reset()
    trace = stats.start_trace()
    model.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant=assistant)
    g, prefill = stats.last_generate, stats.last_prefill
    assert prefill.forwards == 1 and prefill.demand > 0 and prefill.misses > 0  # the prompt's forward
    assert g.cycles == len(trace) > 0 and g.forwards == g.cycles  # one verify forward per cycle, nothing else
    assert g.demand == sum(c.demand for c in trace) and g.misses == sum(c.misses for c in trace)
    assert g.tokens_committed == sum(c.committed for c in trace) == g.new_tokens - 1  # the first is the prefill's
    for name in EXPERT_FIELDS:  # the call's forwards, each in exactly one of the two spans
        assert getattr(stats.total, name) == getattr(prefill, name) + getattr(g, name), name


def test_plain_decoding_counts_one_cycle_per_decode_forward(model):
    stats = model.specfit.stats
    stats.reset()
    model.generate(PROMPT, max_new_tokens=9, do_sample=False)
    g, prefill = stats.last_generate, stats.last_prefill
    assert prefill.forwards == 1 and g.forwards == g.cycles == g.tokens_committed == 8  # token 1: the prefill's
    for name in EXPERT_FIELDS:
        assert getattr(stats.total, name) == getattr(prefill, name) + getattr(g, name), name
