"""Every option checked where it is given: at enable / configure / from_pretrained, before any work (and before any
checkpoint byte is read), with the value and the remedy named; never at the first generate() or deep inside."""

import json

import pytest
import torch
from conftest import SelfDrafter, tiny_moe
from transformers import AutoModelForCausalLM

import specfit
from specfit import embedded
from specfit.offload import loader
from specfit.offload.link import LinkConfig
from specfit.selection.cost_model import CostModel
from specfit.selection.profile_files import ProfileError, profile_path
from specfit.selection.profiles import profile_key

PROMPT = torch.randint(2, 256, (1, 7), generator=torch.Generator().manual_seed(5))
COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)  # a resident expert costs its compute, a missing one 5x that


def drafter_for(model):
    return SelfDrafter(model, first_token=int(PROMPT[0, 0]))


def untouched(model) -> bool:
    return getattr(model, "specfit", None) is None and hasattr(model.model.layers[0].mlp.experts, "gate_up_proj")


@pytest.fixture
def no_checkpoint_bytes(monkeypatch):
    """Any read of a safetensors shard fails the test: the checks must come before."""
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint shard was opened before the arguments were checked")

    monkeypatch.setattr(loader, "safe_open", refuse)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    tiny_moe(seed=2).save_pretrained(folder)
    return folder


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "cache"))


def test_misspelt_keywords_are_named_before_any_work():
    model = tiny_moe()
    with pytest.raises(TypeError, match=r"specfit.enable got an unexpected keyword argument 'max_node'; did you mean "
                                        r"'max_nodes'\?"):
        specfit.enable(model, cache_slots=4, max_node=3)
    with pytest.raises(TypeError, match="'device_map'; did you mean 'device'"):
        specfit.enable(model, cache_slots=4, device_map="cpu")
    assert untouched(model)
    specfit.enable(model, cache_slots=4)
    with pytest.raises(TypeError, match="'routesource'; did you mean 'route_source'"):
        specfit.configure(model, routesource="gate")
    with pytest.raises(TypeError, match="'costmodel'; did you mean 'cost_model'"):
        specfit.configure(model, costmodel="profile.json")


@pytest.mark.parametrize("name,value", [("cache_slots", 3), ("link", 1e-3), ("cache_mode", "cleared")])
def test_configure_names_what_needs_disable_and_enable(name, value):
    model = specfit.enable(tiny_moe(), cache_slots=4)
    with pytest.raises(TypeError, match=rf"cannot change {name}=.*specfit.disable\(model\), then "
                                        rf"specfit.enable\(model, {name}="):
        specfit.configure(model, **{name: value})
    assert model.specfit.config.cache_slots == 4


@pytest.mark.parametrize("link", [float("inf"), float("nan"), -1.0])
def test_link_must_be_finite_and_non_negative(link):
    model = tiny_moe()
    with pytest.raises(ValueError, match="link: .*finite"):
        specfit.enable(model, cache_slots=4, link=link)
    assert untouched(model)


def test_link_config_refuses_infinite_values():
    for kwargs in (dict(seconds_per_expert=float("inf")), dict(bandwidth=float("inf")),
                   dict(bandwidth=1e9, latency=float("inf"))):
        with pytest.raises(ValueError, match="finite"):
            LinkConfig(**kwargs)


def test_from_pretrained_checks_everything_before_reading_the_checkpoint(checkpoint, no_checkpoint_bytes):
    with pytest.raises(ValueError, match=r"cache_slots must be an integer in 1\.\.16 .*got 17"):
        specfit.from_pretrained(checkpoint, cache_slots=17)
    with pytest.raises(ValueError, match="cache_slots must be an integer"):
        specfit.from_pretrained(checkpoint, cache_slots="all")
    with pytest.raises(ValueError, match="link: .*finite"):
        specfit.from_pretrained(checkpoint, cache_slots=4, link=float("inf"))
    with pytest.raises(TypeError, match="'max_node'; did you mean 'max_nodes'"):
        specfit.from_pretrained(checkpoint, cache_slots=4, max_node=3)
    with pytest.raises(ValueError, match="max_nodes must be an integer"):
        specfit.from_pretrained(checkpoint, cache_slots=4, max_nodes=-2)
    with pytest.raises(ValueError, match="cache_mode"):
        specfit.from_pretrained(checkpoint, cache_slots=4, cache_mode="lru")


def test_from_pretrained_device_map_places_the_non_expert_weights_or_is_refused(checkpoint):
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    expected = reference.generate(ids, max_new_tokens=4, do_sample=False)
    for device_map in ("auto", "cpu", {"": "cpu"}):
        model = specfit.from_pretrained(checkpoint, cache_slots=4, device_map=device_map)
        assert model.specfit.device == torch.device("cpu") and model.lm_head.weight.device.type == "cpu"
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
    for device_map, reason in (({"model.layers": "cpu", "lm_head": "cuda:0"}, "spreads the model over"),
                               ({"": "disk"}, "offloads weights to disk"), ("balanced", "several GPUs")):
        with pytest.raises(ValueError, match=rf"device_map=.*{reason}.*SpecFit places the model itself"):
            specfit.from_pretrained(checkpoint, cache_slots=4, device_map=device_map)
    with pytest.raises(ValueError, match="disagree"):
        specfit.from_pretrained(checkpoint, cache_slots=4, device_map="cpu", device="cuda")


@pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed with this package")
def test_embedded_load_checks_slots_and_link_before_reading(no_checkpoint_bytes):
    with pytest.raises(ValueError, match=r"cache_slots must be an integer in 1\.\.\d+"):
        embedded.load(0)
    with pytest.raises(ValueError, match="link: .*finite"):
        embedded.load(8, link=float("inf"))


def test_enable_refuses_weights_offloaded_to_disk(checkpoint, tmp_path):
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu", "model.layers.3": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map, offload_folder=tmp_path)
    with pytest.raises(ValueError, match=r"weights hold no values \(meta tensors: model\.layers\.1\..*"
                                         r"specfit\.from_pretrained"):
        specfit.enable(model, cache_slots=4)
    assert getattr(model, "specfit", None) is None


def test_experts_implementation_cannot_change_while_enabled():
    expected = tiny_moe().generate(PROMPT, max_new_tokens=4, do_sample=False)
    model = specfit.enable(tiny_moe(), cache_slots=4)
    with pytest.raises(ValueError, match=r"set_experts_implementation\('eager'\).*specfit.disable\(model\) first"):
        model.set_experts_implementation("eager")
    assert torch.equal(model.generate(PROMPT, max_new_tokens=4, do_sample=False), expected)  # nothing changed
    model.model.set_experts_implementation("eager")  # past the model's class: refused at the next forward
    with pytest.raises(RuntimeError, match="changed to 'eager'.*specfit.disable"):
        model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    specfit.disable(model)
    model.set_experts_implementation("eager")
    assert torch.equal(model.generate(PROMPT, max_new_tokens=4, do_sample=False), expected)


def test_paper_cost_needs_its_fit_at_enable_and_configure(empty_cache):
    model = tiny_moe()
    # a calibrated profile whose demand-only fit could not be made: cost='paper' is refused where it is given
    no_paper = CostModel(COST.intercepts, COST.beta, {"model_id": "m", "paper": None,
                                                      "paper_error": "demand never varies"},
                         copy_overhead=COST.copy_overhead, link_share=1.0)
    with pytest.raises(ValueError, match="cost='paper' needs the profile's fit on demand alone"):
        specfit.enable(model, cache_slots=4, drafter=drafter_for(model), cost_model=no_paper, cost="paper")
    assert untouched(model)
    specfit.enable(model, cache_slots=4, drafter=drafter_for(model), cost_model=no_paper)
    with pytest.raises(ValueError, match="cost='paper' needs"):
        specfit.configure(model, cost="paper")
    assert model.specfit.options.cost == "cache-aware"


def test_without_a_profile_the_warning_names_a_remedy_that_works_for_this_model(empty_cache):
    model = tiny_moe()  # built in code: no command line can load it, so the remedy is the Python call
    specfit.enable(model, cache_slots=4, drafter=drafter_for(model))
    with pytest.warns(RuntimeWarning, match=r"no calibrated cost profile .*Qwen3MoeForCausalLM \[4x16e top4 h64 "
                                            r"float32\].*Run `specfit.calibrate\(model, prompts\)`"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, assistant="specfit")


def test_options_needing_the_found_profile_are_checked_at_configure(empty_cache):
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=drafter_for(model))
    COST.save(profile_path(**profile_key(model)))  # this machine's calibrated profile: up to 7 nodes
    with pytest.raises(ProfileError, match="predicts up to 7 nodes but max_nodes is 9"):
        specfit.configure(model, max_nodes=9)
    assert model.specfit.options.max_nodes == 7


@pytest.mark.parametrize("field,value,shown", [
    ("heldout_r2", float("nan"), r"quality\.heldout_r2"),
    ("beta_interval_s", [1e-3, float("inf")], r"quality\.beta_interval_s\[1\]"),
    ("choice_loss", float("-inf"), r"quality\.choice_loss"),
])
def test_profile_quality_fields_must_be_finite(tmp_path, field, value, shown):
    quality = {"verdict": "good", "reasons": [], "heldout_r2": 0.9, "beta_interval_s": [1e-3, 2e-3], "choice_loss": 0.0}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**COST.to_json(), "quality": {**quality, field: value}}))  # NaN / Infinity tokens
    with pytest.raises(ProfileError, match=rf"profile.json: field '{shown}' is .*must be finite"):
        CostModel.load(path)
    with pytest.raises(ValueError, match=rf"field '{shown}' is .*must be finite"):
        CostModel(COST.intercepts, COST.beta, {"quality": {**quality, field: value}})
