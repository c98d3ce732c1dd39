"""The CUDA runtime's flow on the CPU stand-in (``specfit.offload.standin``, issue 43): ``SPECFIT_CUDA_STANDIN=1`` makes
a runtime on the CPU take every branch a GPU takes (``cold="auto"`` by default, the threaded host lane, the link and
the lane measured once at enable, two copy streams with timing events, pinned staging, registered arenas); only the
CUDA calls are doubles, which keep CUDA's ordering rules (a copy on a copy stream runs only when something waits for
it). Greedy output still equals plain generate()."""

import gc
import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.offload import standin
from specfit.offload.cache import CopyEngine
from specfit.offload.host_compute import ThreadedLane
from specfit.selection.cost_model import CostModel
from specfit.transfer import listen_host_waits

PROMPT = torch.randint(2, 256, (1, 7), generator=torch.Generator().manual_seed(7))
COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0, host_overhead=0.003, host_share=1.0)


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv(standin.ENV, "1")


@pytest.fixture(scope="module")
def reference():
    return tiny_moe()


def enabled(slots=4, **kw):
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3)
    return specfit.enable(model, cache_slots=slots, drafter=drafter, cost_model=COST, **kw)


def test_the_cuda_flow_is_taken_and_measured_once_at_enable(on):
    gc.collect()  # an earlier test's stand-in model released now, not in the middle of this one's ledger
    del standin.LEDGER[:]
    model = enabled()
    rt = model.specfit
    assert rt.cuda and rt.cold == "auto" and isinstance(rt.lane, ThreadedLane)
    assert rt.engine.on_device and rt.staging.pinned and rt.store.is_pinned
    assert rt.lane.measured is not None and rt._link_copy_seconds > 0  # at enable, not in a forward
    waits = []
    listen_host_waits(waits.append)
    try:
        model(PROMPT.to(model.device))
    finally:
        listen_host_waits(waits.append, stop=True)
    assert "link bandwidth probe" not in waits
    registered = [p for kind, p, _ in standin.LEDGER if kind == "register"]
    assert len(registered) == len(rt.layers)
    arena, pageable = rt.store.arenas[0], torch.zeros(4)
    assert standin.HostCopies().is_pinned(arena) and not standin.HostCopies().is_pinned(pageable)
    specfit.disable(model)
    released = [p for kind, p, _ in standin.LEDGER if kind == "release" and p in set(registered)]
    assert sorted(released) == sorted(registered)  # every arena of this model released, once
    assert not standin.HostCopies().is_pinned(arena)  # released: pageable again, as cudaHostUnregister leaves it


def test_an_unmeasured_threaded_lane_measures_itself(on):
    """Review 5, item 1: the lane's measurement called plan_group and host_work with stale argument lists."""
    model = enabled()
    rt = model.specfit
    rt.lane = ThreadedLane(torch.device("cpu"), standin.HostCopies())
    assert rt.lane.measured is None
    assert rt.host_seconds(1) > 0 and rt.host_seconds(32) >= rt.host_seconds(1)
    rt.lane.close()
    assert rt.lane_for(64) is rt.lane and rt.lane_for(65) is None  # "auto": a prefill's rows stay on the device
    rt.experts_module, rt.lane.measured = None, None
    with pytest.raises(RuntimeError, match="enable\\(\\) sets experts_module"):
        rt.host_seconds(1)


@pytest.mark.parametrize("cold", ["auto", "host"])
def test_greedy_equals_plain_generate_on_the_stand_in(on, reference, cold):
    expected = reference.generate(PROMPT, max_new_tokens=12, do_sample=False)
    model = enabled(cold=None if cold == "auto" else cold)
    if cold == "auto":  # host work priced cheap against copies: the lane computes some experts
        model.specfit.lane.measured = (1e-7, 0.0)
    streams = model.specfit.engine.streams
    for assistant in (None, "eagle3", "specfit"):
        out = model.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant=assistant)
        assert torch.equal(out.cpu(), expected), f"cold={cold}, {assistant or 'AR'}"
        c = model.specfit.stats.last_generate
        assert c.host_experts > 0 and c.misses + c.host_experts > 0
        assert c.pageable_copies == 0
    assert streams.copies_run > 0 and model.specfit.lane.copies.copies > 0


def test_compute_that_skips_the_wait_for_its_copy_reads_stale_slots(on, reference):
    """The doubles keep CUDA's ordering: without the compute stream's wait on a batch's copies, the copies are still
    queued when the experts are computed, and the logits are wrong (the test of the stand-in itself)."""
    with torch.no_grad():
        expected = reference(PROMPT).logits
    model = enabled(cold="copy")
    streams = model.specfit.engine.streams
    original = standin.Stream.wait_event

    def skip_compute_waits(self, event):
        if self is not streams.compute:
            original(self, event)

    with torch.no_grad():
        assert torch.allclose(model(PROMPT.to(model.device)).logits.cpu(), expected, atol=1e-5)
        model.specfit.clear_cache()
        standin.Stream.wait_event = skip_compute_waits
        try:
            wrong = model(PROMPT.to(model.device)).logits.cpu()
        finally:
            standin.Stream.wait_event = original
    assert (wrong - expected).abs().max() > 1e-3


def test_the_doubles_refuse_what_cuda_refuses():
    streams = standin.Streams()
    stream = streams.new_stream(priority=-1)
    a, b = torch.zeros(4), torch.ones(4)
    with streams.on(stream), pytest.raises(AssertionError, match="not tied"):
        streams.copy(a, b)
    streams.tie(a, stream)
    start, end = streams.event(timing=True), streams.event(timing=True)
    start.record(stream)
    with streams.on(stream):
        streams.copy(a, b)
    end.record(stream)
    assert not end.query() and a.sum() == 0  # queued, not run
    with pytest.raises(RuntimeError, match="not yet completed"):
        start.elapsed_time(end)
    end.synchronize()
    assert a.sum() == 4 and start.elapsed_time(end) >= 0
    with pytest.raises(RuntimeError, match="enable_timing"):
        streams.event().elapsed_time(end)
    pinning = standin.Pinning()
    with pytest.raises(AssertionError, match="not registered"):
        pinning.unregister(123)


def test_off_by_default():
    assert not standin.active("cpu")
    model = enabled()
    assert not model.specfit.cuda and model.specfit.cold == "copy" and model.specfit.lane is None
