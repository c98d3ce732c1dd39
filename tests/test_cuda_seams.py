"""The CUDA seams and the CUDA-only decisions that need no kernel, on the CPU (issue 43): each seam calls torch.cuda
with the arguments CUDA takes (a recording fake of ``torch.cuda`` stands in); the pinning failure clears the CUDA
error; the grouped path's choice, the link refusal, ``--device cuda`` on a CPU build, the lane's guards."""

import types
from argparse import Namespace

import pytest
import torch

import specfit.offload.grouped_check as grouped_check
from specfit.cli_checks import cuda_device
from specfit.offload import standin, store as store_module
from specfit.offload.cache import CopyEngine, CudaStreams
from specfit.offload.host_compute import HostCopies, ThreadedLane
from specfit.offload.link import EmulatedLink, LinkConfig
from specfit.patch import _check_link_device
from specfit.selection.profiles import device_name
from specfit.seam.layers import ExpertLayout
from specfit.transfer import CudaCopies, to_host

CUDA = torch.device("cuda")


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's calls the seams make, recorded: (name, args, kwargs)."""
    calls = []

    def rec(name, result=None):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result if result is not None else types.SimpleNamespace(name=name)
        return call

    for name in ("Stream", "current_stream", "Event", "stream", "synchronize", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, rec(name, "H200" if name == "get_device_name" else None))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    return calls


def test_the_copy_engine_seam_calls_cuda_as_cuda_takes_it(fake_cuda):
    s = CudaStreams(CUDA)
    s.new_stream(priority=-1), s.current(), s.event(timing=True), s.on("x"), s.synchronize()
    assert [(n, a, k) for n, a, k in fake_cuda] == [
        ("Stream", (CUDA,), {"priority": -1}), ("current_stream", (CUDA,), {}), ("Event", (), {"enable_timing": True}),
        ("stream", ("x",), {}), ("synchronize", (CUDA,), {})]
    dst, src = torch.zeros(3), torch.ones(3)
    s.copy(dst, src)
    assert dst.sum() == 3
    CudaCopies(CUDA).event()
    assert fake_cuda[-1][0] == "Event"
    assert torch.equal(HostCopies(torch.device("cpu")).to_device(src), src)
    assert not HostCopies(torch.device("cpu")).is_pinned(src)  # torch's own answer: pageable
    assert device_name(types.SimpleNamespace(device=CUDA)) == "H200"


def test_a_failed_pin_clears_the_cuda_error(monkeypatch, fake_cuda):
    seen = []
    cudart = types.SimpleNamespace(cudaHostRegister=lambda p, n, f: 2, cudaHostUnregister=seen.append,
                                   cudaGetLastError=lambda: seen.append("cleared"))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pinning = store_module.CudaHostPinning()
    assert pinning.register(1, 8) == 2 and seen == ["cleared"]
    pinning.unregister(7)
    pinning.synchronize()
    assert seen[-1] == 7 and [c for c in fake_cuda if c[0] == "synchronize"] == [("synchronize", (0,), {}),
                                                                                   ("synchronize", (1,), {})]
    # a cudart binding without cudaGetLastError, and no libcudart mapped: said, not raised
    monkeypatch.setattr(torch.cuda, "cudart", lambda: types.SimpleNamespace())
    with pytest.warns(RuntimeWarning, match="could not clear the CUDA error"):
        store_module._clear_cuda_error()


def test_the_grouped_path_is_chosen_only_where_it_can_run(monkeypatch, caplog):
    layout = ExpertLayout(64, 32, False)
    assert grouped_check.grouped_experts_supported(CUDA, torch.float32, layout)[0] is False
    assert not grouped_check.grouped_experts_supported(CUDA, torch.bfloat16, ExpertLayout(64, 32, True))[0]
    monkeypatch.setattr(grouped_check, "grouped_self_check", lambda device, dtype, layout: None)
    assert grouped_check.grouped_experts_supported(CUDA, torch.bfloat16, layout) == (True, "grouped matmuls over the slots")
    monkeypatch.setattr(grouped_check, "grouped_self_check", lambda device, dtype, layout: "wrong sums")
    with pytest.warns(RuntimeWarning, match="gathered weights .*wrong sums"):
        assert grouped_check.choose_experts_path(CUDA, torch.bfloat16, layout) is False
    with caplog.at_level("INFO", logger="specfit"):
        assert grouped_check.choose_experts_path(CUDA, torch.float32, layout) is False
    assert "specfit experts path: gathered" in caplog.text


def test_what_cuda_refuses_is_refused():
    with pytest.raises(ValueError, match="emulates a host link"):
        _check_link_device(LinkConfig(seconds_per_expert=1e-3), CUDA)
    with pytest.raises(ValueError, match="emulated link is for CPU studies"):
        CopyEngine(torch.device("cpu"), EmulatedLink(LinkConfig(seconds_per_expert=1e-3)), standin.Streams())
    if torch.__version__.endswith("+cpu"):
        with pytest.raises(ValueError, match="is a CPU build"):
            cuda_device(Namespace(device="cuda"))
    with pytest.raises(RuntimeError, match="measured on first use"):
        ThreadedLane(torch.device("cpu"), standin.HostCopies()).expert_seconds(100)


def test_the_barrier_orders_each_copy_stream_behind_the_other():
    streams = standin.Streams()
    engine = CopyEngine(torch.device("cpu"), None, streams)
    engine.barrier()
    waits = {name: [op[2].name for op in s.queue if op[0] == "wait"]
             for name, s in (("demand", engine.demand_stream), ("prefetch", engine.prefetch_stream))}
    assert waits == {"demand": ["stream 2"], "prefetch": ["demand"]}  # each waits on the other's queued work


def test_rows_packed_as_bytes_come_back_as_sent():
    index, rows = torch.tensor([3, 1, 2]), torch.randn(2, 5).to(torch.bfloat16)
    flat, raw = to_host(index, rows.view(torch.uint8), pack=True)
    assert flat.tolist() == [3, 1, 2] and torch.equal(torch.from_numpy(raw).view(torch.bfloat16), rows)


def test_fp8_on_a_device_with_fp8_kernels_is_said_to_be_dequantized(monkeypatch):
    from specfit.offload.loader import _fp8_device_note

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    note = _fp8_device_note(CUDA, torch.bfloat16, "ckpt")
    assert "compute capability 9.0" in note and "dequantize=true" in note
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert _fp8_device_note(CUDA, torch.bfloat16, "ckpt") is None
