"""Block-wise FP8 checkpoints (transformers' ``quant_method="fp8"``, the hub's layout) written by the tests: experts
stored as stored (e4m3 + float32 scales), outputs equal to transformers' own load of the same checkpoint on this CPU
(where it dequantizes), refusals of other quantizations and of a truncated scale tensor."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_moe
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import specfit
from specfit.offload.formats import dequantize, quantize

BLOCK = (8, 16)
E, LAYERS, H, I = 16, 4, 64, 32


def write_fp8(folder: Path, fused: bool = False, seed: int = 3, shard: str | None = "60KB") -> dict:
    """A tiny Qwen3-MoE saved in bf16 (hub layout, sharded), then every projection quantized block-wise to e4m3 with
    a ``weight_scale_inv`` beside it (the router and norms stay bf16), as Qwen's FP8 releases are. ``fused``: the
    experts as fused ``gate_up_proj`` / ``down_proj`` tensors with ``*_scale_inv`` beside them."""
    src = tiny_moe(seed=seed).to(torch.bfloat16)
    src.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    new_map = {}
    for path in sorted(folder.glob("*.safetensors")):
        out = {}
        for key, value in load_file(path).items():
            if key.endswith(".weight") and value.dim() == 2 and "proj" in key:
                q, s = quantize(value, BLOCK)
                out[key], out[key[: -len("weight")] + "weight_scale_inv"] = q, s
            else:
                out[key] = value
        if fused:
            out = fuse_experts(out)
        save_file(out, path, metadata={"format": "pt"})
        new_map.update({k: path.name for k in out})
    if weight_map is not None:
        index.write_text(json.dumps({"metadata": {}, "weight_map": new_map}))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic", "fmt": "e4m3"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return config


def fuse_experts(tensors: dict) -> dict:
    """Per-expert FP8 keys of each layer found whole in ``tensors`` -> fused [E, ...] tensors (+ ``_scale_inv``)."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}.mlp.experts"
        names = [f"{p}.{e}.{part}.{kind}" for e in range(E) for part in ("gate_proj", "up_proj", "down_proj")
                 for kind in ("weight", "weight_scale_inv")]
        if not all(n in tensors for n in names):
            out.update({n: tensors[n] for n in names if n in tensors})
            continue
        for kind, suffix in (("weight", ""), ("weight_scale_inv", "_scale_inv")):
            out[f"{p}.gate_up_proj{suffix}"] = torch.stack([torch.cat(
                [tensors[f"{p}.{e}.gate_proj.{kind}"], tensors[f"{p}.{e}.up_proj.{kind}"]]) for e in range(E)])
            out[f"{p}.down_proj{suffix}"] = torch.stack([tensors[f"{p}.{e}.down_proj.{kind}"] for e in range(E)])
    return out


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8")
    write_fp8(folder)
    assert len(list(folder.glob("*.safetensors"))) > 3
    return folder


def reference(folder, dtype):
    """The model a user would run: transformers' own load of the FP8 checkpoint (on a CPU it dequantizes)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_matches_transformers_formula(dtype):
    """Bit for bit ``(q.float() * s).to(dtype)`` (transformers' Fp8Dequantize), with every finite e4m3 value and
    scales over many magnitudes: the two-pass form without a float32 temporary (CUDA's) rounds once, as the formula
    does."""
    w = torch.randn(2, 16, 32) * torch.tensor([1e-4, 30.0])[:, None, None]
    q, s = (torch.stack(t) for t in zip(*(quantize(x, BLOCK) for x in w)))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2, 2)
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    q.view(-1)[:254] = every[~every.float().isnan()]  # subnormals, zeros, the largest values
    s = s * torch.exp(torch.randn(s.shape, generator=torch.Generator().manual_seed(0)) * 3)
    blocks = q.float().reshape(2, 2, 8, 2, 16) * s[:, :, None, :, None]
    want = blocks.reshape(2, 16, 32).to(dtype)
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    for two_pass in (False, True):  # the CPU's default, and CUDA's (run here too)
        got = dequantize(q, s, dtype, two_pass=two_pass)
        assert got.dtype == dtype and torch.equal(got.view(bits), want.view(bits)), two_pass
    q1, s1 = quantize(w[1], BLOCK)
    assert (dequantize(q1, s1, torch.float32) - w[1]).abs().max() < 0.07 * w[1].abs().max()


def test_fp8_checkpoints_load_on_gpus_with_fp8_kernels_too(monkeypatch):
    """Issue 39, 4: compute capability >= 8.9 (where transformers would run its FP8 kernels) is no refusal: the
    experts are dequantized on the device, and the loader says so at info level (below 8.9 and on a CPU, nothing)."""
    from specfit.offload import loader

    for capability, noted in (((9, 0), True), ((8, 9), True), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        note = loader._fp8_device_note(torch.device("cuda", 0), torch.bfloat16, "ckpt")
        assert (note is not None) == noted
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "quantization_config.dequantize=true" in loader._fp8_device_note(torch.device("cuda"), torch.bfloat16, "x")
    assert loader._fp8_device_note(torch.device("cpu"), torch.bfloat16, "ckpt") is None
    assert not hasattr(loader, "_check_fp8_device")


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_arenas_hold_the_stored_bytes(tmp_path, fused):
    write_fp8(tmp_path, fused=fused, shard=None if fused else "60KB")  # fused: one file holds each whole layer
    model = specfit.from_pretrained(tmp_path, cache_slots=3, dtype=torch.float32)
    store = model.specfit.store
    scales = 4 * (2 * I // 8 * H // 16 + H // 8 * I // 16)
    assert store.dtype == torch.uint8 and store.expert_bytes == 3 * I * H + scales
    assert store.weight_bytes == LAYERS * E * store.expert_bytes
    assert store.weight_bytes <= 0.55 * LAYERS * E * 3 * I * H * 2  # vs the same experts in bf16
    tensors = {}
    for path in tmp_path.glob("*.safetensors"):
        tensors.update(load_file(path))
    p = "model.layers.2.mlp.experts"
    arena = store.arenas[2]
    gate_up, down, s_gate_up, s_down = store.format._split(arena[5:6])
    if fused:
        want_gu, want_sgu = tensors[f"{p}.gate_up_proj"][5], tensors[f"{p}.gate_up_proj_scale_inv"][5]
    else:
        want_gu = torch.cat([tensors[f"{p}.5.gate_proj.weight"], tensors[f"{p}.5.up_proj.weight"]])
        want_sgu = torch.cat([tensors[f"{p}.5.gate_proj.weight_scale_inv"], tensors[f"{p}.5.up_proj.weight_scale_inv"]])
    assert torch.equal(gate_up[0].view(torch.uint8), want_gu.view(torch.uint8))  # the e4m3 bytes, untouched
    assert torch.equal(s_gate_up[0], want_sgu)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    model(ids)
    c = model.specfit.stats.total
    assert c.misses > 0 and c.bytes_copied == c.misses * store.expert_bytes  # copies move the stored bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_equal_transformers_own_fp8_load(fp8, dtype):
    ref = reference(fp8, dtype)
    model = specfit.from_pretrained(fp8, cache_slots=3, dtype=dtype)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=tol, atol=tol)
    if dtype == torch.float32:  # the house rule: greedy equality in fp32 on a CPU
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False),
                           ref.generate(ids, max_new_tokens=10, do_sample=False))
    specfit.disable(model)  # experts come back dequantized: the very model transformers loaded
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name


def test_fused_fp8_keys_equal_per_expert_keys(tmp_path, fp8):
    write_fp8(tmp_path, fused=True, shard=None)
    a = specfit.from_pretrained(tmp_path, cache_slots=16, dtype=torch.float32)
    b = specfit.from_pretrained(fp8, cache_slots=16, dtype=torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.specfit.store.arenas, b.specfit.store.arenas))
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_assistants_are_lossless_on_fp8(fp8):
    from conftest import SelfDrafter

    from specfit.selection.cost_model import CostModel

    ref = reference(fp8, torch.float32)
    ids = torch.randint(2, 256, (1, 8), generator=torch.Generator().manual_seed(4))
    want = ref.generate(ids, max_new_tokens=16, do_sample=False)
    drafter = SelfDrafter(ref, first_token=int(ids[0, 0]), noise=0.3)
    model = specfit.from_pretrained(fp8, cache_slots=4, dtype=torch.float32, drafter=drafter,
                                    cost_model=CostModel(intercepts=tuple(1 + 0.05 * n for n in range(8)), beta=0.01))
    for assistant in (None, "eagle3", "specfit"):
        got = model.generate(ids, max_new_tokens=16, do_sample=False, assistant=assistant)
        assert torch.equal(got, want), assistant


def test_the_host_lane_dequantizes_fp8_per_use_and_stays_lossless(fp8):
    """FP8 experts computed on the host lane from their arena rows as stored (dequantized per use, as the device
    does): greedy output equals transformers' own FP8 load, with every cold expert on the host, or chosen per expert."""
    from specfit.offload.host_lane import HostConfig

    ids = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(6))
    want = reference(fp8, torch.float32).generate(ids, max_new_tokens=10, do_sample=False)
    for cold in ("host", "auto"):
        model = specfit.from_pretrained(fp8, cache_slots=3, dtype=torch.float32, link=1e-4,
                                        host=HostConfig(bandwidth=1e9), cold=cold)
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), want), cold
        assert model.specfit.stats.last_generate.host_experts > 0


@pytest.mark.parametrize("method", ["mxfp4", "gptq", "awq", "bitsandbytes"])
def test_other_quantizations_are_refused_by_name(tmp_path, method):
    tiny_moe(seed=1).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"quantized \('{method}'"):
        specfit.from_pretrained(tmp_path, cache_slots=2)


def test_truncated_scale_tensor_is_named(tmp_path):
    write_fp8(tmp_path, shard=None)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.layers.1.mlp.experts.9.down_proj.weight_scale_inv"
    tensors[key] = tensors[key][:-1]  # one block row short
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layer 1 expert 9 down_proj_scale_inv: shape \(7, 2\), expected \(8, 2\)"):
        specfit.from_pretrained(tmp_path, cache_slots=2)


def test_missing_scale_and_bad_block_size_are_named(tmp_path):
    write_fp8(tmp_path, shard=None)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv"]
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.3\.mlp\.experts\.0\.gate_proj\.weight_scale_inv"):
        specfit.from_pretrained(tmp_path, cache_slots=2)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size \[128, 128\] does not tile"):
        specfit.from_pretrained(tmp_path, cache_slots=2)


@pytest.mark.skipif(not __import__("specfit").embedded.available(), reason="the embedded model is not installed")
def test_embedded_fp8_variant_is_built_in_the_user_cache_and_lossless(tmp_path, monkeypatch):
    from specfit import embedded

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "default_link_seconds", lambda refresh=False: 1e-6)
    model, tokenizer = embedded.load(12, fp8=True, drafter=False, link=embedded.default_link())
    folder = Path(model.name_or_path)
    assert folder.is_relative_to(tmp_path)  # built in the user cache, never inside the installed package
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["weight_block_size"] == [8, 16]
    bf16, _ = embedded.load(12, drafter=False)
    assert bf16.specfit.store.dtype == torch.bfloat16  # the shipped experts as stored (computed in fp32)
    assert model.specfit.store.weight_bytes <= 0.55 * bf16.specfit.store.weight_bytes
    link = model.specfit.config.link  # per byte: a bf16 expert costs the rule's time, an FP8 one about half
    assert link.copy_time(bf16.specfit.store.expert_bytes) == pytest.approx(1e-6)
    assert link.copy_time(model.specfit.store.expert_bytes) == pytest.approx(1e-6 * 3960 / 7680)
    ref = reference(folder, torch.float32)  # plain transformers on the same folder, as a user loads it
    ids = tokenizer("Question: A farmer has 12 cows and buys 5 more. How many cows?\nAnswer:",
                    return_tensors="pt").input_ids
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False),
                       ref.generate(ids, max_new_tokens=12, do_sample=False))


def test_fp8_parameters_of_a_loaded_model_are_refused_not_misread():
    """A model whose experts are FP8 parameters (transformers' FP8Experts, where it runs FP8 kernels) cannot be
    enabled: its bytes would be multiplied as if they were weights in the compute dtype."""
    from specfit.offload.store import ExpertStore

    with pytest.raises(ValueError, match=r"float8_e4m3fn parameters.*specfit\.from_pretrained"):
        ExpertStore(1, 4, H, I, torch.float8_e4m3fn, pin=False)


def test_bf16_experts_stay_bf16_in_an_fp32_model_and_a_wrong_config_dtype_is_named(tmp_path):
    tiny_moe(seed=2).to(torch.bfloat16).save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (1, 7))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = specfit.from_pretrained(tmp_path, cache_slots=4, dtype=torch.float32)
    assert model.specfit.store.dtype == torch.bfloat16 and model.specfit.store.expert_bytes == 3 * I * H * 2
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.layers.0.mlp.experts.3.up_proj.weight"
    tensors[key] = tensors[key].float()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layer 0 expert 3: up_proj is stored as torch.float32.*torch.bfloat16"):
        specfit.from_pretrained(tmp_path, cache_slots=4, dtype=torch.float32)
