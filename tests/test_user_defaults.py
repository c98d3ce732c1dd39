"""What a user gets without options: deployable routes (never the oracle), and stats that read like a stopwatch."""

import dataclasses
import time

import pytest
import torch
from conftest import SelfDrafter, tiny_moe
from test_probes import random_drafter

import specfit
from specfit import embedded
from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter
from specfit.selection import route_sources
from specfit.selection.cost_model import CostModel
from specfit.selection.route_predictor import RoutePredictor

PROMPT = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(9))
COST = CostModel((0.010, 0.0105, 0.011, 0.0115, 0.012, 0.0125, 0.013, 0.0135), 4e-5, copy_overhead=1.6e-4,
                 link_share=1.0)  # a resident expert costs its compute, a missing one 5x that


@pytest.fixture
def no_oracle(monkeypatch):
    def refuse(cycle, tree):
        raise AssertionError("the route oracle ran without being asked for")

    monkeypatch.setattr(route_sources, "oracle_routes", refuse)


def test_default_is_gate_when_the_drafter_reads_target_width(no_oracle):
    expected = tiny_moe().generate(PROMPT, max_new_tokens=16, do_sample=False)
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3),
                   cost_model=COST)
    assert model.specfit.options.route_source == "auto"
    assert route_sources.choose_route_source(model, "auto") == "gate"
    out = model.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant="specfit")
    assert torch.equal(out, expected) and model.specfit.stats.last_generate.measurement_seconds == 0


def test_default_is_the_predictor_when_one_is_attached(no_oracle):
    model = tiny_moe()
    head = RoutePredictor.from_gates(model)
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0])), cost_model=COST,
                   route_predictor=head)
    assert route_sources.choose_route_source(model, "auto") == "predictor"
    model.generate(PROMPT, max_new_tokens=8, do_sample=False, assistant="specfit")
    assert model.specfit.stats.last_generate.measurement_seconds == 0


@pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed with this package")
def test_embedded_default_is_its_trained_predictor(no_oracle):
    model, tokenizer = embedded.load(24)
    assert route_sources.choose_route_source(model, model.specfit.options.route_source) == "predictor"
    ids = tokenizer("Question: Tom has 3 apples.\nAnswer:", return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=8, do_sample=False, assistant="specfit")
    assert model.specfit.stats.last_generate.measurement_seconds == 0


def test_auto_refuses_at_enable_when_nothing_deployable_exists():
    model = tiny_moe()
    config = Eagle3Config.from_target(model.config, draft_vocab_size=256, intermediate_size=64)
    config = dataclasses.replace(config, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    config.aux_layer_ids = (0, 1, 3)
    narrow = Eagle3Drafter(config, own_embedding=True)
    with pytest.raises(ValueError, match=r"route_source='auto'.*\(32\).*\(64\).*specfit train-router.*'oracle'"):
        specfit.enable(model, cache_slots=4, drafter=narrow)
    assert getattr(model, "specfit", None) is None
    specfit.enable(model, cache_slots=4, drafter=narrow, route_source="oracle")  # asked for: allowed
    with pytest.raises(ValueError, match="route_source='auto'"):
        specfit.configure(model, route_source="auto")
    assert model.specfit.options.route_source == "oracle"


ROUTES = ["auto", "gate", "predictor", "oracle"]


@pytest.mark.parametrize("assistant,route_source", [(None, None), ("eagle3", None)] +
                         [("specfit", r) for r in ROUTES])
def test_stats_add_up_to_the_wall_clock(assistant, route_source):
    """A property, not a timing: prefill + decode seconds in the stats cover the call a stopwatch measured."""
    model = tiny_moe()
    # SpecFit's rule every cycle: the guard would settle on plain cycles for a random drafter, leaving the oracle idle
    options = {} if route_source is None else dict(route_source=route_source, guard=False)
    specfit.enable(model, cache_slots=4, link=2e-4, drafter=random_drafter(model), cost_model=COST,
                   route_predictor=RoutePredictor.from_gates(model), **options)
    for _ in range(2):  # the second call is the one checked (the first pays one-time costs)
        t0 = time.perf_counter()
        model.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant=assistant)
        wall = time.perf_counter() - t0
    g = model.specfit.stats.last_generate
    assert g.new_tokens == 24 and g.prefill_seconds > 0 and g.decode_seconds > 0
    assert g.prefill_seconds + g.decode_seconds >= 0.95 * wall
    assert g.prefill_seconds + g.decode_seconds <= wall
    assert g.end_to_end_tokens_per_second == pytest.approx(24 / (g.prefill_seconds + g.decode_seconds))
    assert (g.measurement_seconds > 0) == (route_source == "oracle")
    assert g.tokens_per_second <= g.tokens_per_second_excluding_measurement


@pytest.mark.parametrize("assistant", [None, "specfit"])
def test_the_clock_starts_at_generate_entry(monkeypatch, assistant):
    """Time generate() spends preparing, before the prompt's forward, is prefill time: a slow preparation shows."""
    from transformers.generation.utils import GenerationMixin

    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=random_drafter(model), cost_model=COST)
    original = GenerationMixin._prepare_special_tokens

    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_prepare_special_tokens", slow)
    model.generate(PROMPT, max_new_tokens=4, do_sample=False, assistant=assistant)
    assert model.specfit.stats.last_generate.prefill_seconds >= 0.05
