"""The host lane (issue 36): cold experts computed on the host beside the copies, on a tiny random Qwen3-MoE (fp32,
CPU) with an emulated lane: lossless for every method and with sampling, counted, split by the rule of ``"auto"``,
timed on the lane's own clock, priced by the cost model and the selector, fitted by the probes, refused where it
cannot run; the CUDA executor's ordering with a CPU test double."""

import doctest
import threading

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
import specfit.offload.cold
import specfit.offload.experts
import specfit.offload.host_lane
from specfit.offload import link as link_module
from specfit.offload.cold import ReuseEstimate, choose_host
from specfit.offload.experts import routes_to_host
from specfit.offload.host_compute import InlineLane, ThreadedLane
from specfit.offload.host_lane import EmulatedHostLane, HostConfig
from specfit.patch import _cold_mode
from specfit.selection.cost_model import CostModel, Record
from specfit.selection.selector import select_subtree
from specfit.stats import Counters

PROMPTS = [torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 19)]
LANE = HostConfig(bandwidth=2e9, overhead=2e-6, per_token=1e-7)  # ~14 us per tiny expert: a fast test
COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0, host_overhead=0.003, host_share=1.0)


def enabled(prompt, cold, slots=4, **kw):
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(prompt[0, 0]), noise=0.3)
    return specfit.enable(model, cache_slots=slots, drafter=drafter, cost_model=COST, link=1e-4, host=LANE,
                          cold=cold, **kw)


@pytest.fixture(scope="module")
def reference():
    return tiny_moe()


# --- lossless ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cold, prompt", [("host", PROMPTS[0]), ("auto", PROMPTS[1])])
def test_greedy_equals_plain_generate_for_every_method(reference, cold, prompt):
    """AR, EAGLE-3, SpecFit and transformers' prompt lookup, each computing cold experts on the host lane."""
    expected = reference.generate(prompt, max_new_tokens=14, do_sample=False)
    model = enabled(prompt, cold)
    for assistant, extra in ((None, {}), ("eagle3", {}), ("specfit", {}), (None, {"prompt_lookup_num_tokens": 3})):
        out = model.generate(prompt, max_new_tokens=14, do_sample=False, assistant=assistant, **extra)
        assert torch.equal(out, expected), f"cold={cold}, {assistant or extra or 'AR'}"
        c = model.specfit.stats.last_generate
        assert c.host_experts > 0, "the host lane computed nothing: the test would not see it"
        assert c.demand == c.hits + c.misses + c.host_experts
        assert cold == "auto" or c.misses == 0  # "host": every cold expert on the lane, none copied


def test_the_host_lanes_outputs_are_what_the_model_computes(monkeypatch, reference):
    """Mutation: a lane whose work returns zeros changes the logits (the host rows are used, not recomputed)."""
    ids = PROMPTS[1]
    with torch.no_grad():
        want = reference(ids).logits
        model = specfit.enable(tiny_moe(), cache_slots=2, host=LANE, cold="host")
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
        submit = InlineLane.submit
        monkeypatch.setattr(InlineLane, "submit", lambda self, work, costs, counters: submit(
            self, lambda: torch.zeros_like(work()), costs, counters))
        assert not torch.allclose(model(ids).logits, want, atol=1e-3)


def test_sampling_draws_the_same_tokens_as_copies_under_one_seed():
    """The lane changes where experts are computed, not what: with one seed, sampling draws the same tokens."""
    prompt = PROMPTS[0]
    runs = {}
    for cold in ("copy", "host", "auto"):
        model = enabled(prompt, cold)
        for assistant in (None, "specfit"):
            torch.manual_seed(7)
            runs[cold, assistant] = model.generate(prompt, max_new_tokens=8, do_sample=True, temperature=0.9,
                                                   top_k=40, assistant=assistant)
    for assistant in (None, "specfit"):
        assert torch.equal(runs["host", assistant], runs["copy", assistant])
        assert torch.equal(runs["auto", assistant], runs["copy", assistant])


# --- the rule of "auto" ----------------------------------------------------------------------------------------------
def test_auto_fills_free_slots_only_with_reused_experts_and_copies_when_the_link_would_idle():
    host = lambda tokens: 0.4  # noqa: E731 - the lane: 0.4 s per expert; a copy: 1 s
    # nothing reused, two cold experts: both on the host (0.8 s beats 1 s on the link)
    assert choose_host([1, 2], {1: 1, 2: 1}, 1.0, host, lambda e: 0.0, [0.0, 0.0]) == [1, 2]
    # three: the lane would take 1.2 s, so one copy (1 s beside 0.8 s) costs nothing
    assert choose_host([1, 2, 3], {1: 1, 2: 1, 3: 1}, 1.0, host, lambda e: 0.0, [0.0] * 3) == [2, 3]
    # an expert reused often earns its copy into a free slot; not over a victim reused as much
    reuse = {1: 4.0, 2: 0.0}.get
    assert choose_host([1, 2], {1: 1, 2: 1}, 1.0, host, reuse, [0.0, 0.0]) == [2]
    assert choose_host([1, 2], {1: 1, 2: 1}, 1.0, host, reuse, [4.0, 4.0]) == [1, 2]
    # no slot to keep it in (it would be streamed): worth nothing later
    assert choose_host([1, 2], {1: 1, 2: 1}, 1.0, host, reuse, []) == [1, 2]
    # copies already queued on the link make a copy dearer now
    assert choose_host([1, 2, 3], {1: 1, 2: 1, 3: 1}, 1.0, host, lambda e: 0.0, [0.0] * 3, link_busy=5.0) == [1, 2, 3]
    # free copies (no link) are always taken; a free lane always wins
    assert choose_host([1, 2], {1: 1, 2: 1}, 0.0, host, lambda e: 0.0, [0.0, 0.0]) == []
    assert choose_host([1, 2], {1: 1, 2: 1}, 1.0, lambda t: 0.0, lambda e: 0.0, [0.0, 0.0]) == [1, 2]


def test_reuse_estimates_decay_with_the_forwards_since_last_use():
    r = ReuseEstimate(decay=0.5, horizon=2)
    r.observe([3])
    assert r.reuse(3) == pytest.approx(2 * 0.5 * 1.0)
    r.observe([4])
    r.observe([4])
    assert r.reuse(3) == pytest.approx(2 * 0.5 * 0.25)  # two forwards without it
    assert r.reuse(4) == pytest.approx(2 * 0.5 * 1.5) and r.reuse(9) == 0.0


def test_auto_keeps_a_warmer_cache_than_copying_every_cold_expert(reference):
    """Greedy AR at 4 of 16 slots with a link dearer than the lane: "auto" copies far fewer experts than "copy"
    and computes the rest on the host, and still uses the slots (hits)."""
    prompt = PROMPTS[1]
    counts = {}
    for cold in ("copy", "auto"):
        model = specfit.enable(tiny_moe(), cache_slots=4, link=1e-4, host=LANE, cold=cold)
        model.generate(prompt, max_new_tokens=16, do_sample=False)
        counts[cold] = model.specfit.stats.last_generate
    assert counts["auto"].misses < counts["copy"].misses / 2
    assert counts["auto"].hits > 0 and counts["auto"].host_experts > 0


# --- the emulated lane's clock ---------------------------------------------------------------------------------------
class FakeClock:
    """The clock the emulated lane reads (``link.time``): it moves only when slept on, and by 1 us per reading (the
    last stretch of a wait spins on the clock)."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        self.now += 1e-6
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_the_lane_serves_experts_one_after_the_other_and_the_join_waits_for_what_nothing_hid(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(link_module, "time", clock)
    lane = InlineLane(EmulatedHostLane(HostConfig(bandwidth=1e6, overhead=1e-3, per_token=1e-4)))
    counters = Counters()
    ticket = lane.submit(lambda: torch.ones(2, 3), [(4000, 1), (2000, 10)], counters)
    # 1 ms + 4 ms + 0.1 ms, then 1 ms + 2 ms + 1 ms: 9.1 ms booked on the lane
    assert counters.host_busy_seconds == pytest.approx(9.1e-3)
    clock.now += 5e-3  # the device's hits and copies: 5 ms of the lane's time hidden
    out = lane.join(ticket, counters)
    assert torch.equal(out, torch.ones(2, 3)) and counters.host_wait_seconds == pytest.approx(4.1e-3, abs=1e-5)
    clock.now += 1.0  # a layer later, with the lane idle meanwhile: a new expert starts now, not in the past
    ticket = lane.submit(lambda: torch.ones(1), [(1000, 1)], counters)
    lane.join(ticket, counters)
    assert counters.host_wait_seconds == pytest.approx(4.1e-3 + 2.1e-3, abs=2e-5)


def test_host_config_refuses_what_is_not_a_positive_finite_bandwidth():
    for bad in (0, -1.0, float("inf"), float("nan"), True, "63e9"):
        with pytest.raises(ValueError, match="bandwidth must be a finite number > 0"):
            HostConfig(bandwidth=bad)
    with pytest.raises(ValueError, match="overhead must be a finite number >= 0"):
        HostConfig(bandwidth=1e9, overhead=-1e-6)


# --- refusals at enable ----------------------------------------------------------------------------------------------
def test_enable_refuses_a_bad_cold_mode_or_host_lane_naming_what_works(reference):
    with pytest.raises(ValueError, match=r"cold must be one of \('copy', 'host', 'auto'\).*got 'cpu'"):
        specfit.enable(tiny_moe(), cache_slots=4, host=LANE, cold="cpu")
    with pytest.raises(ValueError, match=r"cold='host' needs a host lane.*host=specfit\.embedded\.default_host\(\)"):
        specfit.enable(tiny_moe(), cache_slots=4, cold="host")
    for bad in (-5.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="host lane's bandwidth must be a finite number > 0"):
            specfit.enable(tiny_moe(), cache_slots=4, host=bad)
    with pytest.raises(ValueError, match="host must be a HostConfig or the host lane's bandwidth"):
        specfit.enable(tiny_moe(), cache_slots=4, host="fast")
    with pytest.raises(ValueError, match="on CUDA the host CPU computes host experts for real"):
        _cold_mode("auto", LANE, torch.device("cuda"), None)

    class NoHostPath:  # a stored format the host lane cannot compute (formats.py: host_path)
        name, host_path = "int4-kernel", False

    with pytest.raises(ValueError, match=r"stored as int4-kernel, which has no host path.*dense, fp8.*cold='copy'"):
        _cold_mode("auto", LANE, torch.device("cpu"), NoHostPath())
    assert _cold_mode(None, LANE, torch.device("cpu"), NoHostPath()) == "copy"  # the default: no lane for it
    # the defaults: "auto" where a lane exists, else "copy"
    assert _cold_mode(None, None, torch.device("cpu"), None) == "copy"
    assert _cold_mode(None, LANE, torch.device("cpu"), None) == "auto"
    assert _cold_mode(None, None, torch.device("cuda"), None) == "auto"
    model = specfit.enable(tiny_moe(), cache_slots=4, host=2e9)  # a bandwidth alone is a lane
    assert model.specfit.cold == "auto" and model.specfit.config.host.bandwidth == 2e9


def test_from_pretrained_refuses_cold_and_host_before_reading_the_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="cold must be one of"):
        specfit.from_pretrained(tmp_path / "nowhere", cache_slots=4, cold="gpu")
    with pytest.raises(ValueError, match="bandwidth must be a finite number > 0"):
        specfit.from_pretrained(tmp_path / "nowhere", cache_slots=4, host=0.0)


# --- CUDA's executor, with a CPU test double -------------------------------------------------------------------------
class FakeHostCopies:
    """``HostCopies`` on the CPU: records which thread asked for pinned memory and for the device copy."""

    def __init__(self):
        self.pinned_threads, self.copy_threads = [], []

    def pinned_like(self, t):
        self.pinned_threads.append(threading.get_ident())
        return torch.empty_like(t)

    def to_device(self, pinned):
        self.copy_threads.append(threading.get_ident())
        return pinned.clone()


def test_the_threaded_lane_computes_in_its_own_thread_and_copies_from_the_python_thread(reference):
    """End to end on a CPU "device": the CUDA executor (a worker thread, pinned results, one copy per layer) in the
    place of the emulated lane; greedy output still equals plain generate()."""
    prompt = PROMPTS[1]
    expected = reference.generate(prompt, max_new_tokens=10, do_sample=False)
    model = enabled(prompt, "host")
    copies = FakeHostCopies()
    lane = model.specfit.lane = ThreadedLane(torch.device("cpu"), copies)
    lane.measured = (1e-5, 1e-7)
    computed_in = []
    work = specfit.offload.experts.host_work

    def spy(*args):
        inner = work(*args)
        return lambda: (computed_in.append(threading.get_ident()), inner())[1]

    specfit.offload.experts.host_work, main = spy, threading.get_ident()
    try:
        out = model.generate(prompt, max_new_tokens=10, do_sample=False, assistant="specfit")
    finally:
        specfit.offload.experts.host_work = work
    assert torch.equal(out, expected)
    c = model.specfit.stats.last_generate
    layers = len(model.specfit.layers)
    assert computed_in and main not in computed_in and set(copies.pinned_threads) == set(computed_in)
    assert set(copies.copy_threads) == {main}
    # one transfer back per layer forward with host experts, at most one per layer forward
    assert len(copies.copy_threads) == len(computed_in) <= model.specfit.stats.total.forwards * layers
    assert c.host_busy_seconds > 0
    lane.close()
    assert lane._pool is None


def test_a_failure_in_the_worker_is_raised_in_the_forward():
    lane = ThreadedLane(torch.device("cpu"), FakeHostCopies())
    ticket = lane.submit(lambda: 1 / 0, [], Counters())
    with pytest.raises(ZeroDivisionError):
        lane.join(ticket, Counters())
    lane.close()


def test_rows_reach_the_host_with_the_routes_in_one_transfer():
    """The CUDA path packs the rows as bytes beside the routes (NumPy has no bfloat16) and views them back."""
    from specfit.evaluation.syncs import WouldBeSyncs

    top_k = torch.tensor([[3, 1], [0, 2]])
    for dtype in (torch.bfloat16, torch.float32):
        hidden = torch.randn(2, 8).to(dtype)
        with WouldBeSyncs() as syncs:
            flat, rows = routes_to_host(top_k, hidden, True, as_bytes=True)
        assert syncs.total == 1 and flat.tolist() == [3, 1, 0, 2]
        assert rows.dtype == dtype and torch.equal(rows, hidden)
    flat, rows = routes_to_host(top_k, hidden, False)
    assert rows is None


def test_the_host_lane_adds_no_host_sync_to_a_layer():
    from test_syncs import Count, enabled as sync_enabled

    count = Count(sync_enabled(host=LANE, cold="host", link=1e-4), "specfit", new_tokens=10)
    assert count.model.specfit.stats.last_generate.host_experts > 0
    bad = [(t, s) for t, s in count.layers if s != 1]
    assert not bad, f"layer forwards with other than one sync (tokens, syncs): {bad[:5]}"


# --- pricing ---------------------------------------------------------------------------------------------------------
def test_a_cold_expert_is_priced_at_its_copy_its_host_time_or_the_cheaper():
    profile = CostModel((0.1,) * 3, 1e-4, copy_overhead=1e-5, link_share=1.0, host_overhead=2e-5, host_share=0.5)
    copy, host = 1e-5 + 1e-3, 2e-5 + 0.5 * 4e-4
    assert profile.priced(1e-3).miss == pytest.approx(copy)
    assert profile.priced(1e-3, 4e-4, "host").miss == pytest.approx(host)
    auto = profile.priced(1e-3, 4e-4, "auto")
    assert auto.miss == pytest.approx(host) and auto.predict(1, 100, misses=10) == pytest.approx(0.1 + 1e-2 + 10 * host)
    assert profile.priced(1e-5, 4e-4, "auto").miss == pytest.approx(1e-5 + 1e-5)  # a near-free link: the copy
    with pytest.raises(ValueError, match="give the host lane's seconds"):
        profile.priced(1e-3, None, "auto")
    # a profile fitted without a lane prices a host expert at the lane's own time
    old = CostModel((0.1,) * 3, 1e-4, copy_overhead=1e-5, link_share=1.0)
    assert old.priced(1e-3, 4e-4, "auto").miss == pytest.approx(4e-4)


def test_the_selector_verifies_more_where_host_experts_are_cheap():
    """One layer, node 0 routes to two cold experts: worth verifying when a cold expert costs its host time, not
    when it costs a copy."""
    routes = np.array([[[False, True, True, False]]])
    root = np.array([[True, False, False, False]])
    resident = np.array([[True, False, False, False]])
    base = CostModel((1.0, 1.0), 0.0, copy_overhead=0.0, link_share=1.0, host_overhead=0.0, host_share=1.0)
    dear = select_subtree([-1], [0.5], routes, root, base.priced(0.5), 1, resident=resident)
    cheap = select_subtree([-1], [0.5], routes, root, base.priced(0.5, 0.05, "auto"), 1, resident=resident)
    assert dear.nodes == () and cheap.nodes == (0,) and cheap.misses == 2


def test_the_fit_tells_the_host_lanes_share_from_its_overhead_and_the_profile_keeps_them(tmp_path):
    rng = np.random.default_rng(0)
    records = []
    for _ in range(160):
        n, d, m, h = int(rng.integers(0, 4)), float(rng.integers(50, 200)), float(rng.integers(0, 30)), 0.0
        link, lane = float(rng.choice([0.0, 1e-3])), 0.0
        if rng.random() < 0.5:  # a host round: every cold expert on one of two lanes
            m, h, lane = 0.0, float(rng.integers(0, 30)), float(rng.choice([2e-4, 4e-4]))
        seconds = 0.1 + 0.01 * n + 1e-4 * d + m * (2e-5 + 0.9 * link) + h * (3e-5 + 0.6 * lane)
        records.append(Record(n, d, seconds, m, link, h, lane))
    cost = CostModel.fit(records, kind="cache-aware")
    assert cost.host_overhead == pytest.approx(3e-5, rel=1e-3) and cost.host_share == pytest.approx(0.6, rel=1e-3)
    assert cost.link_share == pytest.approx(0.9, rel=1e-3) and cost.cold == "auto"
    assert max(abs(cost.record_seconds(r) - r.seconds) for r in records) < 1e-9
    loaded = CostModel.load(cost.save(tmp_path / "p.json"))
    assert (loaded.host_overhead, loaded.host_share) == (cost.host_overhead, cost.host_share)
    # without host records the term is absent, and such a profile still loads as before
    plain = CostModel.fit([r for r in records if not r.host], kind="cache-aware")
    assert not plain.prices_host and "host_overhead_s" not in plain.to_json()


def test_calibration_fits_the_host_lane_from_its_rounds():
    """Probes on the tiny model with a link and an emulated lane: the host rounds run every cold expert on the lane
    (and on the lane at half its bandwidth), so the fit prices a host expert near the lane's own time."""
    from specfit.evaluation.probes import calibrate
    from test_probes import PROMPTS as PROBE_PROMPTS, random_drafter

    model = tiny_moe()
    lane = HostConfig(bandwidth=2.5e7)  # ~1 ms per tiny expert: well above the machine's noise per cycle
    specfit.enable(model, cache_slots=6, link=2e-3, host=lane, drafter=random_drafter(model), depth=2,
                   pool_nodes=6)
    result = calibrate(model, PROBE_PROMPTS, probes=24, repeats=1, warmup=1, max_new_tokens=30, bootstrap=20)
    cost, records = result.cost, result.records
    probes = cost.meta["probes"]
    assert len(probes["lanes"]) == 4 and probes["lanes"][:2] == [None, None] and probes["lanes"][2] == lane.label
    hosted = [r for r in records if r.host]
    assert hosted and all(r.misses == 0 for r in hosted)  # a host round copies nothing
    assert sorted({r.host_seconds for r in hosted}) == pytest.approx([lane.expert_time(model.specfit.store.expert_bytes)
                                                                      * k for k in (1, 2)])
    assert cost.prices_host and cost.cold == "auto"
    own = lane.expert_time(model.specfit.store.expert_bytes)
    assert 0.3 * own < cost.host < 1.5 * own, f"host {cost.host * 1e3:.3f} ms against the lane's {own * 1e3:.3f} ms"


# --- stats, display, structural default ------------------------------------------------------------------------------
def test_stats_show_hits_copies_and_host_experts_per_token_and_the_trace_keeps_them():
    prompt = PROMPTS[1]
    model = enabled(prompt, "auto")
    trace = model.specfit.stats.start_trace()
    model.generate(prompt, max_new_tokens=10, do_sample=False, assistant="specfit")
    c = model.specfit.stats.last_generate
    assert c.host_experts_per_token == pytest.approx(c.host_experts / c.new_tokens)
    assert c.hits_per_token == pytest.approx(c.hits / c.new_tokens)
    assert sum(r.host_experts for r in trace) > 0 and all(r.host_experts <= r.demand for r in trace)
    text = repr(c)
    assert "host/token=" in text and "host_wait=" in text
    assert "host experts/token" in c._repr_html_() and "host_experts_per_token" in c.as_dict()
    assert "host experts/token" not in Counters(new_tokens=4, demand=8, hits=8)._repr_html_()  # no lane, no row


def test_the_default_host_lane_is_named_by_its_rule_and_scaled_to_the_link():
    from specfit import embedded
    from specfit.offload.link import LinkConfig

    expert = embedded.bf16_expert_bytes()
    link = LinkConfig(bandwidth=expert / 1e-3, relative=1.0)  # 1 ms per bf16 expert copy
    host = embedded.default_host(link=link)
    assert host.bandwidth == pytest.approx(2.5 * link.bandwidth) and "2.5x the link's bandwidth" in host.label
    read = expert / host.bandwidth  # the 2.5x host's time for one bf16 expert: 0.4 ms
    assert host.overhead == pytest.approx(22 / 149 * read) and host.per_token == pytest.approx(0.3 / 31 / 1.87 * read)
    slow = embedded.default_host(1.0, link)  # the regime map's 1x: only the bandwidth moves
    assert slow.bandwidth == pytest.approx(link.bandwidth) and slow.overhead == host.overhead
    with pytest.raises(ValueError, match="copies for free"):
        embedded.default_host(link=LinkConfig(seconds_per_expert=0.0))


def test_the_regime_maps_host_axis_is_checked_and_reported():
    from types import SimpleNamespace

    from specfit.evaluation import regime_map

    args = SimpleNamespace(map_prompts=1, map_tokens=4, map_ratios=[1.4], map_slots=[12], map_host_ratios=[0.0])
    with pytest.raises(ValueError, match="map-host-ratios .* > 0"):
        regime_map.check_arguments(args)
    cells = [dict(link_ratio=1.4, host_ratio=h, slots=s, workload="gsm8k",
                  tok_s={"ar": 2.0 * h, "eagle3": 3.0, "specfit": 3.3 * h, "prompt-lookup": 1.0, "ar-copy": 1.6})
             for h in (1.0, 2.5) for s in (6, 12)]
    text = regime_map.report_host(cells)
    assert "rows: host lane / link bandwidth" in text and "AR cold='auto' / AR every cold expert copied" in text
    assert "1.25" in text and "3.12" in text  # AR auto / AR copy at 1x and 2.5x


def test_docstring_examples_run():
    for module in (specfit.offload.cold, specfit.offload.host_lane, specfit.offload.experts):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_auto_values_a_copy_against_the_expert_the_cache_policy_would_evict(monkeypatch):
    """The worth of a copy under cold="auto" is its reuse minus what the expert it evicts loses: that expert is the
    one the slot cache's policy evicts (issue 37 meets 36), not the least recently used one."""
    from types import SimpleNamespace

    from specfit.offload import experts
    from specfit.offload.cold import ReuseEstimate
    from specfit.offload.policies import DecayedFrequency
    from specfit.offload.slots import SlotBook

    book = SlotBook(num_slots=2, num_experts=8, policy=DecayedFrequency(8))
    reuse = ReuseEstimate()
    for needed in [[1]] * 5 + [[0]]:  # 1 used often, then 0 once: LRU would evict 1, the frequency policy 0
        book.plan(needed)
        reuse.observe(needed)
    assert list(book.resident) == [1, 0]
    seen = {}

    def choose(cold, tokens, copy_seconds, host_seconds, reuse_of, victims, link_busy):
        seen["victims"] = list(victims)
        return list(cold)

    monkeypatch.setattr(experts, "choose_host", choose)
    layer = SimpleNamespace(runtime=SimpleNamespace(cold="auto", copy_seconds=lambda: 1.0, host_seconds=lambda t: 0.4,
                                                    link_busy=lambda: 0.0),
                            cache=SimpleNamespace(lru=book), reuse=reuse)
    assert experts.LayerRuntime._cold(layer, [5], {5: [0]}) == [5]
    assert seen["victims"] == [reuse.reuse(0)] and reuse.reuse(0) < reuse.reuse(1)
