"""Reading and writing EAGLE-3 drafter checkpoints: public key layouts, aux-layer conventions, fit checks."""

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter
from specfit.drafting.formats import load_drafter, save_drafter
from specfit.training.ttt import draft_vocab_from_counts

V, H, VD, N_LAYERS = 256, 64, 100, 4  # the tiny target: vocab, hidden, layers; the drafter's draft vocab


@pytest.fixture(scope="module")
def target():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    )
    return Qwen3MoeForCausalLM(config).eval()


def make_drafter(**overrides) -> Eagle3Drafter:
    fields = dict(
        hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, vocab_size=V, draft_vocab_size=VD,
        target_hidden_size=H, aux_layer_ids=(1, 1, 0),
    )
    torch.manual_seed(1)
    drafter = Eagle3Drafter(Eagle3Config(**{**fields, **overrides}))
    c = drafter.config
    counts = {i: 1 + (i * 37) % 101 for i in range(c.vocab_size)}
    d2t, t2d = draft_vocab_from_counts(counts, c.draft_vocab_size, c.vocab_size)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    for p in drafter.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    return drafter.eval()


def checkpoint(tmp_path, drafter, name="base"):
    """Save with save_drafter and return (folder, config dict, state dict) to derive other layouts from."""
    folder = tmp_path / name
    save_drafter(drafter, folder)
    return folder, json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def write(folder, config, state, fmt="safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


def run(drafter, seed=2):
    torch.manual_seed(seed)
    ids, feats = torch.randint(0, V, (1, 6)), torch.randn(1, 6, 3 * drafter.config.target_hidden_size)
    with torch.no_grad():
        return drafter(ids, feats, torch.arange(6)[None])[0]


def speculators_config(config):
    """The same drafter described the speculators way (nested layer config, top-level HF hidden-state ids)."""
    layer = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")}
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, **layer},
        "draft_vocab_size": config["draft_vocab_size"],
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]],
        "speculators_config": {"algorithm": "eagle3", "num_speculative_tokens": 3},
    }


# ------------------------------------------------------------------------------------------------ round trips


def test_save_load_round_trip(tmp_path, target):
    drafter = make_drafter()
    drafter.set_embedding(target.get_input_embeddings())
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 1, 0], "use_aux_hidden_state": True}
    keys = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert "midlayer.self_attn.q_proj.weight" in keys and not any("embed" in k for k in keys)

    loaded = load_drafter(tmp_path / "d", target=target)
    assert loaded.config == drafter.config
    assert torch.equal(run(loaded), run(drafter))
    assert loaded._shared_embedding is target.get_input_embeddings()
    assert torch.equal(loaded.d2t, drafter.d2t) and loaded.t2d.dtype == torch.bool


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("prefix", ["", "model."])
@pytest.mark.parametrize("layer", ["midlayer.", "layers.0."])
def test_key_layouts_load_identically(tmp_path, target, fmt, prefix, layer):
    drafter = make_drafter()
    drafter.set_embedding(target.get_input_embeddings())
    _, config, state = checkpoint(tmp_path, drafter)
    state = {prefix + k.replace("midlayer.", layer): v for k, v in state.items()}
    loaded = load_drafter(write(tmp_path / "variant", config, state, fmt), target=target)
    assert loaded.config == drafter.config
    assert torch.equal(run(loaded), run(drafter))


def test_speculators_layout(tmp_path, target):
    drafter = make_drafter(aux_layer_ids=(1, 2, 3))
    drafter.set_embedding(target.get_input_embeddings())
    _, config, state = checkpoint(tmp_path, drafter)
    # vLLM naming: model. on everything but lm_head
    state = {("" if k == "lm_head.weight" else "model.") + k.replace("midlayer.", "layers.0."): v
             for k, v in state.items()}
    state["verifier_lm_head.weight"] = torch.zeros(VD, H)  # the target's head copy: ignored
    loaded = load_drafter(write(tmp_path / "spec", speculators_config(config), state), target=target)
    assert loaded.config.aux_layer_ids == (1, 2, 3)  # hidden-state indices 2, 3, 4 -> outputs of layers 1, 2, 3
    assert torch.equal(run(loaded), run(drafter))


def test_head_dim_inferred_from_q_proj(tmp_path, target):
    drafter = make_drafter(head_dim=32)  # 4 heads x 32 != hidden 64
    drafter.set_embedding(target.get_input_embeddings())
    _, config, state = checkpoint(tmp_path, drafter)
    del config["head_dim"]
    loaded = load_drafter(write(tmp_path / "nohd", config, state), target=target)
    assert loaded.config.head_dim == 32
    assert torch.equal(run(loaded), run(drafter))


def test_full_vocab_without_maps_and_owned_embedding(tmp_path, target):
    drafter = make_drafter(draft_vocab_size=V)
    _, config, state = checkpoint(tmp_path, drafter)
    del config["draft_vocab_size"], state["d2t"], state["t2d"]
    state["embed_tokens.weight"] = torch.randn(V, H)
    loaded = load_drafter(write(tmp_path / "full", config, state), dtype=torch.bfloat16)  # no target needed
    assert loaded.config.draft_vocab_size == V and loaded.to_target_ids(torch.arange(5)).tolist() == list(range(5))
    assert loaded.embed_tokens is not None and "embed_tokens.weight" in loaded.state_dict()
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.long
    assert run(loaded).shape == (1, 6, V)


# ------------------------------------------------------------------------------------------------ aux-layer ids


@pytest.mark.parametrize(
    "where, ids, convention, expected",
    [
        ("eagle_config", [1, 2, 3], "auto", (1, 2, 3)),  # SpecForge: output-of-layer ids
        ("top", [2, 3, 4], "auto", (1, 2, 3)),  # vLLM: HF hidden-state indices
        ("eagle_config", [2, 3, 3], "auto", (2, 3, 3)),  # kept, with a warning: vLLM/sglang#25454 would shift it
        ("eagle_config", [2, 3, 4], "hidden_states", (1, 2, 3)),  # override
        ("top", [1, 2, 3], "output", (1, 2, 3)),  # override
        (None, None, "auto", (1, 1, 0)),  # default (1, N//2-1, N-4) for N=4
    ],
)
def test_aux_layer_conventions(tmp_path, target, where, ids, convention, expected):
    _, config, state = checkpoint(tmp_path, make_drafter())
    del config["eagle_config"]
    if where == "eagle_config":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    elif where == "top":
        config["eagle_aux_hidden_state_layer_ids"] = ids
    folder = write(tmp_path / "aux", config, state)
    ambiguous = (where, ids[0] if ids else None, convention) == ("eagle_config", 2, "auto")
    with pytest.warns(UserWarning) if ambiguous else contextlib.nullcontext():
        loaded = load_drafter(folder, target=target, aux_layer_convention=convention)
    assert loaded.config.aux_layer_ids == expected


def test_aux_layer_default_needs_layer_count(tmp_path):
    _, config, state = checkpoint(tmp_path, make_drafter())
    del config["eagle_config"]
    folder = write(tmp_path / "noaux", config, state)
    with pytest.raises(ValueError, match="num_target_layers"):
        load_drafter(folder)
    assert load_drafter(folder, num_target_layers=48).config.aux_layer_ids == (1, 23, 44)
    config["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]
    with pytest.raises(ValueError, match="embeddings"):
        load_drafter(write(tmp_path / "zero", config, state))


# ------------------------------------------------------------------------------------------------ mismatches


def test_target_hidden_mismatch(tmp_path, target):
    drafter = make_drafter(target_hidden_size=32)
    folder, _, _ = checkpoint(tmp_path, drafter)
    with pytest.raises(ValueError, match=r"fc\.weight has shape \(64, 96\), expected \(64, 3\*target_hidden=192\)"):
        load_drafter(folder, target=target)


def test_vocab_mismatch(tmp_path, target):
    folder, _, _ = checkpoint(tmp_path, make_drafter(vocab_size=300))
    with pytest.raises(ValueError, match=r"t2d has shape \(300,\) \(vocab_size=300\), expected \(target_vocab=256,"):
        load_drafter(folder, target=target)


def test_layer_id_out_of_range(tmp_path, target):
    folder, _, _ = checkpoint(tmp_path, make_drafter(aux_layer_ids=(1, 2, 7)))
    expected = r"eagle_aux_hidden_state_layer_ids=\[1, 2, 7\].*\(1, 2, 7\).*\[0, num_hidden_layers=4\)"
    with pytest.raises(ValueError, match=expected):
        load_drafter(folder, target=target)


def test_embedding_width_mismatch(tmp_path, target):
    folder, _, _ = checkpoint(tmp_path, make_drafter(hidden_size=32, intermediate_size=48))
    expected = r"embedding has shape \(256, 64\), expected \(vocab_size=256, hidden_size=32\)"
    with pytest.raises(ValueError, match=expected):
        load_drafter(folder, target=target)


def test_missing_and_unexpected_keys(tmp_path, target):
    _, config, state = checkpoint(tmp_path, make_drafter())
    missing = {k: v for k, v in state.items() if k != "midlayer.hidden_norm.weight"}
    with pytest.raises(ValueError, match=r"missing required key\(s\): midlayer\.hidden_norm\.weight"):
        load_drafter(write(tmp_path / "missing", config, missing), target=target)
    extra = {**state, "midlayer.self_attn.q_norm.weight": torch.ones(16)}
    with pytest.raises(ValueError, match=r"unexpected key\(s\): midlayer\.self_attn\.q_norm\.weight"):
        load_drafter(write(tmp_path / "extra", config, extra), target=target)


def test_shape_against_own_config(tmp_path, target):
    _, config, state = checkpoint(tmp_path, make_drafter())
    config["intermediate_size"] = 128
    with pytest.raises(ValueError, match=r"gate_proj\.weight has shape \(96, 64\), expected \(intermediate_size=128"):
        load_drafter(write(tmp_path / "shape", config, state), target=target)


def test_bad_vocab_maps(tmp_path):
    _, config, state = checkpoint(tmp_path, make_drafter())
    unsorted = {**state, "d2t": state["d2t"].flip(0)}
    with pytest.raises(ValueError, match="strictly increasing"):
        load_drafter(write(tmp_path / "unsorted", config, unsorted), num_target_layers=N_LAYERS)
    t2d = state["t2d"].clone()
    t2d[t2d.nonzero()[0]] = False
    with pytest.raises(ValueError, match="t2d marks 99 target ids, expected draft_vocab_size=100"):
        load_drafter(write(tmp_path / "t2d", config, {**state, "t2d": t2d}), num_target_layers=N_LAYERS)


def test_unsupported_variants(tmp_path):
    _, config, state = checkpoint(tmp_path, make_drafter())
    with pytest.raises(NotImplementedError, match="fc_norm"):
        load_drafter(write(tmp_path / "fcnorm", {**config, "fc_norm": True}, state))
    with pytest.raises(NotImplementedError, match="llama3"):
        rope = {"rope_type": "llama3", "factor": 8.0}
        load_drafter(write(tmp_path / "rope", {**config, "rope_scaling": rope}, state))
