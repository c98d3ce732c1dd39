"""A cast of the whole enabled model (``model.half()``, ``model.to(torch.bfloat16)``) works: SpecFit rebuilds its
store in the new dtype and decodes as the plain model cast. Moves to another device, and casts of a part of the
model, are refused at the call, naming the calls that do them; moves that change nothing run; the remedy printed
works as printed; disable gives the plain model's moves back."""

import re

import pytest
import torch

import specfit
from families import tiny
from specfit import embedded

IDS = torch.tensor([[3, 5, 7, 9, 11]])


def greedy(model, n=8):
    return model.generate(IDS, max_new_tokens=n, do_sample=False)


CASTS = {
    ".half()": (lambda m: m.half(), torch.float16),
    ".bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    ".to(torch.float16)": (lambda m: m.to(torch.float16), torch.float16),
    ".to(dtype=torch.bfloat16)": (lambda m: m.to(dtype=torch.bfloat16), torch.bfloat16),
}
MOVES = {
    ".to('meta')": lambda m: m.to("meta"),  # a device move a CPU machine can make
    ".to('meta', torch.float16)": lambda m: m.to("meta", torch.float16),
    "a decoder layer's .half()": lambda m: m.model.layers[1].half(),
    "an experts module's .to('meta')": lambda m: m.model.layers[2].mlp.experts.to("meta"),
}


@pytest.mark.parametrize("move", MOVES)
def test_a_move_is_refused_at_the_call_and_changes_nothing(move):
    expected = greedy(tiny("qwen3_moe"))
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"refused on a SpecFit-enabled model.*specfit\.disable\(model\); "
                                           r"model\.to\(.*\); specfit\.enable\(model, cache_slots=3\)"):
        MOVES[move](model)
    state = model.state_dict()
    assert all(state[k].dtype == v.dtype and state[k].device == v.device and torch.equal(state[k], v)
               for k, v in before.items())
    assert torch.equal(greedy(model), expected)  # still works, unchanged


@pytest.mark.parametrize("cast", CASTS)
def test_a_cast_of_the_whole_model_works_and_decodes_as_the_plain_model_cast(cast):
    apply, dtype = CASTS[cast]
    expected = greedy(apply(tiny("qwen3_moe")))
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3, link=0.0, cache_policy="lru", topk=3)
    assert apply(model) is model
    runtime = model.specfit
    assert runtime.store.dtype == dtype and model.get_input_embeddings().weight.dtype == dtype
    assert all(arena.dtype == dtype for arena in runtime.store.arenas)  # the host store itself, rebuilt
    assert (runtime.config.cache_slots, runtime.config.cache_policy, runtime.options.topk) == (3, "lru", 3)
    assert runtime.config.link is not None  # the settings kept
    assert torch.equal(greedy(model), expected)


@pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")
def test_a_cast_keeps_the_drafter_and_names_the_profile_of_the_new_dtype():
    model, tokenizer = embedded.load(8, link=embedded.default_link())
    model.specfit.acceptance_models["kept"] = "learned"
    model.bfloat16()
    runtime = model.specfit
    assert runtime.store.dtype == torch.bfloat16 and runtime.drafter is not None
    assert next(runtime.drafter.parameters()).dtype == torch.bfloat16  # cast with the model
    assert runtime.config.link.relative == 1.0 and runtime.acceptance_models["kept"] == "learned"
    assert runtime.calibrate_command == "specfit calibrate --dtype bfloat16"  # the profile a bf16 model needs
    ids = tokenizer("Question: What is 2 + 3?\nAnswer:", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, assistant="specfit")
    assert out.shape[1] == ids.shape[1] + 4 and model.specfit.stats.last_generate.new_tokens == 4


@pytest.mark.parametrize("move", [lambda m: m.float(), lambda m: m.cpu(), lambda m: m.to("cpu"),
                                  lambda m: m.to(torch.float32), lambda m: m.model.layers[0].float()])
def test_a_move_that_changes_nothing_runs(move):
    expected = greedy(tiny("qwen3_moe"))
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
    assert move(model) is not None
    assert torch.equal(greedy(model), expected)


def test_the_printed_remedy_works_as_printed():
    plain = tiny("qwen3_moe").bfloat16()
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3, link=0.0)
    with pytest.raises(RuntimeError) as err:
        model.model.layers[1].bfloat16()  # a part of the model: refused
    remedy = re.search(r"enable it again: (.*) \(with your other options\)", str(err.value)).group(1)
    assert remedy == "specfit.disable(model); model.to(torch.bfloat16); specfit.enable(model, cache_slots=3, link=0.0)"
    exec(remedy, {"specfit": specfit, "torch": torch, "model": model})
    assert model.specfit.store.dtype == torch.bfloat16
    assert torch.equal(greedy(model), greedy(plain))  # the cast model, offloaded, decodes as the plain one cast


def test_a_model_from_specfit_from_pretrained_casts_or_is_told_to_load_again(tmp_path):
    tiny("qwen3_moe").save_pretrained(tmp_path)
    model = specfit.from_pretrained(tmp_path, cache_slots=3, device="cpu")
    with pytest.raises(RuntimeError, match=r"specfit\.from_pretrained\(path_or_id, cache_slots=3, "
                                           r"dtype=torch\.bfloat16\)"):
        model.model.layers[1].bfloat16()
    loaded = specfit.from_pretrained(tmp_path, cache_slots=3, device="cpu", dtype=torch.bfloat16)
    assert loaded.specfit.store.dtype == torch.bfloat16
    model.bfloat16()  # on a CPU the experts come back to host memory for the cast: done
    assert model.specfit.store.dtype == torch.bfloat16 and torch.equal(greedy(model), greedy(loaded))


def test_after_disable_moves_are_the_plain_models():
    model = specfit.enable(tiny("qwen3_moe"), cache_slots=3)
    specfit.disable(model)
    assert all("_apply" not in vars(m) for m in model.modules())
    model.half()
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float16
