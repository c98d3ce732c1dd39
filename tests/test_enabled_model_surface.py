"""What an enabled model shows of itself to code that inspects it: the forward's own signature, and the experts
implementation refused at the call, for a model that cannot generate as for one that can."""

import inspect

import pytest
import torch
from conftest import tiny_moe, tiny_moe_config

import specfit


@pytest.mark.parametrize("kind", ["causal-lm", "bare"])
def test_an_enabled_model_keeps_its_forward_signature_and_refuses_another_experts_implementation(kind):
    from transformers import Qwen3MoeModel

    torch.manual_seed(0)
    model = tiny_moe() if kind == "causal-lm" else Qwen3MoeModel(tiny_moe_config()).eval()
    before = inspect.signature(model.forward)
    base = model if kind == "bare" else model.model
    base_before = inspect.signature(base.forward)
    specfit.enable(model, cache_slots=4)
    assert inspect.signature(base.forward) == base_before  # the serialized forward wraps, it does not hide
    assert "input_ids" in inspect.signature(model.forward).parameters and inspect.signature(model.forward) == before
    with pytest.raises(ValueError, match=r"set_experts_implementation\('eager'\): SpecFit is enabled"):
        model.set_experts_implementation("eager")
    ids = torch.randint(2, 256, (1, 6))
    model(ids)  # the refusal changed nothing: the model still runs
    specfit.disable(model)
    assert inspect.signature(model.forward) == before and "set_experts_implementation" not in vars(model)
    model.set_experts_implementation("eager")  # a plain model again
