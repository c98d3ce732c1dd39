"""What transformers' own model tests expect of a model, on an enabled one (issue 35, item 6): heads that cannot
generate, the caller's config, state_dict() for safetensors, num_parameters(), backward(), torch.compile and a
custom_generate that returns no tensor. ``benchmarks/hf_model_tests.py`` runs transformers' Qwen3-MoE test file."""

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (Qwen3MoeForCausalLM, Qwen3MoeForQuestionAnswering, Qwen3MoeForSequenceClassification,
                          Qwen3MoeModel)

import specfit
from conftest import tiny_moe, tiny_moe_config

IDS = torch.tensor([[3, 5, 7, 9, 11, 13, 15, 17]])


def built(cls, seed=0, **overrides):
    torch.manual_seed(seed)
    return cls(tiny_moe_config(**overrides)).eval()


@pytest.mark.parametrize("cls", [Qwen3MoeForSequenceClassification, Qwen3MoeForQuestionAnswering, Qwen3MoeModel])
def test_heads_that_cannot_generate_are_offloaded_and_keep_their_class(cls, tmp_path):
    plain = built(cls, num_labels=3)
    model = specfit.enable(built(cls, num_labels=3), cache_slots=3)
    assert type(model) is cls and not type(model).can_generate() and not hasattr(model, "generation_config")
    with torch.no_grad():
        want, got = plain(IDS)[0], model(IDS)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path)  # crashed on the missing generation config while can_generate() said True
    assert torch.equal(cls.from_pretrained(tmp_path).state_dict()[next(iter(plain.state_dict()))],
                       next(iter(plain.state_dict().values())))
    specfit.disable(model)
    with pytest.raises(ValueError, match=r"has no generate\(\).*without drafter="):
        specfit.enable(model, cache_slots=3, drafter=torch.nn.Linear(1, 1))
    assert getattr(model, "specfit", None) is None


def test_enable_leaves_the_callers_config_alone():
    config = tiny_moe_config()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    before = config.to_dict()
    specfit.enable(model, cache_slots=3)
    assert config.to_dict() == before and model.config is not config
    torch.manual_seed(0)
    later = Qwen3MoeForCausalLM(config).eval()  # built from the caller's config while the first is enabled
    with torch.no_grad():
        torch.testing.assert_close(later(IDS).logits, model(IDS).logits, rtol=0, atol=1e-5)
    model.config.output_router_logits = True  # a change made to the model's config while enabled stays with it
    specfit.disable(model)
    assert model.config is config and config.output_router_logits
    assert all(getattr(m, "config", config) is config for m in model.modules())


def test_state_dict_saves_with_safetensors_and_the_base_model_saves_itself(tmp_path):
    plain = tiny_moe().state_dict()
    model = specfit.enable(tiny_moe(), cache_slots=3)
    save_file(model.state_dict(), tmp_path / "all.safetensors")
    loaded = load_file(tmp_path / "all.safetensors")
    assert list(loaded) == list(plain) or set(loaded) == set(plain)
    assert all(torch.equal(loaded[k], plain[k]) for k in plain)
    model.model.save_pretrained(tmp_path / "base")  # the inner Qwen3MoeModel: transformers' own save_pretrained
    reloaded = Qwen3MoeModel.from_pretrained(tmp_path / "base").state_dict()
    assert all(torch.equal(reloaded[k], plain["model." + k]) for k in reloaded)


def test_num_parameters_counts_the_experts_as_frozen_weights():
    plain = tiny_moe()
    model = specfit.enable(tiny_moe(), cache_slots=3)
    experts = sum(p.numel() for n, p in plain.named_parameters() if ".experts." in n)
    assert model.num_parameters() == plain.num_parameters()
    assert model.num_parameters(only_trainable=True) == plain.num_parameters(only_trainable=True) - experts
    specfit.disable(model)
    assert "num_parameters" not in vars(model) and model.num_parameters() == plain.num_parameters()


def test_backward_gives_the_plain_models_gradients_with_the_experts_frozen():
    """Gradients of every weight in model.parameters() are the plain model's with its experts frozen, with 3 of 16
    slots (experts evicted within each forward); the experts' freezing is said once."""
    plain = tiny_moe()
    for name, p in plain.named_parameters():
        p.requires_grad_(".experts." not in name)
    model = specfit.enable(tiny_moe(), cache_slots=3)
    for m in (plain, model):
        m.train()
        m(IDS, labels=IDS).loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    got = dict(model.named_parameters())
    assert set(grads) == set(got)
    for name, grad in grads.items():
        torch.testing.assert_close(got[name].grad, grad, rtol=1e-4, atol=1e-6, msg=name)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model(IDS, labels=IDS).loss.backward()
    assert not [w for w in said if "frozen" in str(w.message)]  # said once per model (at the first backward)


def test_backward_warns_that_the_experts_are_frozen():
    model = specfit.enable(tiny_moe(num_hidden_layers=1), cache_slots=3)
    with pytest.warns(UserWarning, match=r"none reach the routed experts.*specfit\.disable\(model\)"):
        model(IDS, labels=IDS).loss.backward()


def test_torch_compile_with_fullgraph_is_refused_with_specfits_reason():
    model = specfit.enable(tiny_moe(num_hidden_layers=1), cache_slots=3)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"compile without fullgraph=True.*specfit\.disable\(model\)"):
        with torch.no_grad():
            torch.compile(model, fullgraph=True, backend="eager")(IDS)
    torch._dynamo.reset()


@pytest.mark.slow  # compiling even a one-layer model takes 30 s on a busy 2-core machine
def test_torch_compile_traces_around_the_experts_without_recompiling():
    """Without fullgraph the graph breaks at each MoE layer's experts; new inputs of the same shape (other routes,
    other slots) compile nothing again, and the outputs are the eager ones."""
    model = specfit.enable(tiny_moe(num_hidden_layers=1), cache_slots=3)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        want = model(IDS).logits
        torch.testing.assert_close(compiled(IDS).logits, want, rtol=0, atol=1e-5)
        first = len(graphs)
        for shift in (1, 2):
            torch.testing.assert_close(compiled(IDS + shift).logits, model(IDS + shift).logits, rtol=0, atol=1e-5)
    assert first > 0 and len(graphs) == first
    torch._dynamo.reset()


def test_custom_generate_may_return_anything():
    model = specfit.enable(tiny_moe(), cache_slots=3)

    def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        return {"text": "done", "prompt": input_ids.shape[1]}

    assert model.generate(IDS, custom_generate=decode, max_new_tokens=2) == {"text": "done", "prompt": 8}
    assert model.specfit.stats.last_method == "custom_generate"
    assert model.specfit.stats.last_generate.new_tokens == 0  # not known from what it returned
