"""The GPU check's scripts' CPU-runnable parts (tests/gpu/): the synthetic hub-layout checkpoint writer, the decode
check, the host-expert check (the prepared GPU check itself: tests/test_gpu_check.py)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

import specfit
from specfit.selection.cost_model import CostModel
from specfit.drafting.drafter import Eagle3Config
from specfit.drafting.formats import load_drafter

GPU_CHECK = Path(__file__).resolve().parent / "gpu"
sys.path.insert(0, str(GPU_CHECK))
import decode_check  # noqa: E402
import synthetic_checkpoint as sc  # noqa: E402


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """The tiny preset (4 layers x 128 experts, top-8, hidden 64) in bf16, in ~200 KB shards, with a drafter."""
    root = tmp_path_factory.mktemp("synthetic")
    summary = sc.write_checkpoint(root / "ckpt", "tiny", shard_size="200KB", workers=1)
    sc.write_drafter(root / "drafter", summary["config"], draft_vocab_size=256)
    return root, summary


def test_checkpoint_has_the_hub_layout(tiny_ckpt, tmp_path):
    root, summary = tiny_ckpt
    folder = root / "ckpt"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) == summary["shards"] > 10
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", p.name) for p in shards)
    stored, total = {}, 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                stored[key] = shard.name
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
                assert t.dtype == torch.bfloat16
    assert stored == index["weight_map"] and index["metadata"]["total_size"] == total
    assert "model.layers.3.mlp.experts.127.down_proj.weight" in stored and "lm_head.weight" in stored
    # the same key set as transformers' own save_pretrained of this architecture (which writes the hub layout)
    config = AutoConfig.from_pretrained(folder)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="1MB")
    assert set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) == set(stored)
    assert max(p.stat().st_size for p in shards) < 200_000 + 2 * 128 * 64 * 2  # shards near --shard-size
    gen = GenerationConfig.from_pretrained(folder)
    assert gen.eos_token_id == [2, 1] and gen.bos_token_id == 1


def test_weights_are_seeded_per_tensor(tiny_ckpt, tmp_path):
    root, _ = tiny_ckpt
    sc.write_checkpoint(tmp_path, "tiny", layers=1, shard_size="4GB", workers=2)
    index = json.loads((root / "ckpt" / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.0.mlp.experts.5.up_proj.weight"
    one_layer = tmp_path / "model-00001-of-00001.safetensors"
    with safe_open(str(root / "ckpt" / index[key]), "pt") as a, safe_open(str(one_layer), "pt") as b:
        assert torch.equal(a.get_tensor(key), b.get_tensor(key))  # same name, same seed: same tensor
        assert abs(a.get_tensor(key).float().std().item() - 0.02) < 0.002
        assert torch.equal(b.get_tensor("model.layers.0.input_layernorm.weight"), torch.ones(64, dtype=torch.bfloat16))


def test_both_loaders_agree_on_the_synthetic_checkpoint(tiny_ckpt):
    torch.set_num_threads(1)
    folder = tiny_ckpt[0] / "ckpt"
    ids = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = specfit.from_pretrained(folder, cache_slots=12, dtype=torch.float32, device="cpu")
    assert reference.config.rope_parameters["rope_theta"] == 1e6 and reference.config.norm_topk_prob
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    assert model.specfit.store.weight_bytes == 4 * 128 * 3 * 32 * 64 * 2  # bf16 as stored (computed in fp32)


def test_real_preset_has_the_real_shapes(tmp_path):
    """Qwen3-30B-A3B from the preset's config.json on the meta device: no weights written."""
    config = sc.hub_config("qwen3-30b-a3b")
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(loaded)
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (128, 1536, 2048) and tuple(experts.down_proj.shape) == (128, 2048, 768)
    assert len(model.model.layers) == 48 and loaded.num_experts_per_tok == 8 and loaded.head_dim == 128
    assert tuple(model.model.layers[0].self_attn.q_proj.weight.shape) == (4096, 2048)
    assert model.lm_head.weight is not model.model.embed_tokens.weight and loaded.vocab_size == 151936
    assert experts.gate_up_proj[0].numel() * 2 + experts.down_proj[0].numel() * 2 == 9_437_184  # one expert, bf16
    shapes = sc.tensor_shapes(config)
    assert sum(sc._numel(s) for _, s in shapes) == sum(p.numel() for p in model.parameters()) == 30_532_122_624
    assert len(sc.plan_shards(shapes, 2, sc.parse_size("4GB"))) == 16  # as many shards as the hub's
    reduced = sc.hub_config("qwen3-30b-a3b", layers=12)
    assert reduced["num_hidden_layers"] == 12 and reduced["hidden_size"] == 2048
    assert Eagle3Config.default_aux_layer_ids(12) == (1, 5, 8)


def test_parse_size():
    assert [sc.parse_size(s) for s in ("4GB", "100KB", "1GiB", "2MiB", "77", 5)] == [
        4_000_000_000, 100_000, 2**30, 2 * 2**20, 77, 5]
    with pytest.raises(ValueError, match="size"):
        sc.parse_size("4 parsecs")


def test_decode_check_on_cpu(tiny_ckpt, tmp_path, capsys):
    root, summary = tiny_ckpt
    drafter = load_drafter(root / "drafter", num_target_layers=4)
    assert drafter.config.aux_layer_ids == Eagle3Config.default_aux_layer_ids(4)
    assert drafter.config.hidden_size == 64 and drafter.config.draft_vocab_size == 256
    profile = CostModel(intercepts=(0.01,) * 8, beta=1e-4, copy_overhead=2e-4,
                        link_share=1.0).save(tmp_path / "profile.json")  # a v3 profile: it prices copies
    out = tmp_path / "decode.json"
    decode_check.main(["--model", str(root / "ckpt"), "--drafter", str(root / "drafter"), "--slots", "12",
                       "--profile", str(profile), "--dtype", "float32", "--device", "cpu", "--threads", "1",
                       "--prompts", "2", "--prompt-len", "8", "--new-tokens", "6", "--json", str(out)])
    table = capsys.readouterr().out
    # the drafter is as wide as the target and no predictor is attached: "auto" ran the target's gates
    assert "| AR |" in table and "| EAGLE-3 |" in table and "| SpecFit (gate routes) |" in table
    report = json.loads(out.read_text())
    r = report["results"]
    assert set(r) == {"ar", "eagle3", "specfit"}
    assert all(x["new_tokens"] == 12 and x["tokens_per_second"] > 0 for x in r.values())
    assert r["eagle3"]["same_as_ar"] == r["specfit"]["same_as_ar"] == 2  # fp32 greedy: lossless
    assert r["specfit"]["route_source"] == "gate" and r["ar"]["route_source"] is None
    assert all(x["syncs"] > 0 and x["sync_counter"] == "would-be syncs (CPU count)" for x in r.values())
    assert r["eagle3"]["nodes_per_cycle"] == 7 and r["ar"]["tokens_per_cycle"] == 1
    assert report["info"]["cost_model"]["beta"] == 1e-4 and not report["info"]["warnings"]
    assert all(x["warmup_prefill_hits"] == 0 for x in r.values())  # every mode starts from empty slots
    assert all(x["copy_bandwidth"] > 0 and x["pageable_copies"] == 0 for x in r.values())
    assert table.index("| mode |") < table.index("| AR |") < table.index("| EAGLE-3 |")  # rows printed as they come
    assert "copy GB/s" in table and "expert bytes pinned" in table.splitlines()[0]


def test_decode_check_require_pinned_fails_where_copies_are_not_pinned(tiny_ckpt, capsys):
    root, _ = tiny_ckpt
    rc = decode_check.main(["--model", str(root / "ckpt"), "--drafter", str(root / "drafter"), "--slots", "12",
                            "--dtype", "float32", "--device", "cpu", "--threads", "1", "--modes", "ar",
                            "--prompts", "1", "--prompt-len", "4", "--new-tokens", "2", "--require-pinned"])
    assert rc == 1 and "FAIL (--require-pinned)" in capsys.readouterr().out


def reference_check(root, *extra):
    return decode_check.main(["--model", str(root / "ckpt"), "--drafter", str(root / "drafter"), "--slots", "12",
                              "--dtype", "bfloat16", "--device", "cpu", "--threads", "1", "--modes", "ar",
                              "--prompts", "1", "--prompt-len", "16", "--new-tokens", "3", "--reference", *extra])


def test_decode_check_reference_passes_through_the_grouped_path(tiny_ckpt, capsys):
    """The grouped path rounds differently from the reference's gathered bmm on some CPUs (bf16 kernels that differ
    with shape): the gate passes on rounding, with the reference's routes replayed, and checks every mode's tokens."""
    assert reference_check(tiny_ckpt[0], "--grouped", "--require-grouped") == 0
    out = capsys.readouterr().out
    assert "RESULT reference: pass: slot cache (12 of 128 slots, grouped experts)" in out
    assert "the reference's routes replayed; the router disagreed on " in out
    gap = float(re.search(r"experts outputs (\d\.\d{4}) \(worst of 16 layer forwards\)", out)[1])  # 4 x (1 + 3)
    layer = float(re.search(r"first MoE layer's prefill \(16 tokens, \d+ experts\): (\d\.\d{4})", out)[1])
    assert gap < 0.1 and layer < 0.1  # rounding, far below the 0.25 a wrong expert would pass
    assert "RESULT tokens AR: pass: 3 greedy tokens teacher-forced through the reference" in out


def test_decode_check_fails_on_a_wrong_expert_output(tiny_ckpt, capsys, monkeypatch):
    """Issue 29, 2: one layer's loads bring the next expert's weights (a wrong slot): the gate fails the run."""
    from specfit.offload.cache import LayerCache

    copy = LayerCache._copy

    def wrong(self, loads, counters, after=(), prefetch=False):
        return copy(self, [((e + 1) % 128 if self.layer == 1 else e, s) for e, s in loads], counters, after, prefetch)

    monkeypatch.setattr(LayerCache, "_copy", wrong)
    assert reference_check(tiny_ckpt[0]) == 1
    out = capsys.readouterr().out
    assert "RESULT reference: FAIL" in out and "FAIL (--reference): the slot cache's logits or experts" in out


def test_decode_check_require_grouped_fails_on_the_gathered_path(tiny_ckpt, capsys):
    assert reference_check(tiny_ckpt[0], "--require-grouped") == 1  # the CPU chooses the gathered path
    assert "FAIL (--require-grouped)" in capsys.readouterr().out


def test_host_expert_check_runs_on_a_cpu(tmp_path, capsys):
    """Issue 36, 8: the host-expert stage's script at toy shapes: bf16 and FP8 (dequantized per use) experts timed at
    1, 8 and 32 tokens from a worker thread; no copy to compare without CUDA."""
    import host_expert_check

    out = tmp_path / "host.json"
    assert host_expert_check.main(["--hidden", "64", "--intermediate", "32", "--block", "16", "--experts", "2",
                                   "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for name in ("bf16", "fp8"):
        assert re.search(rf"RESULT host experts {name}: 1 token \d+\.\d{{3}} ms, 8 tokens \d+\.\d{{3}} ms, 32 tokens "
                         rf"\d+\.\d{{3}} ms per expert \(1 CPU threads; [\d,]+ bytes read", text), text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["stored"], r["expert_bytes"]) for r in rows] == [("bf16", 3 * 64 * 32 * 2),
                                                                 ("fp8", 3 * 64 * 32 + 4 * (4 * 4 + 4 * 2))]
    assert all(r["copy_ms"] is None and min(r["host_ms"].values()) > 0 for r in rows)
    with pytest.raises(SystemExit, match="--formats"):
        host_expert_check.main(["--formats", "int4"])


def test_fp8_synthetic_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """The optional fp8 stage's checkpoint: the same random weights, every projection block-wise e4m3 with float32
    scales (Qwen3-30B-A3B-FP8's layout), router, norms, embedding and head in bf16; SpecFit keeps the experts as
    stored and computes what transformers' own (dequantizing, on a CPU) load computes."""
    summary = sc.write_checkpoint(tmp_path, "tiny", layers=2, shard_size="1MB", workers=1, fp8_block=16)
    assert summary["config"]["quantization_config"]["weight_block_size"] == [16, 16]
    with safe_open(str(tmp_path / json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"][
            "model.layers.1.mlp.experts.7.up_proj.weight_scale_inv"]), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.experts.7.up_proj.weight_scale_inv").shape == (2, 4)
        assert f.get_tensor("model.layers.1.mlp.experts.7.up_proj.weight").dtype == torch.float8_e4m3fn
    ids = torch.randint(3, 512, (1, 7), generator=torch.Generator().manual_seed(0))
    model = specfit.from_pretrained(tmp_path, cache_slots=12, dtype=torch.float32, device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert model.specfit.store.format.name == "fp8" and model.specfit.store.expert_bytes == 3 * 32 * 64 + 4 * 24
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not tile"):
        sc.stored_tensors("model.layers.0.self_attn.q_proj.weight", (64, 64), 48)
