"""The streaming loader on small sharded checkpoints written by the tests."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_moe
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import specfit


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    tiny_moe(seed=4).save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 5
    return folder


def test_equals_transformers_loader(sharded):
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(sharded).eval()
    model = specfit.from_pretrained(sharded, cache_slots=3, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False),
                       ref.generate(ids, max_new_tokens=6, do_sample=False))
    assert model.specfit.store.weight_bytes == 4 * 16 * 3 * 32 * 64 * 4
    assert not any("experts" in n for n, _ in model.named_parameters())


def test_tied_embeddings_and_bf16_checkpoint(tmp_path):
    src = tiny_moe(seed=5, tie_word_embeddings=True).to(torch.bfloat16)
    src.save_pretrained(tmp_path, max_shard_size="200KB")
    ids = torch.randint(0, 256, (1, 6))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = specfit.from_pretrained(tmp_path, cache_slots=16, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_missing_expert_key_is_named(tmp_path):
    tiny_moe(seed=6).save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    key = "model.layers.2.mlp.experts.7.up_proj.weight"
    shard = tmp_path / index["weight_map"][key]
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.2\.mlp\.experts\.7\.up_proj\.weight"):
        specfit.from_pretrained(tmp_path, cache_slots=2)


def test_missing_and_unexpected_weights(tmp_path):
    tiny_moe(seed=7).save_pretrained(tmp_path)  # one file
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.bogus"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.bogus'"):
        specfit.from_pretrained(tmp_path, cache_slots=2)
    del tensors["model.layers.0.mlp.bogus"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.norm.weight"):
        specfit.from_pretrained(tmp_path, cache_slots=2)


PEAK_RSS_SCRIPT = textwrap.dedent("""
    import sys, torch, accelerate, safetensors, transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    import transformers.models.qwen3_moe.modeling_qwen3_moe
    import specfit, specfit.offload.loader

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    base = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    model = specfit.from_pretrained(sys.argv[1], cache_slots=2, dtype=torch.float32)
    print(status("VmHWM:") - base, model.specfit.store.weight_bytes)
""")


def test_peak_host_memory_bound(tmp_path):
    """Peak RSS growth while loading <= 1.2 x checkpoint bytes (here ~100 MB in 8 MB shards)."""
    big = tiny_moe(seed=8, hidden_size=256, moe_intermediate_size=256, num_experts=32, num_attention_heads=4,
                   head_dim=64, vocab_size=512)
    big.save_pretrained(tmp_path, max_shard_size="8MB")
    del big
    ckpt = checkpoint_bytes(tmp_path)
    assert ckpt > 90e6 and len(list(tmp_path.glob("*.safetensors"))) >= 10
    out = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         check=True)
    peak, expert_bytes = map(int, out.stdout.split())
    assert expert_bytes > 0.9 * ckpt
    assert peak <= 1.2 * ckpt, f"peak RSS growth {peak / 1e6:.1f} MB for a {ckpt / 1e6:.1f} MB checkpoint"
