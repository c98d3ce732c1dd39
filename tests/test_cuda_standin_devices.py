"""The CUDA stand-in's two devices (issue 52): under ``SPECFIT_CUDA_STANDIN=1`` an enabled model computes on the
``standin`` device, distinct from the host (``specfit.offload.standin_device``), so a tensor on the wrong side fails
here as it fails on CUDA. ``generate()`` takes inputs on the host, as transformers' own loop does, batch and single
row, every assistant, and returns them where it got them; every tensor SpecFit builds lives on the model's device."""

import numpy as np
import pytest
import torch

from specfit.evaluation.batches import left_padded, pad_id
from specfit.offload import standin_device

QUESTIONS = ["What is 7 times 8?", "A class has 28 students. Half of them play football. How many play football?",
             "Sara buys 4 notebooks at 3 dollars each. How much does she pay?"]


@pytest.fixture(scope="module")
def embedded_model(standin_embedded):
    return standin_embedded


def test_the_device_is_not_the_host_and_mixing_them_fails_as_on_cuda():
    dev = standin_device.register()
    x = torch.arange(6, device=dev).view(2, 3)  # [2, 3] on the device
    assert x.device == dev and x.device.type != "cpu"
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        _ = x + torch.ones(2, 3, dtype=torch.long)  # a host tensor of one or more dimensions
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.cat([x, torch.zeros(1, 3, dtype=torch.long)])
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        _ = x[0] * torch.ones(3, dtype=torch.long)  # one dimension is enough: only a host scalar may meet it
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        x.numpy()
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        np.asarray(x)
    assert (x + torch.tensor(1)).cpu().tolist() == [[1, 2, 3], [4, 5, 6]]  # a host scalar, as CUDA allows
    assert x[torch.tensor([1])].cpu().tolist() == [[3, 4, 5]]  # a host index tensor, as CUDA moves it
    y = torch.zeros(2, 3, dtype=torch.long, device=dev)
    y[torch.tensor([0])] = x[:1]
    assert y.tolist() == [[0, 1, 2], [0, 0, 0]] and x.sum().item() == 15
    host = x.cpu()
    assert type(host) is torch.Tensor and host.device.type == "cpu" and torch.equal(host.to(dev).cpu(), host)
    assert torch.tensor([[5, 6]], device=dev).device == dev and torch.full((2,), 3, device=dev).device == dev
    view = x[1]
    view.add_(10)  # in place through a view: the base sees it, as on any device
    assert x.tolist() == [[0, 1, 2], [13, 14, 15]]


def test_a_host_generator_is_refused_for_device_draws():
    dev = standin_device.register()
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.rand(3, device=dev, generator=torch.Generator())
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.empty(3, device=dev).uniform_(generator=torch.Generator())
    g = standin_device.generator(dev).manual_seed(3)
    first = torch.rand(3, device=dev, generator=g).cpu()
    assert torch.equal(torch.rand(3, device=dev, generator=g.manual_seed(3)).cpu(), first)
    assert standin_device.generator("cpu").device.type == "cpu"


def test_left_padded_builds_the_batch_where_the_prompts_are():
    dev = standin_device.register()
    rows = [torch.tensor([[5, 6, 7]], device=dev), torch.tensor([[8]], device=dev)]
    (ids, mask), = left_padded(rows, 2, 0)
    assert ids.device == dev and mask.device == dev
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    (host_ids, _), = left_padded([r.cpu() for r in rows], 2, 0)
    assert host_ids.device.type == "cpu"


def test_an_enabled_model_computes_on_the_device_and_refuses_host_inputs_to_a_forward(embedded_model):
    """The defect of review 7 item 1, as the stand-in sees it: a forward given host ids on a device model."""
    model, tokenizer = embedded_model
    ids = tokenizer(QUESTIONS[0], return_tensors="pt").input_ids  # [1, T] on the host
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        model(ids)
    assert model(ids.to(model.device)).logits.device == model.device
    rt = model.specfit
    assert rt.store.arenas[0].device.type == "cpu"  # the experts stay in host memory
    assert rt.layers[0].cache.slots.device == model.device  # the slots on the device
    routes = rt.routes.last  # recorded on the device, read on the host
    assert routes.device.type == "cpu" and routes.shape == (ids.shape[1], len(rt.layers), rt.num_experts)
    assert rt.routes.packed().shape == (ids.shape[1], len(rt.layers), rt.num_experts // 8)


def _prompts(tokenizer, n=2):
    return [tokenizer(q, return_tensors="pt").input_ids for q in QUESTIONS[:n]]  # [1, T_i] each, on the host


@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_generate_takes_host_ids_on_two_left_padded_rows_and_one_row(embedded_model, assistant):
    """Review 7 item 1: generate(cpu_ids, assistant=...) on a model whose device is not the host, 2 left-padded rows
    and a single row: tokens equal plain decoding's, and the output comes back on the host, where the ids were."""
    model, tokenizer = embedded_model
    (ids, mask), = left_padded(_prompts(tokenizer), 2, pad_id(model))  # [2, T] on the host
    assert ids.device.type == "cpu"
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)  # transformers' loop
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant=assistant)
    assert out.device == ids.device and torch.equal(out, plain)
    assert model.specfit.stats.last_generate.batch_row_cycles > 0  # the batch loop ran
    one = ids[1:]  # the unpadded row
    out = model.generate(one, max_new_tokens=10, do_sample=False, assistant=assistant, return_dict_in_generate=True,
                         output_scores=True)
    assert out.sequences.device.type == "cpu" and all(s.device.type == "cpu" for s in out.scores)
    assert torch.equal(out.sequences, model.generate(one, max_new_tokens=10, do_sample=False))
    on_device = model.generate(one.to(model.device), max_new_tokens=10, do_sample=False, assistant=assistant)
    assert on_device.device == model.device and torch.equal(on_device.cpu(), out.sequences)


def test_seeded_sampling_draws_on_the_device(embedded_model):
    """Sampling with an assistant: the noise comes from a generator on the model's device (a host generator for
    device draws is refused on CUDA, and by the stand-in)."""
    model, tokenizer = embedded_model
    ids = _prompts(tokenizer, 1)[0]
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(model.generate(ids, max_new_tokens=6, do_sample=True, temperature=0.8, assistant="specfit"))
    assert outs[0].device.type == "cpu" and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("loop", ["decode_batch", "decode"])
def test_host_ids_reaching_specfits_loop_fail_as_on_cuda(embedded_model, monkeypatch, loop):
    """The defect of review 7 item 1 planted back: SpecFit's loop handed the ids where they came from (the host),
    without the move transformers' own loop makes. The stand-in raises CUDA's device mismatch."""
    from specfit.decoding import strategy

    model, tokenizer = embedded_model
    real = getattr(strategy, loop)
    monkeypatch.setattr(strategy, loop, lambda m, request, ids, *a, **k: real(m, request, ids.cpu(), *a, **k))
    prompts = _prompts(tokenizer)
    (ids, mask), = left_padded(prompts, 2, pad_id(model))
    args = (ids, mask) if loop == "decode_batch" else (prompts[0], None)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        model.generate(args[0], attention_mask=args[1], max_new_tokens=4, do_sample=False, assistant="specfit")


def test_an_exported_folders_emulated_link_is_refused_on_a_device(tmp_path):
    """An exported folder whose settings emulate a host link, loaded onto a device (here the stand-in's, as a GPU):
    refused, naming the setting, before SpecFit is enabled."""
    from conftest import tiny_moe

    from specfit.export import runtime

    model = tiny_moe().to(standin_device.register())
    with pytest.raises(ValueError, match=r"'link_ms' 0.3 emulates a host link for CPU studies, and the model is on "
                                         r"standin:0"):
        runtime._enable(model, tmp_path, {"link_ms": 0.3})
