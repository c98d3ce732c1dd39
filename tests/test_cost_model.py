"""The cycle-time model: NNLS fit, validation, JSON profiles and where they live."""

import doctest
import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

import specfit.selection.cost_model
from specfit.selection.cost_model import CostModel, ProfileError, Record, profile_dir, profile_path

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


def test_fit_fills_unobserved_node_counts_from_their_neighbours():
    truth = (0.10, 0.11, 0.12, 0.13, 0.14, 0.15)
    records = synthetic(np.random.default_rng(1), truth, 2e-4, noise=0.0, counts=[1, 3, 4])
    model = CostModel.fit(records, max_nodes=5)
    assert model.meta["observed_nodes"] == [1, 3, 4]
    assert model.intercepts == pytest.approx(truth, abs=1e-9)  # linear truth: inter- and extrapolation are exact


@pytest.mark.parametrize(
    "counts, truth, expected",
    [
        ([3, 4], (0, 0, 0, 0.3, 0.1), [0.9, 0.7, 0.5, 0.3, 0.1, 0.0, 0.0]),  # the falling line is clamped at 0
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
    assert doctest.testmod(specfit.selection.cost_model).failed == 0


# ---- profiles ------------------------------------------------------------------------------------------------------

META = {"device": "NVIDIA A100-PCIE-40GB", "model_id": "Qwen/Qwen3-30B-A3B-Instruct-2507", "slots": 48,
        "cache_mode": "cached"}


def test_save_load_round_trip(tmp_path):
    model = CostModel.fit(synthetic(np.random.default_rng(2), (0.1, 0.12, 0.13), 3e-4), **META)
    path = model.save(tmp_path / "deep" / "profile.json")
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["units"]) == ("specfit-cost-model", 1, "seconds")
    assert data["slots"] == 48 and data["beta"] == model.beta
    assert CostModel.load(path, expect={"slots": 48, "cache_mode": "cached"}) == model


def write(tmp_path, text):
    path = tmp_path / "profile.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return path


GOOD = {"format": "specfit-cost-model", "version": 1, "units": "seconds", "intercepts": [0.1, 0.2], "beta": 2e-4,
        "slots": 48}


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
        ({**GOOD, "version": 2}, "field 'version' is 2, expected 1"),
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


def test_profile_path_is_one_safe_file_per_device_model_slots_and_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    path = profile_path("NVIDIA A100-PCIE-40GB", "Qwen/Qwen3-30B-A3B-Instruct-2507", 48, "cached")
    assert path.parent == tmp_path / "profiles"
    assert path.name == "NVIDIA-A100-PCIE-40GB__Qwen--Qwen3-30B-A3B-Instruct-2507__slots48__cached.json"
    assert profile_path("../../etc", "a b/c:d", 0, "cleared").name == "etc__a-b--c-d__slots0__cleared.json"
    names = {profile_path("gpu", "m", s, mode).name for s in (24, 48) for mode in ("cached", "cleared")}
    assert len(names) == 4
    with pytest.raises(ValueError, match="cache_mode"):
        profile_path("gpu", "m", 48, "warm")
    with pytest.raises(ValueError, match="slots"):
        profile_path("gpu", "m", -1, "cached")


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
