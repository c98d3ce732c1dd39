"""state_dict(), save_pretrained() and load_state_dict() of an enabled model see every routed expert (read from or
written to SpecFit's host store) exactly as on the plain model; a saved checkpoint reloads in plain transformers."""

import json
import os

import pytest
import torch
from safetensors import safe_open

import specfit
from specfit import embedded
from specfit.offload import checkpoint
from families import tiny

# fused experts (qwen3_moe), per-expert renamed checkpoints (mixtral), transposed with biases (gpt_oss), experts
# outside transformers' interface (llama4_text)
SAVED = ("qwen3_moe", "mixtral", "gpt_oss", "llama4_text")
IDS = torch.tensor([[3, 5, 7, 9, 11]])


def greedy(model, n=8):
    return model.generate(IDS, max_new_tokens=n, do_sample=False)


def files(folder) -> dict:
    """Every tensor of the safetensors files in ``folder``, by key."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", SAVED)
def test_state_dict_equals_the_plain_models(family):
    plain = tiny(family).state_dict()
    model = specfit.enable(tiny(family), cache_slots=3)
    state = model.state_dict()
    assert same(state, plain)  # every key, in order, bit-identical values
    store = model.specfit.store
    expert = [k for k in state if ".experts." in k and k.endswith(("gate_up_proj", "down_proj"))]
    assert len(expert) == 2 * len(store.arenas)
    # each expert tensor is one of its own (a contiguous copy: the store keeps a layer's experts in one arena, whose
    # views would share memory), so safetensors saves the state dict as it saves the plain model's
    ptrs = {a.untyped_storage().data_ptr() for a in store.arenas}
    assert all(state[k].is_contiguous() and state[k].untyped_storage().data_ptr() not in ptrs for k in expert)
    assert len({state[k].untyped_storage().data_ptr() for k in expert}) == len(expert)


def stream_experts(monkeypatch, model, layers: int = 1):
    """Make save_pretrained stream the enabled ``model``'s experts from the store in groups of ``layers`` layers
    (the path of models whose experts are too large to copy at once)."""
    store = model.specfit.store
    monkeypatch.setattr(checkpoint, "EXPERT_SHARD_BYTES",
                        layers * checkpoint.expert_copy_bytes(store) // len(store.arenas))
    streamed = []
    stream = checkpoint.checkpoints.save_pretrained_streaming
    monkeypatch.setattr(checkpoint.checkpoints, "save_pretrained_streaming",
                        lambda *a, **k: streamed.append(stream(*a, **k)))
    return streamed


@pytest.mark.parametrize("family", SAVED)
def test_saved_checkpoint_equals_the_plain_one_and_reloads_in_plain_transformers(family, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    plain = tiny(family)
    plain.save_pretrained(tmp_path / "plain")
    model = specfit.enable(tiny(family), cache_slots=3)
    greedy(model)  # slots filled: what is saved is the store, not what happens to be on the device
    streamed = stream_experts(monkeypatch, model)
    model.save_pretrained(tmp_path / "enabled", max_shard_size="20KB")  # several groups of layers
    assert streamed
    assert same(dict(sorted(files(tmp_path / "enabled").items())), dict(sorted(files(tmp_path / "plain").items())))
    assert json.loads((tmp_path / "enabled" / "config.json").read_text()) == \
        json.loads((tmp_path / "plain" / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "enabled").eval()
    assert same(reloaded.state_dict(), plain.state_dict())
    assert torch.equal(greedy(reloaded), greedy(plain))


def test_a_small_model_saves_the_files_the_plain_model_saves(tmp_path):
    """Experts that fit in one copy are saved in one pass, as transformers saves the plain model: one
    model.safetensors (no index) for a small model, the plain model's shards under max_shard_size."""
    for shard in ("50GB", "20KB"):
        tiny("qwen3_moe").save_pretrained(tmp_path / f"plain-{shard}", max_shard_size=shard)
        model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
        model.save_pretrained(tmp_path / f"enabled-{shard}", max_shard_size=shard)
        assert sorted(os.listdir(tmp_path / f"enabled-{shard}")) == sorted(os.listdir(tmp_path / f"plain-{shard}"))
        assert same(files(tmp_path / f"enabled-{shard}"), files(tmp_path / f"plain-{shard}"))
    assert "model.safetensors" in os.listdir(tmp_path / "enabled-50GB")


def test_streamed_index_total_size_counts_the_expert_shards(tmp_path, monkeypatch):
    """The index's total_size is every tensor's bytes, the expert shards' included, as the plain model's index."""
    tiny("qwen3_moe").save_pretrained(tmp_path / "plain", max_shard_size="20KB")
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
    streamed = stream_experts(monkeypatch, model)
    model.save_pretrained(tmp_path / "enabled", max_shard_size="20KB")
    assert streamed
    index = json.loads((tmp_path / "enabled" / "model.safetensors.index.json").read_text())
    stored = sum(t.numel() * t.element_size() for t in files(tmp_path / "enabled").values())
    experts = sum(t.numel() * t.element_size() for k, t in files(tmp_path / "enabled").items() if ".experts." in k)
    assert experts > stored / 2
    assert index["metadata"]["total_size"] == stored
    plain = json.loads((tmp_path / "plain" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == plain["metadata"]["total_size"]


def test_saving_again_into_the_same_folder_replaces_the_checkpoint(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
    with monkeypatch.context() as m:
        stream_experts(m, model)
        model.save_pretrained(tmp_path, max_shard_size="20KB")
    many = len(os.listdir(tmp_path))
    model.save_pretrained(tmp_path)  # one file, as the plain model saves it: none of the first save's may stay
    assert len(os.listdir(tmp_path)) < many
    assert {n for n in os.listdir(tmp_path) if "safetensors" in n} == {"model.safetensors"}
    assert same(AutoModelForCausalLM.from_pretrained(tmp_path).state_dict(), tiny("qwen3_moe").state_dict())


def test_experts_are_copied_one_group_at_a_time(monkeypatch):
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
    store = model.specfit.store
    layer_bytes = store.weight_bytes // len(store.arenas)
    layers = checkpoint.expert_keys(model)
    groups = checkpoint._groups(model, layers, limit=2 * layer_bytes)
    read = [g() for g in groups]
    assert [len(g) for g in read] == [4, 4]  # two layers (two tensors each) per group of 2 layers' bytes
    assert sum(t.numel() * t.element_size() for t in read[0].values()) <= 2 * layer_bytes
    assert len(checkpoint._groups(model, layers, limit=1)) == len(store.arenas)  # one layer at least


def test_load_state_dict_writes_through_to_the_store():
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
    greedy(model)  # slots hold copies of the old experts
    other = tiny("qwen3_moe", seed=1)
    model.load_state_dict(other.state_dict())
    assert same(model.state_dict(), other.state_dict())
    with torch.no_grad():  # the slots filled before the load hold none of the old values
        torch.testing.assert_close(model(IDS).logits, other(IDS).logits, rtol=0, atol=1e-5)
    assert torch.equal(greedy(model), greedy(other))


def test_load_state_dict_refuses_a_wrong_shape_and_reports_missing_experts():
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = tiny("qwen3_moe", seed=1).state_dict()
    key = "model.layers.1.mlp.experts.down_proj"
    state[key] = state[key][:, :, :5]
    with pytest.raises(RuntimeError, match=r"layers\.1\.mlp\.experts.*down_proj.*shape"):
        model.load_state_dict(state)
    assert torch.equal(model.state_dict()[key], before[key])
    del state[key]
    with pytest.raises(RuntimeError, match=r"Missing key.*layers\.1\.mlp\.experts\.down_proj"):
        model.load_state_dict(state)
    result = model.load_state_dict(state, strict=False)
    assert key not in result.unexpected_keys


def test_save_pretrained_refuses_what_it_cannot_do_as_asked(tmp_path):
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
    with pytest.raises(ValueError, match=r"without state_dict=, or specfit\.disable\(model\)"):
        model.save_pretrained(tmp_path, state_dict=model.state_dict())
    with pytest.raises(ValueError, match=r"model\.push_to_hub\(repo_id\)"):
        model.save_pretrained(tmp_path, push_to_hub=True)
    assert not os.listdir(tmp_path)


def test_disable_removes_the_hooks():
    model = tiny("qwen3_moe")
    plain = model.state_dict()
    specfit.enable(model, cache_slots=3)
    specfit.disable(model)
    assert "save_pretrained" not in vars(model)
    assert all(not m._state_dict_hooks and not m._load_state_dict_pre_hooks for m in model.modules())
    assert same(model.state_dict(), plain)


@pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")
def test_embedded_model_saved_enabled_reloads_identical(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = AutoModelForCausalLM.from_pretrained(embedded.TARGET_DIR, dtype=torch.float32).eval()
    model, _ = embedded.load(12, drafter=False)
    assert same(model.state_dict(), plain.state_dict())  # 531 keys, the 96 expert tensors among them
    model.save_pretrained(tmp_path / "enabled")
    plain.save_pretrained(tmp_path / "plain")
    assert same(dict(sorted(files(tmp_path / "enabled").items())), dict(sorted(files(tmp_path / "plain").items())))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "enabled").eval()
    ids = AutoTokenizer.from_pretrained(embedded.TARGET_DIR)("Question: Tom has 3 boxes", return_tensors="pt")
    out = plain.generate(ids.input_ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(reloaded.generate(ids.input_ids, max_new_tokens=12, do_sample=False), out)
