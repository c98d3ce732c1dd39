"""The real host lane on a GPU (issue 43, review 5): beside tests/test_cuda.py, run by the GPU check's pytest stage
(``pytest -m cuda tests/test_cuda.py tests/test_cuda_lane.py``). Skips without CUDA; the same flow runs on the CPU
through the CUDA stand-in (tests/test_cuda_standin.py)."""

import gc
import warnings

import pytest
import torch
from test_cuda import clear_prompt, cuda_logits, cuda_model

import specfit
from specfit.offload.experts import LayerRuntime

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]


def test_the_real_host_lane_computes_cold_experts_with_one_sync_per_layer(monkeypatch):
    """cold="host" (review 5): every cold expert computed by the threaded lane on the host CPU, its rows brought
    with the routes; the lane and the link were measured at enable (no probe in a forward); logits equal the
    reference's and each MoE layer forward makes exactly one host sync."""
    ids = clear_prompt(12, 1).cuda()
    model = cuda_model()
    expected = cuda_logits(model, ids)
    specfit.enable(model, cache_slots=3, cold="host")
    rt = model.specfit
    assert rt.lane.real and rt.lane.measured is not None and rt._link_copy_seconds > 0
    original, syncs = LayerRuntime.forward, []

    def counted(self, *args):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = original(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        return out

    monkeypatch.setattr(LayerRuntime, "forward", counted)
    gc.collect()  # a finalizer run by the collector mid-forward (an old model's streams) would sync inside a layer
    gc.disable()
    try:
        for _ in range(2):
            torch.testing.assert_close(cuda_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    finally:
        gc.enable()
    assert syncs == [1] * (2 * len(rt.layers))
    c = rt.stats.total
    assert c.host_experts > 0 and c.misses == 0 and c.host_busy_seconds > 0
