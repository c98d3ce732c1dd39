"""The embedded model's emulated link follows from its structure: one expert copy costs 1.4 x (one token's compute
with every expert resident) / (layers x top-k), so a token's full expert demand costs 1.4x its compute, as on the
paper's A100, whatever CPU runs it. Profiles made under it are filed by that rule, not by its milliseconds."""

import json
import warnings

import pytest

from specfit import embedded
from specfit.offload.link import LinkConfig

needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")


@needs_embedded
def test_the_default_link_is_scaled_to_this_machines_compute(monkeypatch):
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.040)
    config = json.loads((embedded.TARGET_DIR / "config.json").read_text())
    demand = config["num_hidden_layers"] * config["num_experts_per_tok"]
    assert embedded.default_link_seconds() == pytest.approx(1.4 * 0.040 / demand)
    assert embedded.token_compute_seconds() == 0.040
    link = embedded.default_link(0.5)
    assert link.relative == 0.5 and link.seconds_per_expert is None  # priced per byte: a bf16 expert costs the rule
    assert link.copy_time(embedded.bf16_expert_bytes()) == pytest.approx(0.5 * 1.4 * 0.040 / demand)
    assert embedded.link_seconds_per_expert(link) == pytest.approx(0.5 * 1.4 * 0.040 / demand)
    assert link.copy_time(embedded.bf16_expert_bytes() // 2) == pytest.approx(0.25 * 1.4 * 0.040 / demand)
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.080)
    assert embedded.default_link_seconds() == pytest.approx(1.4 * 0.040 / demand)  # measured once per process
    assert embedded.default_link_seconds(refresh=True) == pytest.approx(1.4 * 0.080 / demand)


def test_a_relative_link_is_named_by_its_rule_not_its_milliseconds():
    here, there = LinkConfig(seconds_per_expert=3e-4, relative=1.0), LinkConfig(seconds_per_expert=5e-4, relative=1.0)
    assert here.label == there.label == "emulated link, structural default"
    assert LinkConfig(seconds_per_expert=6e-4, relative=2.0).label == "emulated link, 2x structural default"
    assert LinkConfig(seconds_per_expert=3e-4).label != here.label  # a link given in ms is named by its ms


@needs_embedded
def test_the_shipped_reference_profiles_use_the_default_link_and_are_found_on_any_machine(monkeypatch):
    """A fresh machine measures another ms per copy; the reference profile made under the default link is still the
    one SpecFit finds for the embedded model (every time of it scales with the machine, its choices do not)."""
    from specfit.selection import profiles

    monkeypatch.setenv("SPECFIT_CACHE", "/nonexistent-specfit-cache")  # no calibrated profile of this machine
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.123)  # an unusual machine
    model, _ = embedded.load(12, link=embedded.default_link(), drafter=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "measured on another machine", where it was
        found = profiles.find_profile(model)
    assert found is not None and found.meta["link"] == "emulated link, structural default"
    assert found.meta["slots"] == 12
