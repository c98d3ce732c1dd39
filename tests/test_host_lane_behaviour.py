"""The host lane by behaviour (issue 44, items 1-4): what ``cold="auto"`` decides and what the lane is charged, read
from the rule's answer and from the counters of an enabled tiny Qwen3-MoE (fp32, CPU, emulated link and lane), not
from the implementation. Each test was checked to fail with its behaviour broken (the issue's planting table)."""

import pytest
import torch
from conftest import SelfDrafter, tiny_moe, tiny_moe_config

import specfit
from specfit.offload.cold import choose_host
from specfit.offload.host_compute import ROWS_WITH_ROUTES, ThreadedLane
from specfit.offload.host_lane import HostConfig
from specfit.selection.cost_model import CostModel

CONFIG = tiny_moe_config()
LAYERS, TOP_K = CONFIG.num_hidden_layers, CONFIG.num_experts_per_tok
COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0, host_overhead=0.003, host_share=1.0)
EXPERT_BYTES = 3 * CONFIG.hidden_size * CONFIG.moe_intermediate_size * 4  # gate, up, down in fp32


# --- item 1: a later use is valued at the cheaper of a copy and the lane ------------------------------------------
def test_auto_values_a_later_use_at_the_cheaper_of_a_copy_and_the_lane():
    """One cold expert, one free slot. Lane at 0.4 of a copy: copying costs 1.0 - 0.4 = 0.6 now (the link's time
    over the lane's it saves), and each later use it turns into a hit saves a host expert, 0.4 (cheaper than a copy):
    reused once (0.4 < 0.6) it stays on the host, reused twice (0.8 >= 0.6) it is copied. Valued at a copy (1.0) or
    at the lane's time where the copy is cheaper, the answers flip."""
    lane = lambda tokens: 0.4  # noqa: E731
    assert choose_host([5], {5: 1}, 1.0, lane, {5: 1.0}.get, [0.0]) == [5]
    assert choose_host([5], {5: 1}, 1.0, lane, {5: 2.0}.get, [0.0]) == []
    # over a victim used once, a twice-used expert nets one use: on the host again
    assert choose_host([5], {5: 1}, 1.0, lane, {5: 2.0}.get, [1.0]) == [5]
    # the link is the cheaper (lane at 2.5 copies), with 3 copies queued ahead: a copy now ends the layer 1.0 later,
    # and a later use is worth a copy (1.0), not the lane's 2.5: 0.8 uses stay on the host, 1.2 are copied
    dear = lambda tokens: 2.5  # noqa: E731
    assert choose_host([5], {5: 1}, 1.0, dear, {5: 0.8}.get, [0.0], link_busy=3.0) == [5]
    assert choose_host([5], {5: 1}, 1.0, dear, {5: 1.2}.get, [0.0], link_busy=3.0) == []


# --- item 2: "auto" decides with the uses before the forward -------------------------------------------------------
def test_a_fresh_models_first_token_puts_every_cold_expert_on_a_cheap_lane():
    """A fresh model, one one-token forward, free slots, the lane at 0.2 of a copy (top-4: the layer's four host
    experts, 0.8 of a copy, still end before one copy would): nothing has been used yet, so no copy is worth a slot
    later, and every cold expert goes to the host. (At half a copy the lane's four would take two copies' time, and
    the rule rightly copies one beside them.) Counting the forward's own uses first would value each copy at 1.6
    uses and copy them."""
    link = 1e-3
    model = specfit.enable(tiny_moe(), cache_slots=8, link=link, host=HostConfig(bandwidth=EXPERT_BYTES / (0.2 * link)),
                           cold="auto")
    assert model.specfit.store.expert_bytes == EXPERT_BYTES
    with torch.no_grad():
        model(torch.tensor([[7]]))
    c = model.specfit.stats.total
    assert c.demand == LAYERS * TOP_K and c.host_experts == c.demand and c.misses == 0 and c.hits == 0


# --- item 3: the lane is charged for every token routed to a host expert -------------------------------------------
def test_the_lane_is_charged_for_every_routed_token():
    """cold="host" and a lane whose time is per token only (its bandwidth so high the bytes cost ~1e-26 s): one
    forward of an 8-token prompt books exactly layers x tokens x top-k x the per-token time."""
    per_token = 1e-6
    model = specfit.enable(tiny_moe(), cache_slots=4, host=HostConfig(bandwidth=1e30, per_token=per_token),
                           cold="host")
    prompt = torch.randint(2, 256, (1, 8), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        model(prompt)
    c = model.specfit.stats.total
    assert c.host_experts == c.demand > 0 and c.misses == 0
    assert c.host_busy_seconds == pytest.approx(LAYERS * 8 * TOP_K * per_token, rel=1e-9)


# --- item 4: the real (threaded) lane under "auto": decode and verify use it, a long prefill does not --------------
class FakeHostCopies:
    """``host_compute.HostCopies`` on the CPU: counts the device copies back (one per layer forward that used the
    lane)."""

    def __init__(self):
        self.copies = 0

    def pinned_like(self, t):
        return torch.empty_like(t)

    def to_device(self, pinned):
        self.copies += 1
        return pinned.clone()


def test_the_threaded_lane_under_auto_serves_decode_and_verify_but_not_a_long_prefill():
    """The CUDA executor on a CPU "device", under cold="auto" (not only "host"): a prompt longer than
    ``ROWS_WITH_ROUTES`` tokens computes no expert on the lane (its rows do not come with the routes), the decode
    forwards of plain decoding and the verify forwards of SpecFit do, and the output is plain generate()'s."""
    prompt = torch.randint(2, 256, (1, ROWS_WITH_ROUTES + 6), generator=torch.Generator().manual_seed(70))
    expected = tiny_moe().generate(prompt, max_new_tokens=6, do_sample=False)
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, link=1e-4, cold="auto", host=HostConfig(bandwidth=1e9), cost_model=COST,
                   drafter=SelfDrafter(model, first_token=int(prompt[0, 0]), noise=0.3))
    copies = FakeHostCopies()
    lane = model.specfit.lane = ThreadedLane(torch.device("cpu"), copies)
    lane.measured = (1e-6, 0.0)  # the lane: 1 us per expert, a copy 100 us
    try:
        for assistant in (None, "specfit"):
            before = copies.copies
            out = model.generate(prompt, max_new_tokens=6, do_sample=False, assistant=assistant)
            assert torch.equal(out, expected), assistant
            stats = model.specfit.stats
            assert stats.last_prefill.host_experts == 0 and stats.last_prefill.misses > 0, assistant
            assert stats.last_generate.host_experts > 0, assistant
            assert stats.last_generate.host_busy_seconds > 0 and copies.copies > before
    finally:
        lane.close()
    # the same model with a short prompt: the prefill uses the lane too (the cut-off is the prompt's length)
    lane = model.specfit.lane = ThreadedLane(torch.device("cpu"), FakeHostCopies())
    lane.measured = (1e-6, 0.0)
    model.specfit.clear_cache()
    try:
        model.generate(prompt[:, :ROWS_WITH_ROUTES], max_new_tokens=2, do_sample=False)
    finally:
        lane.close()
    assert model.specfit.stats.last_prefill.host_experts > 0
