"""A model built from an enabled model's config is a plain model: ``type(model)(model.config)`` and ``from_config``
(which transformers' own tests and user code do) get the original class and run the experts as the plain model did,
while the enabled model keeps running SpecFit's; typing ``experts_implementation="specfit"`` by hand is still refused."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import specfit
from conftest import tiny_moe, tiny_moe_config

IDS = torch.tensor([[1, 5, 9, 3, 7]])


@pytest.mark.parametrize("build", ["class", "class._from_config", "auto.from_config"])
def test_a_model_built_from_an_enabled_models_config_is_plain(build):
    model = tiny_moe()
    with torch.no_grad():
        reference = model(IDS).logits
    plain_class = type(model)
    specfit.enable(model, cache_slots=2)
    new = {"class": lambda: type(model)(model.config),
           "class._from_config": lambda: type(model)._from_config(model.config),
           "auto.from_config": lambda: AutoModelForCausalLM.from_config(model.config)}[build]()
    assert type(new) is plain_class and getattr(new, "specfit", None) is None
    new.load_state_dict(model.state_dict())  # the enabled model's state_dict holds its experts
    with torch.no_grad():
        assert torch.allclose(new(IDS).logits, reference, atol=1e-5)
        assert torch.allclose(model(IDS).logits, reference, atol=1e-5)  # the enabled model is unchanged
    greedy = new.generate(IDS, max_new_tokens=4, do_sample=False)
    assert model.generate(IDS, max_new_tokens=4, do_sample=False, assistant=None).tolist() == greedy.tolist()
    assert model.specfit.stats.last_generate.new_tokens == 4  # the enabled model still counts its own work


def test_the_name_typed_by_hand_is_still_refused():
    model = tiny_moe()
    specfit.enable(tiny_moe(), cache_slots=2)  # "specfit" registered in transformers' interface
    model.set_experts_implementation("specfit")
    with pytest.raises(RuntimeError, match="no SpecFit runtime attached"):
        model(IDS)


def test_a_config_built_afresh_is_untouched():
    config = tiny_moe_config()
    model = AutoModelForCausalLM.from_config(config)
    specfit.enable(model, cache_slots=2)
    assert config._experts_implementation != "specfit"  # the caller's object was never written to
