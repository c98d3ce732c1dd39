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
def test_the_default_link_is_scaled_to_this_machines_compute(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))  # nothing kept from an earlier run
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


@needs_embedded
def test_the_default_link_is_measured_once_per_machine_and_kept(monkeypatch, tmp_path):
    """Two runs on one machine (two processes: the in-process value cleared between them) use equal seconds per
    copy, whatever the CPU's load at each start; `specfit calibrate`'s refresh measures and keeps it again."""
    from specfit.embedded import link_store

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    demand = 48 * 4
    for compute, refresh, kept in [(0.040, False, 0.040), (0.080, False, 0.040), (0.080, True, 0.080),
                                   (0.020, False, 0.080)]:
        monkeypatch.setattr(embedded, "_link", {})  # a new run: nothing measured in this process
        monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: compute)  # the load at its start
        assert embedded.default_link_seconds(refresh=refresh) == pytest.approx(1.4 * kept / demand)
        assert embedded.token_compute_seconds() == kept
    stored = json.loads(link_store.path().read_text())
    assert link_store.path().parent == tmp_path and len(stored) == 1  # one machine, one thread count
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(link_store, "key", lambda threads, weights: "another machine")
    assert embedded.default_link_seconds() == pytest.approx(1.4 * 0.020 / demand)  # measured there, not borrowed


@needs_embedded
def test_specfit_calibrate_measures_the_default_link_again(monkeypatch, tmp_path):
    from specfit import cli
    from specfit.evaluation import calibrate

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.040)
    embedded.default_link_seconds()  # kept by an earlier run
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.060)

    class Loaded(Exception):
        pass

    def load(args):
        raise Loaded  # the probes would run from here

    monkeypatch.setattr(calibrate, "_load", load)
    args = cli.command_parser("calibrate").parse_args(["--prompts", "random", "--threads", "1"])
    with pytest.raises(Loaded):
        calibrate.main(args)
    monkeypatch.setattr(embedded, "_link", {})
    assert embedded.token_compute_seconds() == 0.060  # what the next run on this machine uses


def test_a_relative_link_is_named_by_its_rule_not_its_milliseconds():
    here, there = LinkConfig(seconds_per_expert=3e-4, relative=1.0), LinkConfig(seconds_per_expert=5e-4, relative=1.0)
    assert here.label == there.label == "emulated link, structural default"
    assert LinkConfig(seconds_per_expert=6e-4, relative=2.0).label == "emulated link, 2x structural default"
    assert LinkConfig(seconds_per_expert=3e-4).label != here.label  # a link given in ms is named by its ms


@needs_embedded
@pytest.mark.parametrize("slots, link", [(6, "default"), (12, "default"), (24, "default"), (64, "default"),
                                         (12, None), (24, None), (12, 3e-4)])
def test_one_reference_profile_prices_every_slot_count_and_link(monkeypatch, tmp_path, slots, link):
    """One calibration per machine and model: the shipped profile is the one SpecFit finds for the embedded model at
    any slot count, with the structural default link (whatever ms this machine measures), without a link and with a
    link given in seconds, without a warning on the machine it was measured on; its copies cost the profile's
    overhead plus its link share of the link's own time for one expert's bytes."""
    from specfit.selection import profiles

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "empty"))  # no calibrated profile of this machine
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.123)  # an unusual machine
    given = embedded.default_link() if link == "default" else link
    model, _ = embedded.load(slots, link=given, drafter=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = profiles.find_profile(model)
        priced = profiles.price(model, found, "cache-aware")
    other = found.meta["device"] != profiles.device_name(model.specfit)
    assert [str(w.message) for w in seen if not (other and "measured on" in str(w.message))] == []
    assert found.prices_copies and found.meta["model_key"] == profiles.model_key(model)
    copy_seconds = 0.0 if given is None else model.specfit.config.link.copy_time(model.specfit.store.expert_bytes)
    assert priced.copy == pytest.approx(found.copy_overhead + found.link_share * copy_seconds)
    assert priced.intercepts == found.intercepts and priced.beta == found.beta
