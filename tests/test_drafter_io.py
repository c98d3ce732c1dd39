"""Reading and writing EAGLE-3 drafter checkpoints: public key layouts, aux-layer conventions, the norm flags each
tool writes, fit checks, and errors that name the unreadable file."""

import contextlib
import json
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specfit.drafting.capture import AuxCapture
from specfit.drafting.drafter import DraftCache, Eagle3Config, Eagle3Drafter
from specfit.drafting.formats import load_drafter, save_drafter
from specfit.selection.route_predictor import RoutePredictor
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
        target_hidden_size=H, aux_layer_ids=(0, 1, 1),
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


def inputs(drafter, seed=2):
    torch.manual_seed(seed)
    return torch.randint(0, V, (1, 6)), torch.randn(1, 6, 3 * drafter.config.target_hidden_size)


def run(drafter, seed=2):
    ids, feats = inputs(drafter, seed)
    with torch.no_grad():
        return drafter(ids, feats, torch.arange(6)[None])[0]


def assert_matches_reference(model, drafter, **flags) -> torch.Tensor:
    """``model``'s logits and fed-back states on ``inputs`` equal ``reference`` of ``drafter``'s weights with the
    given norm flags; returns the logits."""
    ids, feats = inputs(drafter)
    with torch.no_grad():
        logits, fed = model(ids, feats, torch.arange(6)[None])
    want_logits, want_fed = reference(drafter, ids, feats, **flags)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(fed, want_fed)
    return logits


def reference(d, ids, feats, norm_before_residual=False, lm_head_norm=True, normed_feedback=False):
    """The first drafting step written out from ``d``'s weights, with each norm flag as the references apply it:
    SpecForge ``compute_logits`` (norm_output), speculators ``Eagle3DecoderLayer`` / vLLM ``llama_eagle3.py``
    (norm_before_residual: the residual is hidden_norm(hidden); norm_output: the normed state is fed back).
    -> (logits [1, T, Vd], the state fed back [1, T, H])."""
    m, eps = d.midlayer, d.config.rms_norm_eps

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    with torch.no_grad():
        x = feats @ d.fc.weight.T  # [1, T, H]
        normed = rms(x, m.hidden_norm.weight)
        residual = normed if norm_before_residual else x
        qkv_in = torch.cat([rms(d.embed(ids), m.input_layernorm.weight), normed], -1)  # [1, T, 2H]
        q, k, v = m.self_attn.project(qkv_in, torch.arange(ids.shape[1])[None])
        rep = q.shape[1] // k.shape[1]
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        h = residual + m.self_attn.output(a)
        h = h + m.mlp(rms(h, m.post_attention_layernorm.weight))
        n = rms(h, d.norm.weight)
        return d.lm_head(n if lm_head_norm else h), (n if normed_feedback else h)


def speculators_state(state):
    """vLLM / speculators key naming: ``model.`` on everything but lm_head, ``layers.0.`` for the midlayer."""
    return {("" if k == "lm_head.weight" else "model.") + k.replace("midlayer.", "layers.0."): v
            for k, v in state.items()}


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
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 1], "use_aux_hidden_state": True}
    assert "norm_output" not in config  # SpecForge's default (true) is left implicit: vLLM reads the field otherwise
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
    state = speculators_state(state)
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
        (None, None, "auto", (0, 1, 1)),  # default (1, N//2-1, N-4) for N=4, in ascending order
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


# ------------------------------------------------------------------------------------------------ norm flags


def test_reference_is_the_default_drafter(target):
    drafter = make_drafter()
    drafter.set_embedding(target.get_input_embeddings())
    assert_matches_reference(drafter, drafter)


@pytest.mark.parametrize("norm_output", [False, True])
def test_specforge_norm_output(tmp_path, target, norm_output):
    """SpecForge (llama3_eagle.py compute_logits, default true): true scores lm_head(norm(h)), false scores lm_head(h);
    the pre-norm h is fed back either way."""
    drafter = make_drafter()
    drafter.set_embedding(target.get_input_embeddings())
    _, config, state = checkpoint(tmp_path, drafter)
    config["norm_output"] = norm_output
    loaded = load_drafter(write(tmp_path / "specforge", config, state), target=target)
    assert loaded.config.lm_head_norm is norm_output and loaded.config.normed_feedback is False
    logits = assert_matches_reference(loaded, drafter, lm_head_norm=norm_output)
    assert bool((logits - run(drafter)).abs().max() > 0.1) is not norm_output  # false really changes the logits
    # written back only when false (SpecForge's default is true), and read back the same
    save_drafter(loaded, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text()).get("norm_output", True) is norm_output
    assert torch.equal(run(load_drafter(tmp_path / "again", target=target)), logits)


@pytest.mark.parametrize("norm_output", [None, False, True])
def test_speculators_norm_output(tmp_path, target, norm_output):
    """speculators (eagle3 core.py, default false) / vLLM (llama_eagle3.py aux_output): true feeds norm(h) back to the
    next step; the logits are lm_head(norm(h)) either way."""
    drafter = make_drafter(aux_layer_ids=(1, 2, 3))
    drafter.set_embedding(target.get_input_embeddings())
    _, config, state = checkpoint(tmp_path, drafter)
    spec = speculators_config(config)
    if norm_output is not None:
        spec["norm_output"] = norm_output
    loaded = load_drafter(write(tmp_path / "spec", spec, speculators_state(state)), target=target)
    normed = bool(norm_output)
    assert loaded.config.normed_feedback is normed and loaded.config.lm_head_norm is True
    ids, feats = inputs(drafter)
    pos, nxt, nxt_pos = torch.arange(6)[None], torch.randint(0, V, (1, 1)), torch.tensor([[6]])
    cache = DraftCache()
    with torch.no_grad():
        logits, fed = loaded(ids, feats, pos, cache=cache)
        got_next, _ = loaded(nxt, fed[:, -1:], nxt_pos, cache=cache)
        # the second step by hand: the default drafter given the state the reference feeds back
        steps = {}
        for by_hand in (False, True):
            ref_cache = DraftCache()
            _, h = drafter(ids, feats, pos, cache=ref_cache)
            back = drafter.norm(h) if by_hand else h
            steps[by_hand] = drafter(nxt, back[:, -1:], nxt_pos, cache=ref_cache)[0]
    want_logits, want_fed = reference(drafter, ids, feats, normed_feedback=normed)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(fed, want_fed)
    torch.testing.assert_close(got_next, steps[normed])
    assert (steps[True] - steps[False]).abs().max() > 0.1  # the fed-back state matters from the second step on


@pytest.mark.parametrize(
    "layout, value, expected",
    [
        ("speculators", None, True),  # vLLM algos.py update_eagle3: config_dict.get("norm_before_residual", True)
        ("speculators", False, False),
        ("speculators", True, True),
        ("flat", None, False),  # vLLM llama_eagle3.py: getattr(config, "norm_before_residual", False)
        ("flat", True, True),
    ],
)
def test_norm_before_residual(tmp_path, target, layout, value, expected):
    drafter = make_drafter(aux_layer_ids=(1, 2, 3))
    drafter.set_embedding(target.get_input_embeddings())
    _, config, state = checkpoint(tmp_path, drafter)
    if layout == "speculators":
        config, state = speculators_config(config), speculators_state(state)
    config.pop("norm_before_residual", None)
    if value is not None:
        config["norm_before_residual"] = value
    loaded = load_drafter(write(tmp_path / layout, config, state), target=target)
    assert loaded.config.norm_before_residual is expected
    logits = assert_matches_reference(loaded, drafter, norm_before_residual=expected)
    assert bool((logits - run(drafter)).abs().max() > 0.1) is expected


@pytest.mark.parametrize("flag", ["normed_feedback", "norm_before_residual"])
def test_save_refuses_what_specforge_cannot_express(tmp_path, flag):
    with pytest.raises(NotImplementedError, match=f"no field for {flag}=true"):
        save_drafter(make_drafter(**{flag: True}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ EAGLE trainer


def test_eagle_trainer_full_vocab_checkpoint(tmp_path, target):
    """EAGLE traineagle3 with draft_vocab_size == vocab_size: scandata keeps d2t over the ids it saw (here 200 of 256)
    and t2d bool [V] marking them; save_16bit_model writes an fp16 pytorch_model.bin without the frozen embedding.
    ea_model.py deletes its d2t/t2d before load_state_dict(strict=False): the draft vocab is the target's."""
    drafter = make_drafter(draft_vocab_size=V)
    drafter.set_embedding(target.get_input_embeddings())
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.half().float())  # the values an fp16 checkpoint can hold
    state = {k: v.half() for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}
    used = sorted(random.Random(0).sample(range(V), 200))
    state["d2t"] = torch.tensor([u - i for i, u in enumerate(used)])  # int64 [200]
    state["t2d"] = torch.tensor([i in used for i in range(V)])  # bool [V]
    config = {  # eagle/traineagle3/config.json, scaled down: a plain Llama config, no eagle_config, no head_dim
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": H, "intermediate_size": 96, "max_position_embeddings": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "pretraining_tp": 1,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "float16", "use_cache": True, "vocab_size": V, "draft_vocab_size": V,
    }
    folder = write(tmp_path / "eagle", config, state, fmt="bin")
    with pytest.warns(UserWarning, match="d2t/t2d ignored: draft_vocab_size == vocab_size = 256.* 200 ids it saw"):
        loaded = load_drafter(folder, target=target, dtype=torch.float32)
    assert loaded.to_target_ids(torch.arange(V)).tolist() == list(range(V)) and bool(loaded.t2d.all())
    assert loaded.config.head_dim == 16 and loaded.config.aux_layer_ids == Eagle3Config.default_aux_layer_ids(N_LAYERS)
    assert torch.equal(run(loaded), run(drafter))


def test_full_vocab_identity_maps_load_quietly(tmp_path):
    folder, _, state = checkpoint(tmp_path, make_drafter(draft_vocab_size=V))
    assert not state["d2t"].any() and state["t2d"].all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_drafter(folder, num_target_layers=N_LAYERS)


# ------------------------------------------------------------------------------------------------ aux-layer order


@pytest.mark.parametrize("where, ids", [("eagle_config", [1, 2, 0]), ("top", [3, 1, 2])])
def test_aux_ids_out_of_order_are_fused_in_layer_order(tmp_path, target, where, ids):
    """vLLM, SGLang and EAGLE capture while walking the target's layers, so the features are concatenated in
    ascending layer order whatever order the config lists the ids in."""
    _, config, state = checkpoint(tmp_path, make_drafter())
    del config["eagle_config"]
    if where == "eagle_config":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    else:
        config["eagle_aux_hidden_state_layer_ids"] = ids
    with pytest.warns(UserWarning, match=r"not in ascending order.*output-of-layer ids \(0, 1, 2\)"):
        loaded = load_drafter(write(tmp_path / "order", config, state), target=target)
    assert loaded.config.aux_layer_ids == (0, 1, 2)
    capture = AuxCapture(target, loaded.config.aux_layer_ids)
    try:
        with torch.no_grad():
            hidden_states = target(torch.randint(0, V, (1, 5)), output_hidden_states=True).hidden_states
    finally:
        capture.remove()
    # HF hidden_states[j] is the output of layer j-1: outputs of layers 0, 1, 2, low to high
    assert torch.equal(capture.features(), torch.cat([hidden_states[1], hidden_states[2], hidden_states[3]], -1))


# ------------------------------------------------------------------------------------------------ unreadable files


@pytest.mark.parametrize("damage", ["truncated", "git-lfs pointer", "empty"])
def test_corrupt_safetensors_names_the_file(tmp_path, damage):
    folder, _, _ = checkpoint(tmp_path, make_drafter())
    weights = folder / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-8])
    elif damage == "git-lfs pointer":
        weights.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123abcd\nsize 123456\n")
    else:
        weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file .*fetch it again"):
        load_drafter(folder, num_target_layers=N_LAYERS)


def test_corrupt_shard_bin_and_config_name_the_file(tmp_path):
    folder, config, state = checkpoint(tmp_path, make_drafter())
    state = {k: v.clone() for k, v in state.items()}  # load_file maps the file, which is about to be cut short
    shard = folder / "model-00001-of-00001.safetensors"
    (folder / "model.safetensors").rename(shard)
    index = {"metadata": {}, "weight_map": {k: shard.name for k in state}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(load_drafter(folder, num_target_layers=N_LAYERS).d2t, state["d2t"])  # the sharded layout loads
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model-00001-of-00001\.safetensors: not a readable safetensors file"):
        load_drafter(folder, num_target_layers=N_LAYERS)
    (folder / "model.safetensors.index.json").write_text("{\"weight_map\": ")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        load_drafter(folder, num_target_layers=N_LAYERS)

    binary = write(tmp_path / "bin", config, state, fmt="bin")
    weights = binary / "pytorch_model.bin"
    for damaged in (weights.read_bytes()[:-200], b"garbage, not a pickle", b""):
        weights.write_bytes(damaged)
        with pytest.raises(ValueError, match=r"pytorch_model\.bin: not a readable PyTorch checkpoint"):
            load_drafter(binary, num_target_layers=N_LAYERS)

    (binary / "config.json").write_text("{\"hidden_size\": 64,")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_drafter(binary, num_target_layers=N_LAYERS)


def test_corrupt_route_predictor_names_the_file(tmp_path):
    RoutePredictor(2, 4, 8, 2).save(tmp_path)
    weights = tmp_path / "route_predictor.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"route_predictor\.safetensors: not a readable safetensors .*train-router"):
        RoutePredictor.load(tmp_path)
    save_file({"bias": torch.zeros(2, 4)}, str(weights))
    with pytest.raises(ValueError, match=r"route_predictor\.safetensors: no tensor 'weight'"):
        RoutePredictor.load(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"no route predictor in .*specfit train-router"):
        RoutePredictor.load(tmp_path)
    (tmp_path / "route_predictor.json").write_text("{")
    with pytest.raises(ValueError, match=r"route_predictor\.json: not valid JSON"):
        RoutePredictor.load(tmp_path)


def test_missing_repo_like_path_offline(tmp_path, monkeypatch):
    """With the hub switched off (HF_HUB_OFFLINE), a path that is not here but looks like owner/name says so."""
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(FileNotFoundError, match=r"nosuchowner/nosuchdrafter: no such folder, and no hub access") as e:
        load_drafter("nosuchowner/nosuchdrafter", num_target_layers=N_LAYERS)
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chained hub traceback


def test_missing_repo_like_path_unreachable_hub(tmp_path, monkeypatch):
    """The hub cannot be reached (simulated): the hub's "check your internet connection" advice is not the answer."""
    import huggingface_hub
    from huggingface_hub.utils import LocalEntryNotFoundError

    def unreachable(repo_id, **kwargs):
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub and we cannot "
                                      "find the appropriate snapshot folder. Please check your internet connection.")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(FileNotFoundError, match="no such folder, and no hub access") as e:
        load_drafter("owner/drafter", num_target_layers=N_LAYERS)
    assert "internet" not in str(e.value) and e.value.__cause__ is None
    with pytest.raises(FileNotFoundError, match=r"no drafter checkpoint at \./owner/drafter: no such file or folder"):
        load_drafter("./owner/drafter", num_target_layers=N_LAYERS)


def test_drafter_and_route_head_can_be_saved_in_bfloat16(tmp_path):
    """The embedded drafter and route predictor ship in bfloat16 (half the bytes); loading casts them back, close to
    the float32 originals, and the vocabulary maps stay exact."""
    drafter = make_drafter()
    save_drafter(drafter, tmp_path / "d", dtype=torch.bfloat16)
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == drafter.d2t.dtype
    assert json.loads((tmp_path / "d" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_drafter(tmp_path / "d")
    torch.testing.assert_close(back.fc.weight.float(), drafter.fc.weight, rtol=1e-2, atol=1e-2)
    assert torch.equal(back.d2t, drafter.d2t) and torch.equal(back.t2d, drafter.t2d)
    head = RoutePredictor(2, 8, 16, 2)
    torch.nn.init.normal_(head.weight)
    head.save(tmp_path / "h", dtype=torch.bfloat16)
    assert load_file(tmp_path / "h" / "route_predictor.safetensors")["weight"].dtype == torch.bfloat16
    loaded = RoutePredictor.load(tmp_path / "h")
    assert loaded.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.weight, head.weight, rtol=1e-2, atol=1e-2)
