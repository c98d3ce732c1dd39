"""The host lane by behaviour (issue 44, items 1-4): what ``cold="auto"`` decides and what the lane is charged, read
from the rule's answer and from the counters of an enabled tiny Qwen3-MoE (fp32, CPU, emulated link and lane), not
from the implementation. Each test was checked to fail with its behaviour broken (the issue's planting table)."""

import time
from types import SimpleNamespace

import pytest
import torch
from conftest import SelfDrafter, tiny_moe, tiny_moe_config

import specfit
from specfit.offload.cold import ReuseEstimate, choose_host
from specfit.offload.experts import LayerRuntime
from specfit.offload.host_compute import ROWS_WITH_ROUTES, ThreadedLane
from specfit.offload.host_lane import HostConfig
from specfit.offload.slots import SlotBook
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


def test_the_auto_rule_by_its_terms():
    """Each term of the rule decides one case (copy 1.0 s, nothing queued on the link unless said)."""
    lane = lambda tokens: 0.4  # noqa: E731
    nothing = lambda e: 0.0  # noqa: E731
    # the second copy is valued over its own victim (reused 3.0: worth nothing), the first over a free slot
    assert choose_host([1, 2], {1: 1, 2: 1}, 1.0, lane, {1: 3.0, 2: 3.0}.get, [0.0, 3.0]) == [2]
    # the most reusable is valued first: 2 (3 uses) takes the free slot, 1 (1 use) would evict a victim of 0.5 uses
    assert choose_host([1, 2], {1: 1, 2: 1}, 1.0, lane, {1: 1.0, 2: 3.0}.get, [0.0, 0.5]) == [1]
    # a copy that costs nothing now (the link would idle beside the lane) is taken even when worth nothing later:
    # two experts at half a copy each
    assert choose_host([1, 2], {1: 1, 2: 1}, 1.0, lambda t: 0.5, nothing, [0.0, 0.0]) == [2]
    # where the lane is the layer's bottleneck (3 x 0.6 s), a copy shortens the layer: taken even over a victim
    # reused half a time (worth -0.3 later, -0.6 now)
    assert choose_host([1, 2, 3], {1: 1, 2: 1, 3: 1}, 1.0, lambda t: 0.6, nothing, [0.5] * 3) == [2, 3]
    # four experts at 0.9 of a copy: two copied beside two on the lane (the layer ends at 2.0 s, not 3.6); each copy
    # takes its expert's time off the lane
    assert choose_host([1, 2, 3, 4], {e: 1 for e in (1, 2, 3, 4)}, 1.0, lambda t: 0.9, nothing, [0.0] * 4) == [3, 4]
    # an expert with many tokens is dear on the lane: copied first
    assert choose_host([1, 2], {1: 9, 2: 1}, 1.0, lambda t: 0.1 * t, nothing, [0.0, 0.0]) == [2]


def test_reuse_is_the_expected_uses_in_the_coming_forwards():
    """An expert used in every forward for long is expected in all ``horizon`` (8) coming forwards; in every other
    forward, in about half; 10 forwards after its last use, in 0.8**10 of them."""
    r = ReuseEstimate()
    for t in range(60):
        r.observe([1] + ([2] if t % 2 else []))
    assert r.reuse(1) == pytest.approx(8.0, rel=1e-4)
    assert r.reuse(2) == pytest.approx(8 * 0.2 / (1 - 0.64), rel=1e-4)  # 4.44: the decay favours recent uses
    for _ in range(10):
        r.observe([3])
    assert r.reuse(1) == pytest.approx(8.0 * 0.8 ** 10, rel=1e-4) and r.reuse(4) == 0.0


def test_auto_weighs_a_copy_against_the_hot_expert_it_would_evict():
    """A full slot cache of experts used in every forward: a cold expert used as often is not worth evicting one of
    them (the lane computes it); with a free slot the same expert is copied."""
    for free in (False, True):
        book = SlotBook(num_slots=2 + free, num_experts=8)
        reuse = ReuseEstimate()
        for _ in range(20):
            book.plan([0, 1])
            reuse.observe([0, 1, 5])
        runtime = SimpleNamespace(cold="auto", copy_seconds=lambda: 1.0, host_seconds=lambda t=1: 0.4,
                                  link_busy=lambda: 0.0)
        layer = SimpleNamespace(runtime=runtime, cache=SimpleNamespace(lru=book), reuse=reuse)
        assert LayerRuntime._cold(layer, [0, 5], {0: [0], 5: [1]}) == ([] if free else [5]), free
    # every slot held by an expert the forward needs: a copy would be streamed, worth nothing later (the lane)
    book, reuse = SlotBook(num_slots=2, num_experts=8), ReuseEstimate()
    for _ in range(20):
        book.plan([0, 1])
        reuse.observe([0, 1, 5])
    layer = SimpleNamespace(runtime=runtime, cache=SimpleNamespace(lru=book), reuse=reuse)
    assert LayerRuntime._cold(layer, [0, 1, 5], {0: [0], 1: [1], 5: [2]}) == [5]


def test_a_lane_dear_per_token_leaves_a_long_prompt_to_the_link():
    """The rule prices each host expert at its own tokens: with a lane of 0.2 copies per token, a 40-token prompt's
    experts (about 10 tokens each) are mostly copied, a decode step's (one token each) go to the lane."""
    link = 1e-3
    model = specfit.enable(tiny_moe(), cache_slots=4, link=link, cold="auto",
                           host=HostConfig(bandwidth=1e30, per_token=0.2 * link))
    prompt = torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(40))
    model.generate(prompt, max_new_tokens=3, do_sample=False)
    prefill, decode = model.specfit.stats.last_prefill, model.specfit.stats.last_generate
    assert prefill.misses > 2 * prefill.host_experts, prefill
    assert decode.host_experts > 2 * decode.misses, decode


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
    # and the forward waits for it: a lane at 2.5 ms per token holds an 8-token forward for at least 0.32 s
    slow = 2.5e-3
    model = specfit.enable(tiny_moe(), cache_slots=4, host=HostConfig(bandwidth=1e30, per_token=slow), cold="host")
    t0 = time.perf_counter()
    with torch.no_grad():
        model(prompt)
    assert time.perf_counter() - t0 >= LAYERS * 8 * TOP_K * slow


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
