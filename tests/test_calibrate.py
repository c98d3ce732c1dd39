"""The calibration command and its gate: installing only a good fit, the route oracle as a measurement device, and
profile lookup (the probes themselves: ``test_probes.py``)."""

import json
import warnings

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.evaluation import calibrate as calibrate_module
from specfit.evaluation import probes as probes_module
from specfit.evaluation.calibrate import install
from specfit.evaluation.probes import Calibration
from specfit.selection.cost_model import CostModel, Record
from specfit.selection.profile_files import ProfileError, profile_path
from specfit.selection.fit_quality import REMEDY, Pool, assess
from specfit.selection.profiles import device_name, model_id, model_key, profile_key, resolve_cost_model
from specfit.selection.route_sources import Cycle, oracle_routes
from specfit.drafting.tree import DraftTree

PROMPTS = [torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]


def test_oracle_leaves_cache_and_counters_untouched():
    model = tiny_moe()
    specfit.enable(model, cache_slots=3, drafter=SelfDrafter(model, first_token=int(PROMPTS[0][0, 0])))
    ids = PROMPTS[0]
    cache_kv = __import__("transformers").DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache_kv, use_cache=True)
    rt = model.specfit
    before = rt.stats.total.copy()
    resident = [layer.cache.lru.resident for layer in rt.layers]
    last_routes = rt.routes.last.clone()
    kv_len = cache_kv.get_seq_length()
    tree = DraftTree()
    a = tree.add(-1, 5, 0.5)
    tree.add(-1, 6, 0.3)
    tree.add(a, 7, 0.2)
    cycle = Cycle(model, cache_kv, base=kv_len, root=9)
    routes, root_routes = oracle_routes(cycle, tree)
    assert rt.stats.total == before
    assert [layer.cache.lru.resident for layer in rt.layers] == resident
    assert torch.equal(rt.routes.last, last_routes)
    assert cache_kv.get_seq_length() == kv_len and cycle.measurement_seconds > 0
    # the oracle's routes are the true ones: a plain forward of the root->node path routes the same way
    for node, path in ((0, [9, 5]), (2, [9, 5, 7]), (1, [9, 6])):
        reference = tiny_moe()
        with torch.no_grad():
            out = reference(torch.cat([ids, torch.tensor([path])], 1), output_router_logits=True)
        want = np.stack([torch.softmax(lg[-1].float(), -1).topk(4).indices.sort().values.numpy()
                         for lg in out.router_logits])
        got = np.stack([np.flatnonzero(routes[node, layer]) for layer in range(4)])
        assert (got == want).all()
    assert root_routes.sum() == 16


def test_enable_finds_profile_or_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=1))
    with pytest.warns(RuntimeWarning, match="no calibrated cost profile"):
        assert resolve_cost_model(model).meta["source"] == "default"
    rt = model.specfit  # a profile calibrated later in the same process is found: the default was not kept
    mine = CostModel((0.01,) * 8, 1e-4, {"model_id": model_id(model)}, copy_overhead=2e-5, link_share=1.0)
    mine.save(profile_path(device_name(rt), model_key(model)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cost_model(model) == mine.priced(0.0)  # no link: a copy costs its overhead
    specfit.disable(model)
    wrong = tmp_path / "wrong.json"
    CostModel((0.01,) * 8, 1e-4, {"slots": 8, "cache_mode": "cached"}).save(wrong)
    with pytest.raises(ProfileError, match=r"wrong\.json: field 'slots' is 8, expected 4"):  # at enable, not later
        specfit.enable(model, cache_slots=4, cost_model=str(wrong), drafter=SelfDrafter(model, first_token=1))
    assert getattr(model, "specfit", None) is None  # a failed enable leaves the model as it was


def test_cost_profiles_fail_at_enable_and_configure_replaces_them(tmp_path):
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=1)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format": "specfit-cost-model", "version": 1, "uni')
    with pytest.raises(ProfileError, match=r"corrupt\.json: not valid JSON"):
        specfit.enable(model, cache_slots=4, cost_model=corrupt, drafter=drafter)
    negative = tmp_path / "negative.json"
    CostModel((0.01,) * 8, 1e-4).save(negative)
    negative.write_text(negative.read_text().replace('"beta": 0.0001', '"beta": -0.0001'))
    with pytest.raises(ProfileError, match=r"negative\.json: .*'beta' must be a non-negative number, got -0\.0001"):
        specfit.enable(model, cache_slots=4, cost_model=negative, drafter=drafter)
    short = CostModel((0.01,) * 4, 1e-4)  # predicts up to 3 nodes, max_nodes is 7
    with pytest.raises(ProfileError, match="predicts up to 3 nodes but max_nodes is 7"):
        specfit.enable(model, cache_slots=4, cost_model=short, drafter=drafter)

    first = CostModel((0.01,) * 8, 1e-4, copy_overhead=1e-5, link_share=1.0)
    second = CostModel((0.02,) * 8, 2e-4, copy_overhead=3e-5, link_share=0.5)
    specfit.enable(model, cache_slots=4, cost_model=first, drafter=drafter)
    assert resolve_cost_model(model) == first.priced(0.0)
    specfit.configure(model, cost_model=second)
    assert resolve_cost_model(model) == second.priced(0.0)
    with pytest.raises(ProfileError, match="field 'slots' is 8, expected 4"):  # a demand-only profile of 8 slots
        specfit.configure(model, cost_model=CostModel((0.01,) * 8, 1e-4, {"slots": 8}), max_nodes=3)
    assert resolve_cost_model(model) == second.priced(0.0) and model.specfit.options.max_nodes == 7  # unchanged
    with pytest.raises(ProfileError, match="predicts up to 3 nodes but max_nodes is 7"):
        specfit.configure(model, cost_model=short)


# ---- the fit-quality gate -------------------------------------------------------------------------------------------

TRUTH = (6.0e-3, 6.3e-3, 6.5e-3, 6.7e-3, 6.8e-3, 7.0e-3, 7.1e-3, 7.3e-3)


def probe_records(seed, noise_s, per_count=30, beta=0.28e-3):
    """Records shaped like the probes' (demand grows with the node count and varies at each count), timed by a
    known model plus Gaussian noise of ``noise_s`` seconds."""
    rng = np.random.default_rng(seed)
    records = []
    for n, a in enumerate(TRUTH):
        for _ in range(per_count):
            demand = 24 + int(rng.integers(4, 14)) * n
            records.append(Record(n, demand, max(a + beta * demand + noise_s * rng.standard_normal(), 1e-4)))
    return records


def random_pools(seed, count=12):
    """Pools of 8 nodes (two chains of four) with random routes over 2 layers x 16 experts, top-2."""
    rng = np.random.default_rng(seed)
    parents = (-1, 0, 1, 2, -1, 4, 5, 6)
    pools = []
    for _ in range(count):
        routes = np.zeros((8, 2, 16), bool)
        for v in range(8):
            for layer in range(2):
                routes[v, layer, rng.choice(16, 2, replace=False)] = True
        root = np.zeros((2, 16), bool)
        root[:, :2] = True
        probs, p = [], {-1: 1.0}
        for v, parent in enumerate(parents):
            p[v] = p[parent] * float(rng.uniform(0.4, 0.95))
            probs.append(p[v])
        pools.append(Pool(parents, tuple(probs), routes, root))
    return pools


def test_gate_passes_a_clean_probe_set():
    records = probe_records(0, noise_s=0.2e-3)
    quality, heldout = assess(records, 7, folds=5, bootstrap=100, seed=0, pools=random_pools(0))
    assert quality["verdict"] == "good" and quality["reasons"] == []
    assert quality["heldout_r2"] > 0.9 and quality["beta_halfwidth"] < 0.1
    lo, hi = quality["beta_interval_s"]
    assert lo < 0.28e-3 < hi
    fitted = CostModel.fit(records).intercepts
    assert all(lo <= a <= hi for (lo, hi), a in zip(quality["intercept_intervals_s"], fitted))
    assert heldout.shape == (len(records),) and quality["choice_change_rate"] < 0.1


def test_gate_refuses_a_noisy_probe_set_and_says_why():
    # as the default run: the timer's noise (12 ms) dwarfs what demand and node count explain
    records = probe_records(0, noise_s=12e-3)
    quality, _ = assess(records, 7, folds=5, bootstrap=100, seed=0, pools=random_pools(0))
    assert quality["verdict"] == "poor"
    assert any(r.startswith("held-out R^2") and "< 0.5" in r for r in quality["reasons"])
    assert any("95% bootstrap interval" in r and "(limit +-25%)" in r for r in quality["reasons"])
    clean, _ = assess(probe_records(0, noise_s=0.2e-3), 7, bootstrap=100, pools=random_pools(0))
    assert quality["choice_change_rate"] > clean["choice_change_rate"]


def test_a_wide_interval_on_a_small_beta_fails_only_when_it_moves_the_selectors_choices():
    # as with no link: beta is 0.02 ms per expert, hard to pin down relative to itself, and nearly irrelevant
    records = probe_records(4, noise_s=0.7e-3, beta=0.02e-3)
    alone, _ = assess(records, 7, bootstrap=100, seed=0)
    assert alone["verdict"] == "poor" and alone["beta_halfwidth"] > 0.25 and len(alone["reasons"]) == 1
    assert alone["choice_loss"] is None
    judged, _ = assess(records, 7, bootstrap=100, seed=0, pools=random_pools(0))
    assert judged["beta_halfwidth"] > 0.25 and judged["choice_loss"] < 0.01 and judged["choice_change_rate"] > 0
    assert judged["verdict"] == "good" and judged["reasons"] == []
    strict, _ = assess(records, 7, bootstrap=100, seed=0, pools=random_pools(0), gate={"max_choice_loss": 1e-4})
    assert strict["verdict"] == "poor" and any("lose" in r for r in strict["reasons"])


def test_gate_thresholds_come_from_the_probe_definition_and_can_be_changed():
    records = probe_records(1, noise_s=1.5e-3)
    loose, _ = assess(records, 7, bootstrap=60, gate={"min_heldout_r2": 0.0, "max_beta_halfwidth": 10.0})
    strict, _ = assess(records, 7, bootstrap=60, gate={"min_heldout_r2": 0.999})
    assert loose["verdict"] == "good" and strict["verdict"] == "poor"
    assert strict["gate"] == {"min_heldout_r2": 0.999, "max_beta_halfwidth": 0.25, "max_choice_loss": 0.01}
    probes = json.loads(files_text("probes.json"))
    assert probes["gate"] == {"min_heldout_r2": 0.5, "max_beta_halfwidth": 0.25, "max_choice_loss": 0.01}
    with pytest.raises(ValueError, match=r"unknown gate setting\(s\) \['r2'\]"):
        assess(records, 7, gate={"r2": 0.5})
    with pytest.raises(ValueError, match="too few for 5-fold"):
        assess(records[:8], 7)


def files_text(name):
    from importlib.resources import files

    return files("specfit.calibration").joinpath(name).read_text()


def poor_model(**meta):
    quality = {"verdict": "poor", "reasons": ["held-out R^2 0.08 < 0.5: ..."], "heldout_r2": 0.08}
    return CostModel((0.013,) * 8, 0.14e-3, {"quality": quality, **meta})


def test_install_refuses_a_poor_fit_and_keeps_what_was_there(tmp_path, capsys):
    path = tmp_path / "profile.json"
    good = CostModel((0.01,) * 8, 1e-4, {"quality": {"verdict": "good", "reasons": []}})
    assert install(good, path) == path and CostModel.load(path) == good
    written = install(poor_model(), path)
    assert written == tmp_path / "profile.json.rejected" and CostModel.load(written) == poor_model()
    assert CostModel.load(path) == good  # the previous profile is untouched
    err = capsys.readouterr().err
    assert "CALIBRATION REFUSED" in err and REMEDY in err and "--force" in err and "R^2 0.08" in err
    assert install(poor_model(), path, force=True) == path and CostModel.load(path) == poor_model()
    assert "installed anyway (--force)" in capsys.readouterr().err
    # calibrated by another command (bench, for the FP8 variant): the refusal names the command that fits it
    install(poor_model(), tmp_path / "fp8.json", command="`specfit calibrate --fp8`")
    err = " ".join(capsys.readouterr().err.split())
    assert "Remedy: calibrate with `specfit calibrate --fp8`: take more probes (--probes, --repeats)" in err
    assert "run `specfit calibrate --fp8 --force` to install it anyway" in err and "rerun with" not in err


def test_command_exits_non_zero_without_installing_a_poor_fit(tmp_path, monkeypatch, capsys):
    """The command's own path, with the probes replaced by a poor result (a real run takes too long for a test)."""
    from argparse import ArgumentParser

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=1))
    records = probe_records(0, noise_s=8e-3)
    meta = dict(device=device_name(model.specfit), model_id=model_id(model), model_key=model_key(model))
    quality, heldout = assess(records, 7, bootstrap=50)
    seen = {}

    def fake_calibrate(model, prompts, **kw):
        seen["threads"] = torch.get_num_threads()
        return Calibration(CostModel.fit(records, max_nodes=7, quality=quality, **meta), records, heldout)

    monkeypatch.setattr(calibrate_module, "_load", lambda args: (model, None))
    monkeypatch.setattr(calibrate_module, "_prompt_texts", lambda args: None)
    monkeypatch.setattr(calibrate_module, "_prompt_ids", lambda args, texts, tokenizer, model: PROMPTS)
    monkeypatch.setattr(probes_module, "calibrate", fake_calibrate)
    parser = ArgumentParser()
    calibrate_module.add_arguments(parser)
    threads = torch.get_num_threads()
    try:
        assert calibrate_module.main(parser.parse_args(["--slots", "4"])) == 3
    finally:
        torch.set_num_threads(threads)
    assert seen["threads"] == 1  # a CPU device calibrates on one thread unless --threads says otherwise
    installed = profile_path(meta["device"], meta["model_key"])
    assert not installed.exists() and installed.with_name(installed.name + ".rejected").exists()
    out = capsys.readouterr()
    assert "verdict     POOR" in out.out and "CALIBRATION REFUSED" in out.err and REMEDY in out.err
    plot = installed.with_name(installed.stem + ".rejected.png")
    try:
        import matplotlib  # noqa: F401  (the optional 'plot' extra)
    except ImportError:  # without it the command says so and writes no plot
        assert "matplotlib is not installed" in out.out and not plot.exists()
    else:
        assert "how to read the plot" in out.out and plot.exists()


def test_enable_warns_when_it_loads_a_poor_or_unassessed_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=1))
    path = profile_path(device_name(model.specfit), model_key(model))
    poor_model(slots=4, cache_mode="cached").save(path)
    with pytest.warns(RuntimeWarning, match=r"failed calibration's quality gate \(held-out R\^2 0.08"):
        assert resolve_cost_model(model).quality["verdict"] == "poor"
    old = {"format": "specfit-cost-model", "version": 1, "units": "seconds", "intercepts": [0.006, 0.003],
           "beta": 2.9e-4, "slots": 4, "cache_mode": "cached"}
    path.write_text(json.dumps(old))  # a new profile in its place: the next lookup uses it
    with pytest.warns(RuntimeWarning, match=r"never checked for fit quality \(a version-1 profile.*intercepts fall"):
        assert resolve_cost_model(model).intercepts == (0.006, 0.003)


def test_no_reference_profile_is_found_for_a_model_of_another_shape():
    from specfit.selection.profiles import reference_profile

    assert reference_profile({"model_key": "specfit/embedded-qwen3-moe [6x64e top4 h80 float32]",
                              "device_name": "cpu-x"}) is None  # the old 6-layer model's shape: not the shipped one
    model = tiny_moe()
    specfit.enable(model, cache_slots=4)
    assert reference_profile(profile_key(model)) is None
