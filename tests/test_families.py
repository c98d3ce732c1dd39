"""Every MoE family transformers 5 ships with routed experts, as a tiny random model built in code (tests/families.py):
offloaded logits equal the model's at every slot count, ``disable`` restores it, the ``gate`` route source reproduces
the router's own routes, assistants are lossless (greedy, against plain generate() before enable) — or, for hybrid
linear-attention models, refused up front with the layer type named while plain generate() stays exact."""

import pytest
import torch
from conftest import SelfDrafter
from families import FAMILIES, HYBRID, tiny
from transformers import DynamicCache

import specfit
from specfit.seam import layers as hf_layers, routers
from specfit.selection.cost_model import CostModel
from specfit.selection.route_predictor import RoutePredictor

SUPPORTED = [f for f in FAMILIES if f not in HYBRID]
COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)  # a resident expert costs its compute, a missing one 5x that
PROMPT = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(6))
NEW = 14  # prompt + new tokens + tree > GPT-OSS's window of 8 and Llama-4's chunk of 8


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_offload_exact_at_every_slot_count_and_disable_restores(family):
    model = tiny(family)
    ids = torch.randint(2, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    ref, before = logits(model, ids), state(model)
    num_experts = hf_layers.moe_layers(model)[0].num_experts
    for slots in sorted({1, 2, num_experts}):
        specfit.enable(model, cache_slots=slots)
        assert not any(name in dict(model.named_parameters()) for name in before if ".experts." in name)
        for _ in range(2):  # cold, then warm slots
            torch.testing.assert_close(logits(model, ids), ref, rtol=1e-5, atol=1e-5)
        assert model.specfit.stats.last_forward.demand > 0  # the experts ran through SpecFit's store
        specfit.disable(model)
        after = state(model)
        assert after.keys() == before.keys()
        for name, t in before.items():
            assert torch.equal(after[name], t), name
        assert torch.equal(logits(model, ids), ref)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gate_route_source_reproduces_the_routers_routes(family):
    """The 'gate' predictor applied to each MoE layer's router input gives that layer's true routes."""
    model = tiny(family)
    layers = hf_layers.moe_layers(model)
    inputs = {}
    hooks = [m.gate.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].reshape(
        -1, args[0].shape[-1]))) for i, m in enumerate(layers)]
    specfit.enable(model, cache_slots=2)
    logits(model, torch.randint(2, 128, (1, 24), generator=torch.Generator().manual_seed(2)))
    for h in hooks:
        h.remove()
    true = model.specfit.routes.last  # [T, L, E] what the routers picked (recorded by the experts function)
    head = RoutePredictor.from_gates(model)
    assert head.top_k == int(true[0, 0].sum())
    for i in range(len(layers)):
        assert torch.equal(head.routes(inputs[i])[:, i], true[:, i]), f"MoE layer {i}"


def drafter_for(model, noise=0.3):
    """A self-drafter (the target's own copy) whose copy attends fully: it needs no sliding-window masks, and its
    drafts still agree with the target for most tokens."""
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=noise)
    config = drafter.target.config
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    drafter.kv = DynamicCache(config=config)
    return drafter


@pytest.mark.parametrize("family", SUPPORTED)
def test_assistants_lossless(family):
    expected = tiny(family).generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    model = tiny(family)
    specfit.enable(model, cache_slots=2, drafter=drafter_for(model), cost_model=COST, topk=2, depth=3,
                   pool_nodes=8, max_nodes=5)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW, do_sample=False), expected)
    for assistant, source in (("eagle3", None), ("specfit", "gate"), ("specfit", "oracle")):
        if source:
            specfit.configure(model, route_source=source)
        out = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, assistant=assistant)
        assert torch.equal(out, expected), (assistant, source)
        g = model.specfit.stats.last_generate
        assert g.new_tokens == NEW and g.cycles < NEW  # trees were verified and some drafts accepted


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_models_refuse_assistants_up_front_and_stay_exact(family):
    expected = tiny(family).generate(PROMPT, max_new_tokens=6, do_sample=False)
    model = tiny(family)
    with pytest.raises(ValueError, match="has 'linear_attention' layers"):
        specfit.enable(model, cache_slots=2, drafter=drafter_for(model))
    assert getattr(model, "specfit", None) is None  # enable undid itself
    specfit.enable(model, cache_slots=2)
    model.specfit.drafter = object()  # as if a drafter had been attached some other way
    forwards = model.specfit.stats.total.forwards
    with pytest.raises(ValueError, match="assistants .*not supported"):
        model.generate(PROMPT, max_new_tokens=6, do_sample=False, assistant="eagle3")
    assert model.specfit.stats.total.forwards == forwards  # refused before any work
    model.specfit.drafter = None
    assert torch.equal(model.generate(PROMPT, max_new_tokens=6, do_sample=False), expected)


def test_window_shorter_than_the_generation_refused_without_per_layer_masks():
    """Mixtral with a sliding window takes one mask for every layer: exact only inside the window."""
    model = tiny("mixtral", sliding_window=12)
    specfit.enable(model, cache_slots=2, drafter=drafter_for(model), cost_model=COST, pool_nodes=8, max_nodes=5)
    with pytest.raises(ValueError, match="sliding-window attention \\(window 12\\)"):
        model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, assistant="eagle3")


def test_unknown_router_is_refused_by_the_gate_source():
    class MyRouter(torch.nn.Linear):
        top_k = 2

    moe = hf_layers.MoELayer(0, torch.nn.Module(), MyRouter(4, 8))
    with pytest.raises(ValueError, match="does not know how MyRouter selects experts"):
        routers.router_rule(moe)


def test_route_predictor_keeps_its_rule_through_save_and_load(tmp_path):
    model = tiny("deepseek_v3")
    with torch.no_grad():
        for m in hf_layers.moe_layers(model):
            m.gate.e_score_correction_bias.normal_()
    head = RoutePredictor.from_gates(model)
    assert (head.scoring, head.n_group, head.topk_group, head.group_score) == ("sigmoid", 4, 2, "top2")
    head.save(tmp_path)
    loaded = RoutePredictor.load(tmp_path, model)
    states = torch.randn(20, 64)
    assert torch.equal(loaded.routes(states), head.routes(states))
    assert loaded.correction.abs().sum() > 0


def test_model_with_its_own_cache_refused_even_with_full_attention_only():
    """MiniMax builds its own cache inside forward (generate() prepares none), so there is nothing to compact."""
    model = tiny("minimax", layer_types=["full_attention"] * 4)
    with pytest.raises(ValueError, match="builds a cache of its own"):
        specfit.enable(model, cache_slots=2, drafter=drafter_for(model))


@pytest.mark.parametrize("family", SUPPORTED)
def test_streaming_loader_reads_the_hub_layout(family, tmp_path):
    """save_pretrained writes the hub layout (per-expert w1/w3/w2 or gate/up/down_proj, fused 3-D tensors, Granite's
    input/output_linear); from_pretrained streams it into the store and matches the model."""
    source = tiny(family)
    source.save_pretrained(tmp_path, max_shard_size="200KB")
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    model = specfit.from_pretrained(tmp_path, cache_slots=2, dtype=torch.float32, device="cpu")
    torch.testing.assert_close(logits(model, ids), logits(source, ids), rtol=1e-5, atol=1e-5)
    assert not any(".experts." in n for n, _ in model.named_parameters())


def test_quantized_checkpoint_refused_naming_the_format(tmp_path):
    import json

    tiny("gpt_oss").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized \\('mxfp4'"):
        specfit.from_pretrained(tmp_path, cache_slots=2, dtype=torch.float32, device="cpu")


def test_static_cache_with_sliding_layers_refused():
    model = tiny("gpt_oss")
    specfit.enable(model, cache_slots=2, drafter=drafter_for(model), cost_model=COST, pool_nodes=8, max_nodes=5)
    with pytest.raises(ValueError, match="static sliding-window cache layers"):
        model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, assistant="eagle3", cache_implementation="static")
