"""The cycle-time model: NNLS fit, validation, JSON profiles and where they live."""

import doctest
import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

import specfit.selection.cost_model
import specfit.selection.profile_files
from specfit.selection.cost_model import CostModel, Record
from specfit.selection.profile_files import ProfileError, profile_dir, profile_path

REFERENCE = Path(__file__).resolve().parents[1] / "calibration" / "paper_reference.json"


def synthetic(rng, intercepts, beta, per_count=40, noise=0.01, counts=None):
    """Records timed by the model itself, with multiplicative Gaussian noise."""
    records = []
    for n in counts if counts is not None else range(len(intercepts)):
        for demand in rng.integers(384, 384 + 200 * (n + 1), per_count):  # wider trees ask for more experts
            seconds = (intercepts[n] + beta * demand) * (1 + noise * rng.standard_normal())
            records.append(Record(n, int(demand), float(seconds)))
    return records


# ---- fit -----------------------------------------------------------------------------------------------------------


def test_fit_recovers_known_coefficients_from_noisy_records():
    truth = (0.100, 0.104, 0.109, 0.115, 0.120, 0.126, 0.131, 0.137)
    model = CostModel.fit(synthetic(np.random.default_rng(0), truth, 0.211e-3), device="test")
    assert model.beta == pytest.approx(0.211e-3, rel=0.03)
    assert model.intercepts == pytest.approx(truth, rel=0.05)
    assert model.meta["device"] == "test"
    assert model.meta["n_records"] == 8 * 40
    assert model.meta["observed_nodes"] == list(range(8))
    assert 0.9 < model.meta["r2"] <= 1.0
    assert 0 < model.meta["rms_residual_s"] <= model.meta["max_abs_residual_s"] < 0.02
    datetime.fromisoformat(model.meta["date"])


def test_fit_keeps_coefficients_non_negative_when_the_truth_has_a_zero():
    # All experts resident: time does not depend on demand, and noise pulls plain least squares below zero.
    rng = np.random.default_rng(4)
    records = synthetic(rng, (0.05, 0.06, 0.07), beta=0.0, noise=0.05)
    rows = np.array(records, float)
    onehot = np.eye(3)[rows[:, 0].astype(int)]
    plain = np.linalg.lstsq(np.column_stack([onehot, rows[:, 1]]), rows[:, 2], rcond=None)[0]
    assert plain[-1] < 0  # the data really does tempt an unconstrained fit into a negative beta

    model = CostModel.fit(records)
    assert model.beta >= 0.0 and model.beta < 2e-6
    assert min(model.intercepts) >= 0.0
    assert model.intercepts == pytest.approx((0.05, 0.06, 0.07), rel=0.05)


def collinear(rng, intercepts, beta, per_count=40, noise_s=2e-3):
    """Records like the issue's probes: demand grows with the node count (every node adds experts) and the timer
    is noisy; demand still varies at each count, through which nodes were verified."""
    records = []
    for n, a in enumerate(intercepts):
        for _ in range(per_count):
            demand = 24 + int(rng.integers(6, 16)) * n + int(rng.integers(0, 6))
            records.append(Record(n, demand, a + beta * demand + noise_s * rng.standard_normal()))
    return records


def one_hot_nnls(records):
    """The version-1 fit: one free intercept per node count, then beta, by NNLS (for comparison only)."""
    from scipy.optimize import nnls

    rows = np.array(records, float)
    features = np.column_stack([np.eye(int(rows[:, 0].max()) + 1)[rows[:, 0].astype(int)], rows[:, 1]])
    scale = np.linalg.norm(features, axis=0)
    return nnls(features / scale, rows[:, 2])[0] / scale


def test_monotone_fit_keeps_intercepts_rising_and_recovers_beta_on_collinear_records():
    truth = (6.0e-3, 6.1e-3, 6.2e-3, 6.3e-3, 6.4e-3, 6.5e-3, 6.6e-3, 6.7e-3)  # nearly flat, as on the CPU
    falls = 0
    for seed in range(10):
        records = collinear(np.random.default_rng(seed), truth, 0.28e-3)
        old = one_hot_nnls(records)[:-1]
        falls += bool(np.any(np.diff(old) < 0))
        model = CostModel.fit(records)
        assert model.monotone and np.all(np.diff(model.intercepts) >= 0), model.intercepts
        assert model.beta == pytest.approx(0.28e-3, rel=0.10)
        assert model.intercepts == pytest.approx(truth, abs=2e-3)  # records have 2 ms of noise each
    assert falls >= 5  # the same data does make the one-intercept-per-count fit fall with n


def test_monotone_fit_is_exact_on_clean_records():
    truth = (0.010, 0.010, 0.012, 0.015, 0.015, 0.020)  # flat stretches included: increments may be 0
    rng = np.random.default_rng(5)
    records = [(n, float(d), truth[n] + 3e-4 * d) for n in range(6) for d in rng.integers(20, 200, 12)]
    model = CostModel.fit(records)
    assert model.intercepts == pytest.approx(truth, abs=1e-12)
    assert model.beta == pytest.approx(3e-4, rel=1e-9)


def test_fit_holds_intercepts_above_the_measured_drafting():
    # the records say a(0) is 5 ms, but drafting its levels was measured at 4 + 3 ms: every cycle paid those
    records = [(n, d, 0.005 + 0.001 * n + 1e-4 * d) for n in range(3) for d in (10, 40, 90)]
    model = CostModel.fit(records, draft_level_seconds=(0.004, 0.003))
    assert min(model.intercepts) >= 0.007 - 1e-12
    assert model.draft_levels == 2 and model.draft_level_seconds == (0.004, 0.003)
    assert np.all(np.diff(model.intercepts) >= 0)


def test_drafting_is_charged_per_level_drafted():
    model = CostModel((0.020, 0.025, 0.030), beta=1e-4, draft_level_seconds=(0.001, 0.003, 0.003))
    assert model.predict(1, 100) == pytest.approx(0.035)
    assert model.predict(1, 100, levels=3) == pytest.approx(0.035)  # the probes' own depth: unchanged
    assert model.predict(1, 100, levels=1) == pytest.approx(0.029)
    assert model.predict(0, 100, levels=0) == pytest.approx(0.023)  # nothing drafted at all
    assert model.predict(2, 100, levels=5) == pytest.approx(0.046)  # deeper than measured: the last level's time
    assert model.drafting_seconds(2) == pytest.approx(0.004)
    shallow = model.at_levels(2)  # what the selector takes: the intercepts of a 2-level cycle
    assert shallow.intercepts == pytest.approx((0.017, 0.022, 0.027)) and shallow.beta == model.beta
    assert shallow.draft_level_seconds == (0.001, 0.003)
    assert shallow.predict(2, 50) == pytest.approx(model.predict(2, 50, levels=2))
    assert model.at_levels(4).draft_level_seconds == (0.001, 0.003, 0.003, 0.003)
    with pytest.raises(ValueError, match="n_nodes=1 with levels=0"):
        model.predict(1, 100, levels=0)
    with pytest.raises(ValueError, match="levels must be an int >= 0, got -1"):
        model.predict(0, 100, levels=-1)
    with pytest.raises(ValueError, match="does not model drafting per level"):
        CostModel((0.1, 0.2), beta=1e-4).predict(1, 10, levels=1)


def physical(rng, intercepts, beta, overhead, share, links=(0.0, 3e-4), per_count=30, noise=0.01, slots=24):
    """Records of a cycle that computes ``demand`` experts and copies ``misses`` of them, each copy costing
    ``overhead + share x link``: misses vary apart from demand (cache warm or cold), over every link in ``links``."""
    records = []
    for n, a in enumerate(intercepts):
        for _ in range(per_count):
            demand = int(rng.integers(384, 384 + 150 * (n + 1)))
            misses = demand if rng.random() < 0.2 else int(demand * rng.uniform(0.05, 0.6))  # cold or warm
            for link in links:
                seconds = (a + beta * demand + misses * (overhead + share * link)) * (1 + noise * rng.standard_normal())
                records.append(Record(n, demand, seconds, misses, link))
    return records


def test_cache_aware_fit_recovers_compute_copy_overhead_and_link_share():
    truth = (0.020, 0.021, 0.023, 0.024, 0.026, 0.027, 0.029, 0.030)
    records = physical(np.random.default_rng(0), truth, beta=2e-5, overhead=1e-5, share=0.9)
    model = CostModel.fit(records, kind="cache-aware")
    assert model.beta == pytest.approx(2e-5, rel=0.1)
    assert model.copy_overhead == pytest.approx(1e-5, abs=4e-6) and model.link_share == pytest.approx(0.9, rel=0.05)
    assert model.intercepts == pytest.approx(truth, rel=0.05) and model.meta["r2"] > 0.95
    # the model comes back priced at its records' first copy's link (0: a memcpy), and carries to any other
    assert model.copy == pytest.approx(model.copy_overhead)
    at = model.priced(1e-3)
    assert at.copy == pytest.approx(model.copy_overhead + model.link_share * 1e-3)
    assert at.predict(3, 500, misses=100) == pytest.approx(model.intercepts[3] + model.beta * 500 + at.copy * 100)
    # demand alone cannot tell a warm cycle from a cold one: the paper's fit explains far less of the same records
    paper = CostModel.fit(records)
    assert paper.copy == 0.0 and not paper.prices_copies and paper.meta["r2"] < model.meta["r2"] - 0.2


def test_with_one_link_the_whole_link_time_counts_and_the_overhead_is_fitted():
    truth = (0.02, 0.022, 0.024)
    records = physical(np.random.default_rng(1), truth, beta=3e-5, overhead=2e-5, share=1.0, links=(4e-4,))
    model = CostModel.fit(records, kind="cache-aware")
    assert model.link_share == 1.0  # not identifiable from one link: held at 1
    assert model.copy_overhead == pytest.approx(2e-5, abs=8e-6) and model.beta == pytest.approx(3e-5, rel=0.15)
    assert model.copy == pytest.approx(model.copy_overhead + 4e-4)


def test_cache_aware_fit_needs_misses_that_vary():
    records = [Record(n, d, 0.01 + 1e-4 * d, 7, 0.0) for n in range(3) for d in (100, 200, 300)]
    with pytest.raises(ValueError, match="misses never vary"):
        CostModel.fit(records, kind="cache-aware")
    with pytest.raises(ValueError, match="kind must be one of"):
        CostModel.fit(records, kind="misses")


def test_the_paper_fit_is_a_demand_only_model_with_its_setup():
    extra = {"intercepts": [0.006, 0.0065], "beta": 3.1e-4, "draft_level_seconds": [0.001, 0.002], "slots": 24,
             "link": "real copies"}
    model = CostModel((0.004, 0.005), 2e-4, {"paper": extra}, draft_level_seconds=(0.001, 0.002),
                      copy_overhead=1e-5, link_share=1.0)
    paper = model.paper()
    assert paper.intercepts == (0.006, 0.0065) and paper.beta == 3.1e-4 and paper.draft_level_seconds == (0.001, 0.002)
    assert paper.meta == {"source": "paper fit", "slots": 24, "link": "real copies"} and not paper.prices_copies
    demand_only = CostModel((0.1,), 1e-4)
    assert demand_only.paper() is demand_only
    with pytest.raises(ValueError, match="has no copy coefficient"):
        demand_only.priced(1e-3)
    with pytest.raises(ValueError, match="needs the profile's fit on demand alone"):
        CostModel((0.1,), 1e-4, copy_overhead=0.0, link_share=1.0).paper()
    with pytest.raises(ValueError, match="come together"):
        CostModel((0.1,), 1e-4, copy_overhead=0.0)


def test_drafting_cannot_exceed_the_intercepts():
    with pytest.raises(ValueError, match="'draft_level_seconds' sums to"):
        CostModel((0.005, 0.010), beta=1e-4, draft_level_seconds=(0.004, 0.003))
    with pytest.raises(ValueError, match=r"'draft_level_seconds\[1\]' must be a non-negative number"):
        CostModel((0.5, 0.5), beta=1e-4, draft_level_seconds=(0.004, -1))


def test_fit_fills_unobserved_node_counts_from_their_neighbours():
    truth = (0.10, 0.11, 0.12, 0.13, 0.14, 0.15)
    records = synthetic(np.random.default_rng(1), truth, 2e-4, noise=0.0, counts=[1, 3, 4])
    model = CostModel.fit(records, max_nodes=5)
    assert model.meta["observed_nodes"] == [1, 3, 4]
    assert model.intercepts == pytest.approx(truth, abs=1e-9)  # linear truth: inter- and extrapolation are exact


@pytest.mark.parametrize(
    "counts, truth, expected",
    [
        ([3, 4], (0, 0, 0, 0.1, 0.3), [0.0, 0.0, 0.0, 0.1, 0.3, 0.5, 0.7]),  # the line down is clamped at 0
        ([2], (0, 0, 0.2), [0.2] * 7),  # one observed count: flat
    ],
)
def test_fit_extrapolation_stays_non_negative(counts, truth, expected):
    records = synthetic(np.random.default_rng(3), truth, 1e-4, noise=0.0, counts=counts)
    assert CostModel.fit(records, max_nodes=6).intercepts == pytest.approx(expected, abs=1e-9)


def test_fit_accepts_plain_tuples():
    records = [(n, d, 0.1 + 0.01 * n + 2e-4 * d) for n in range(3) for d in (100, 300, 600)]
    assert CostModel.fit(records).beta == pytest.approx(2e-4)


@pytest.mark.parametrize(
    "records, message",
    [
        ([(0, 100, 0.1), (1, 200, 0.2)], "too few"),
        ([(n, 400, 0.1 + n) for n in range(3) for _ in range(5)], "demand never varies"),
        ([(0, 100, 0.1), (1, 200, -0.2), (1, 300, 0.3), (0, 50, 0.1)], "seconds >= 0"),
        ([(0.5, 100, 0.1)] * 5, "integer"),
    ],
)
def test_fit_rejects_records_it_cannot_fit(records, message):
    with pytest.raises(ValueError, match=message):
        CostModel.fit(records)


def test_fit_rejects_max_nodes_below_the_records():
    records = [(n, d, 0.1 + 2e-4 * d) for n in range(4) for d in (100, 300)]
    with pytest.raises(ValueError, match="max_nodes=2 is below"):
        CostModel.fit(records, max_nodes=2)


# ---- the model -----------------------------------------------------------------------------------------------------


def test_predict_and_its_range():
    model = CostModel((0.1, 0.2), beta=0.001)
    assert model.predict(1, 50) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="outside the fitted range 0..1"):
        model.predict(2, 50)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(intercepts=(), beta=0.1), "'intercepts' must hold at least one value"),
        (dict(intercepts=(0.1, -0.2), beta=0.1), r"'intercepts\[1\]' must be a non-negative number, got -0.2"),
        (dict(intercepts=(0.1, float("nan")), beta=0.1), r"'intercepts\[1\]'"),
        (dict(intercepts=(0.1,), beta=-1), "'beta' must be a non-negative number, got -1"),
        (dict(intercepts=(0.1,), beta="fast"), "'beta' must be a non-negative number, got 'fast'"),
        (dict(intercepts=(0.1,), beta=0.1, meta={"beta": 2}), "reserved"),
    ],
)
def test_invalid_models_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**kwargs)


def test_default_is_the_papers_a100_beta_with_flat_placeholder_intercepts():
    model = CostModel.default()
    assert model.beta == pytest.approx(0.211e-3)
    assert len(model.intercepts) == 8 and len(set(model.intercepts)) == 1
    assert model.meta == {"source": "default"}


def test_docstring_examples_run():
    for module in (specfit.selection.cost_model, specfit.selection.profile_files):
        assert doctest.testmod(module).failed == 0, module.__name__


# ---- profiles ------------------------------------------------------------------------------------------------------

META = {"device": "NVIDIA A100-PCIE-40GB", "model_id": "Qwen/Qwen3-30B-A3B-Instruct-2507", "slots": 48,
        "cache_mode": "cached"}


def test_version_3_round_trip_keeps_the_copy_coefficient_and_not_the_link(tmp_path):
    model = CostModel.fit(physical(np.random.default_rng(5), (0.02, 0.021, 0.023), 2e-5, 1e-5, 0.95),
                          kind="cache-aware", **META).priced(7e-4)
    data = json.loads(model.save(tmp_path / "p.json").read_text())
    assert data["version"] == 3 and data["copy_overhead_s"] == model.copy_overhead
    assert data["link_share"] == model.link_share and "copy" not in data and "priced_link_seconds" not in data
    loaded = CostModel.load(tmp_path / "p.json")
    assert loaded.copy == 0.0 and loaded.priced(7e-4) == model


def test_save_load_round_trip(tmp_path):
    model = CostModel.fit(synthetic(np.random.default_rng(2), (0.1, 0.12, 0.13), 3e-4), **META)
    path = model.save(tmp_path / "deep" / "profile.json")
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["units"]) == ("specfit-cost-model", 3, "seconds")
    assert data["slots"] == 48 and data["beta"] == model.beta
    assert CostModel.load(path, expect={"slots": 48, "cache_mode": "cached"}) == model


def test_save_load_round_trip_keeps_drafting_levels_and_quality(tmp_path):
    quality = {"verdict": "poor", "reasons": ["held-out R^2 0.2 < 0.5"], "heldout_r2": 0.2}
    model = CostModel((0.02, 0.03), 1e-4, {"slots": 12, "quality": quality}, draft_level_seconds=(0.001, 0.004))
    loaded = CostModel.load(model.save(tmp_path / "p.json"))
    assert loaded == model and loaded.draft_level_seconds == (0.001, 0.004) and loaded.quality == quality


V1 = {"format": "specfit-cost-model", "version": 1, "units": "seconds", "beta": 2.9e-4, "slots": 12, "r2": 0.82,
      "cache_mode": "cached"}


def test_version_1_profiles_load_as_unassessed(tmp_path):
    model = CostModel.load(write(tmp_path, {**V1, "intercepts": [0.006, 0.007, 0.007]}), expect={"slots": 12})
    assert model.intercepts == (0.006, 0.007, 0.007) and model.beta == 2.9e-4 and model.meta["r2"] == 0.82
    assert model.draft_levels == 0  # drafting per level was not measured then
    assert model.quality["verdict"] == "unassessed" and "version-1" in model.quality["reasons"][0]
    assert len(model.quality["reasons"]) == 1
    again = CostModel.load(model.save(tmp_path / "v3.json"))  # re-saved, it is a current file that says so
    assert json.loads((tmp_path / "v3.json").read_text())["version"] == 3 and again == model


def test_version_1_profile_with_falling_intercepts_loads_and_says_so(tmp_path):
    # the shipped 12-slot link profile of version 1: a(0) = 6.08 ms down to a(7) = 0
    falling = [0.00608, 0.00329, 0.00207, 0.00092, 0.00033, 0.0005, 0.00024, 0.0]
    model = CostModel.load(write(tmp_path, {**V1, "intercepts": falling}))
    assert not model.monotone and model.intercepts == tuple(falling)
    assert model.quality["verdict"] == "unassessed"
    assert "intercepts fall with n (a(1) = 3.29 ms < a(0) = 6.08 ms)" in model.quality["reasons"][1]


@pytest.mark.parametrize("path", sorted(REFERENCE.parent.glob("embedded*.json")), ids=lambda p: p.name)
def test_shipped_reference_profiles_load(path):
    model = CostModel.load(path)
    assert model.max_nodes >= 7  # the embedded model, or its FP8 variant (its folder's name)
    assert model.meta["model_id"] == "specfit/embedded-qwen3-moe" or model.meta["model_id"].startswith("target-fp8-")
    assert model.prices_copies and model.monotone and model.draft_levels >= 1
    assert model.quality["verdict"] == "good" and model.paper().beta > 0


def write(tmp_path, text):
    path = tmp_path / "profile.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return path


GOOD = {"format": "specfit-cost-model", "version": 2, "units": "seconds", "intercepts": [0.1, 0.2], "beta": 2e-4,
        "draft_level_seconds": [0.01, 0.02], "slots": 48}


@pytest.mark.parametrize(
    "content, field",
    [
        ('{"format": "specfit-cost-model", "beta": ', "not valid JSON"),
        ([1, 2], "a profile is a JSON object"),
        ({k: v for k, v in GOOD.items() if k != "beta"}, "missing field 'beta'"),
        ({**GOOD, "intercepts": "0.1"}, "field 'intercepts' must be a non-empty list"),
        ({**GOOD, "intercepts": [0.1, "x"]}, r"field 'intercepts\[1\]' must be a non-negative number, got 'x'"),
        ({**GOOD, "beta": -1}, "field 'beta' must be a non-negative number, got -1"),
        ({**GOOD, "beta": True}, "field 'beta' must be a non-negative number, got True"),
        ({**GOOD, "format": "other"}, "field 'format' is 'other', expected 'specfit-cost-model'"),
        ({**GOOD, "version": 4}, "field 'version' is 4, expected 1, 2 or 3 .a newer profile needs a newer specfit"),
        ({**GOOD, "version": 3, "copy_overhead_s": 1e-5}, "'copy_overhead_s' and 'link_share' come together"),
        ({**GOOD, "version": 3, "copy_overhead_s": 1e-5, "link_share": -1}, "'link_share' must be a non-negative"),
        ({**GOOD, "version": True}, "field 'version' is True"),
        ({k: v for k, v in GOOD.items() if k != "draft_level_seconds"}, "missing field 'draft_level_seconds'"),
        ({**GOOD, "draft_level_seconds": 0.01}, "field 'draft_level_seconds' must be a list"),
        ({**GOOD, "draft_level_seconds": [0.05, 0.06]}, "'draft_level_seconds' sums to 0.11 s, more than the smallest"),
        ({**GOOD, "quality": {"verdict": "fine"}}, "field 'quality' must be an object whose 'verdict' is one of"),
        ({**GOOD, "units": "ms"}, "field 'units' is 'ms', expected 'seconds'"),
    ],
)
def test_corrupt_profiles_name_the_file_and_the_field(tmp_path, content, field):
    # field: a regex for the part of the message that names the field (or the JSON problem)
    path = write(tmp_path, content)
    with pytest.raises(ProfileError) as err:
        CostModel.load(path)
    assert str(err.value).startswith(f"{path}: ")
    assert re.search(field, str(err.value))


@pytest.mark.parametrize(
    "expect, message",
    [({"slots": 24}, "field 'slots' is 48, expected 24"), ({"cache_mode": "cleared"}, "field 'cache_mode' is missing")],
)
def test_mismatched_profile_names_the_file_and_the_field(tmp_path, expect, message):
    path = write(tmp_path, GOOD)
    with pytest.raises(ProfileError, match=message) as err:
        CostModel.load(path, expect=expect)
    assert str(err.value).startswith(f"{path}: ")


def test_missing_profile_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="cannot read profile"):
        CostModel.load(tmp_path / "absent.json")


def test_profile_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "sf"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profile_dir() == tmp_path / "sf" / "profiles"
    monkeypatch.delenv("SPECFIT_CACHE")
    assert profile_dir() == tmp_path / "xdg" / "specfit" / "profiles"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert profile_dir() == tmp_path / "home" / ".cache" / "specfit" / "profiles"


def test_profile_path_is_one_safe_file_per_device_and_model(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    path = profile_path("NVIDIA A100-PCIE-40GB", "Qwen/Qwen3-30B-A3B [48x128e top8 h2048 bfloat16]")
    assert path.parent == tmp_path / "profiles"
    assert path.name == "NVIDIA-A100-PCIE-40GB__Qwen--Qwen3-30B-A3B-48x128e-top8-h2048-bfloat16.json"
    assert profile_path("../../etc", "a b/c:d").name == "etc__a-b--c-d.json"
    with pytest.raises(ValueError, match="model_key must be a non-empty string"):
        profile_path("gpu", "")


def test_paper_reference_points_are_the_papers_betas():
    ref = json.loads(REFERENCE.read_text())
    assert "SpecFit" in ref["source"]
    betas = {(p["device"], p["cache_mode"]): p["beta_ms_per_expert"] for p in ref["points"]}
    assert betas == {
        ("A100 PCIe 40GB", "cached"): 0.211,
        ("A100 PCIe 40GB", "cleared"): 0.408,
        ("RTX 4090 24GB", "cached"): 0.206,
        ("RTX 4090 24GB", "cleared"): 0.782,
    }
