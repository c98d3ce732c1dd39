"""Every generate() on an enabled model: its own figures whichever path ran, the assistant as a generation setting,
and every refusal before any decoding work."""

import pytest
import torch
from conftest import SelfDrafter, tiny_moe
from transformers import GenerationConfig

import specfit
from specfit.selection.cost_model import CostModel

PROMPT = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(3))
COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)  # a resident expert costs its compute, a missing one 5x that


def enabled(noise=0.3):
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=noise)
    return specfit.enable(model, cache_slots=4, drafter=drafter, cost_model=COST)


def test_every_path_leaves_its_own_figures():
    model = enabled()
    stats = model.specfit.stats
    model.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant="eagle3")
    assert stats.last_method == "eagle3" and stats.last_generate.cycles > 0

    model.generate(PROMPT, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=3)
    g = stats.last_generate
    assert stats.last_method == "prompt_lookup"
    assert g.new_tokens == 6 and g.forwards > 0 and g.cycles == 0 and g.nodes_verified == 0
    assert g.prefill_seconds > 0 and g.decode_seconds > 0

    model.generate(PROMPT, max_new_tokens=5, do_sample=False, assistant_model=tiny_moe(seed=1))
    assert stats.last_method == "assisted" and stats.last_generate.new_tokens == 5 and stats.last_generate.cycles == 0

    model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    assert stats.last_method == "ar" and stats.last_generate.new_tokens == 4 and stats.last_generate.cycles == 3

    model.generate(PROMPT, max_new_tokens=3, do_sample=False, num_beams=2)
    assert stats.last_method == "beam_search" and stats.last_generate.new_tokens == 3

    model.generate(PROMPT, max_new_tokens=8, do_sample=False, assistant="specfit")
    with pytest.raises(ValueError):  # a refused call shows no figures, not the previous call's
        model.generate(PROMPT, max_new_tokens=3, assistant="specfit", num_beams=2)
    assert stats.last_method is None and stats.last_generate.new_tokens == 0 and stats.last_generate.cycles == 0


def test_the_assistant_is_a_generation_setting():
    expected = tiny_moe().generate(PROMPT, max_new_tokens=10, do_sample=False)
    model = enabled()
    stats = model.specfit.stats
    out = model.generate(PROMPT, generation_config=GenerationConfig(assistant="eagle3", max_new_tokens=10,
                                                                    do_sample=False))
    assert torch.equal(out, expected) and stats.last_method == "eagle3"
    assert stats.last_generate.nodes_verified == 7 * stats.last_generate.cycles

    model.generation_config.assistant = "specfit"
    assert torch.equal(model.generate(PROMPT, max_new_tokens=10, do_sample=False), expected)
    assert stats.last_method == "specfit"
    model.generate(PROMPT, max_new_tokens=10, do_sample=False, assistant="eagle3")  # the keyword wins
    assert stats.last_method == "eagle3"
    model.generate(PROMPT, max_new_tokens=10, do_sample=False, assistant=None)  # None: no assistant
    assert stats.last_method == "ar"

    model.generation_config.assistant = "medusa"
    with pytest.raises(ValueError, match="unknown assistant 'medusa'"):
        model.generate(PROMPT, max_new_tokens=3)
    assert stats.total.forwards > 0 and stats.last_generate.forwards == 0


@pytest.mark.parametrize("arguments,named", [
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens=3"),
    (dict(generation_config=GenerationConfig(prompt_lookup_num_tokens=2, max_new_tokens=4)),
     "prompt_lookup_num_tokens=2"),
])
def test_other_decoding_methods_are_refused_before_any_work(arguments, named):
    model = enabled()
    with pytest.raises(ValueError, match=f"needs greedy or sampling decoding, but {named}"):
        model.generate(PROMPT, assistant="specfit", **{"max_new_tokens": 4, **arguments})
    assert model.specfit.stats.total.forwards == 0  # refused before the prompt's forward


def test_assistant_model_given_a_name_is_refused():
    model = enabled()
    with pytest.raises(ValueError, match=r"assistant_model= takes a draft model.*assistant='specfit'"):
        model.generate(PROMPT, max_new_tokens=3, assistant_model="specfit")
    with pytest.raises(ValueError, match="either assistant= .* or custom_generate="):
        model.generate(PROMPT, max_new_tokens=3, assistant="specfit", custom_generate=lambda model, *a, **k: None)
    assert model.specfit.stats.total.forwards == 0


@pytest.mark.parametrize("ids,message", [
    (torch.zeros(1, 0, dtype=torch.long), r"input_ids is empty \(shape \(1, 0\)\)"),
    (torch.tensor([[5, 7, 256, 9]]), r"token id 256 at position \(0, 2\), outside this model's vocabulary 0\.\.255"),
    (torch.tensor([[5, -3]]), r"token id -3 at position \(0, 1\)"),
    (torch.tensor([[5.0, 7.0]]), "integer token ids"),
])
def test_input_ids_are_checked_before_the_first_forward(ids, message):
    model = enabled()
    with pytest.raises(ValueError, match=message):
        model.generate(ids, max_new_tokens=3, do_sample=False, assistant="specfit")
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, assistant="eagle3")
    assert model.specfit.stats.total.forwards == 0
