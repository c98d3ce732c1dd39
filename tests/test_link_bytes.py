"""A link prices an expert copy by the expert's stored bytes (issue 35, item 7): scaling a per-byte link makes copies
dearer, the probes and the cost model time a per-byte link for the bytes (not the element count), CUDA's link time is
measured for one expert's bytes (not a layer's arena), and the paper's demand-only fit warns on another link."""

import contextlib
import types
import warnings

import pytest
import torch
from conftest import tiny_moe

import specfit
from specfit import embedded
from specfit.evaluation import probes
from specfit.offload import bandwidth, cache
from specfit.offload.link import LinkConfig
from specfit.selection import profiles
from specfit.selection.cost_model import CostModel
from specfit.offload.runtime import SpecFitRuntime

EXPERT = 3 * 32 * 64 * 2  # bytes of one bf16 expert of the tiny model's shape


@pytest.mark.parametrize("link", [LinkConfig(bandwidth=1e9, relative=1.0), LinkConfig(bandwidth=1e9, latency=1e-5),
                                  LinkConfig(seconds_per_expert=2e-4)])
@pytest.mark.parametrize("ratio", [0.5, 2.0, 3.0])
def test_scaling_a_link_makes_every_copy_that_many_times_as_dear(link, ratio):
    scaled = embedded.scale_link(link, ratio)
    assert scaled.copy_time(EXPERT) == pytest.approx(ratio * link.copy_time(EXPERT))
    if link.relative is not None:
        assert scaled.relative == pytest.approx(ratio * link.relative)  # still named by the rule, at that ratio


def test_the_scaled_default_link_is_the_default_link_at_that_ratio(monkeypatch):
    monkeypatch.setattr(embedded, "default_link_seconds", lambda refresh=False: 3e-4)
    for ratio in (0.5, 2.0):
        scaled, direct = embedded.scale_link(embedded.default_link(), ratio), embedded.default_link(ratio)
        assert scaled.copy_time(EXPERT) == pytest.approx(direct.copy_time(EXPERT))
        assert direct.copy_time(embedded.bf16_expert_bytes()) == pytest.approx(ratio * 3e-4)


def test_probes_and_the_cost_model_time_a_per_byte_link_for_the_experts_bytes():
    """fp32 experts: 4 bytes an element, so bytes and element count differ 4x."""
    link = LinkConfig(bandwidth=1e8)
    model = specfit.enable(tiny_moe(), cache_slots=3, link=link)
    store = model.specfit.store
    assert store.expert_bytes == 4 * store.expert_numel
    want = store.expert_bytes / 1e8
    assert probes._link_seconds(model.specfit, link) == pytest.approx(want)
    assert profiles.link_seconds(model.specfit) == pytest.approx(want)


def test_a_links_latency_is_paid_by_every_copy_as_the_cost_model_prices_it():
    """latency + bytes / bandwidth: the per-copy latency counts in every copy's time, in what the probes and the cost
    model price a copy at, and in the label."""
    link = LinkConfig(bandwidth=1e8, latency=2e-5)
    assert link.copy_time(EXPERT) == pytest.approx(2e-5 + EXPERT / 1e8) and link.copy_time(0) == pytest.approx(2e-5)
    assert "20 us per copy" in link.label
    model = specfit.enable(tiny_moe(), cache_slots=3, link=link)
    want = 2e-5 + model.specfit.store.expert_bytes / 1e8
    assert probes._link_seconds(model.specfit, link) == pytest.approx(want)
    assert profiles.link_seconds(model.specfit) == pytest.approx(want)


class FakeCuda:
    """torch.cuda as bandwidth.copy_seconds uses it: every copy moves its source's bytes at ``rate`` bytes/s, and an
    event pair times the bytes moved between its records."""

    def __init__(self, rate: float):
        self.rate, self.moved = rate, 0

    def Stream(self, device, priority=0):
        return types.SimpleNamespace(synchronize=lambda: None)

    def Event(self, enable_timing):
        cuda = self

        class Event:
            def record(self, stream):
                self.at = cuda.moved

            def elapsed_time(self, end):  # milliseconds
                return (end.at - self.at) / cuda.rate * 1e3

        return Event()

    def stream(self, stream):
        return contextlib.nullcontext()

    def empty_like(self, source, device):
        cuda = self

        class Target:
            def copy_(self, src, non_blocking=False):
                cuda.moved += src.numel() * src.element_size()

            def record_stream(self, stream):
                pass

        return Target()


def test_cudas_link_time_is_one_experts_bytes_over_the_bandwidth(monkeypatch):
    model = specfit.enable(tiny_moe(), cache_slots=3)
    store = model.specfit.store
    cuda = FakeCuda(rate=2e9)
    fake_torch = types.SimpleNamespace(cuda=cuda, empty_like=cuda.empty_like)
    monkeypatch.setattr(bandwidth, "torch", fake_torch)
    monkeypatch.setattr(cache, "torch", fake_torch)  # CUDA's own streams (cache.CudaStreams) on the fake
    engine = types.SimpleNamespace(link=None, streams=cache.CudaStreams(torch.device("cuda")))
    runtime = types.SimpleNamespace(store=store, device=torch.device("cuda"), cuda=True,
                                    config=types.SimpleNamespace(link=None), engine=engine)
    runtime.copy_seconds = types.MethodType(SpecFitRuntime.copy_seconds, runtime)
    assert profiles.link_seconds(runtime) == pytest.approx(store.expert_bytes / 2e9)  # through copy_seconds
    assert bandwidth.copy_seconds(runtime) is runtime._link_copy_seconds  # measured once per runtime
    cuda.moved = 0  # a benchmark's runtime: the store and device alone, no copy engine (its streams: CUDA's own)
    bare = types.SimpleNamespace(store=store, device=torch.device("cuda"))
    assert bandwidth.copy_seconds(bare) == pytest.approx(store.expert_bytes / 2e9)


def test_the_paper_fit_warns_on_another_link_or_slot_count():
    """cost="paper" is the demand-only fit of the calibration's slots and link (recorded in its meta): used at
    those, silent; at another link or slot count, a warning naming what differs."""
    fitted = specfit.enable(tiny_moe(), cache_slots=6, link=2e-3)
    label = fitted.specfit.link_label
    paper = dict(intercepts=[0.02] * 8, beta=3e-4, slots=6, link=label)
    cost = CostModel(tuple([0.01] * 8), 1e-5, {"paper": paper}, copy_overhead=1e-4, link_share=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not profiles.price(fitted, cost, "paper").prices_copies  # where it was fitted: no warning
    for slots, link, differs in ((6, 1e-3, r"link 'emulated link, 2 ms per expert copy'.*1 ms"),
                                 (4, 2e-3, r"slots 6 \(here 4\)")):
        model = specfit.enable(tiny_moe(), cache_slots=slots, link=link)
        with pytest.warns(RuntimeWarning, match=differs + r".*cost='cache-aware'"):
            profiles.price(model, cost, "paper")
