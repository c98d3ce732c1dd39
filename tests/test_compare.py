"""``specfit.compare``: one call, methods interleaved prompt by prompt, whole calls timed, a table back; refusals
before any decoding work; ``specfit demo`` built on it."""

import re
import sys

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit import embedded
from specfit.evaluation.comparison import COLUMNS

PROMPTS = [torch.randint(2, 256, (1, 7 + i), generator=torch.Generator().manual_seed(i)) for i in range(3)]


@pytest.fixture
def model():
    m = tiny_moe()
    specfit.enable(m, cache_slots=4, drafter=SelfDrafter(m, first_token=int(PROMPTS[0][0, 0]), noise=0.3))
    return m


@pytest.fixture
def calls(model, monkeypatch):
    """The assistant= of every generate() call, in order."""
    seen = []
    original = model.generate

    def generate(*args, **kwargs):
        seen.append((kwargs.get("assistant"), kwargs.get("max_new_tokens")))
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    return seen


def test_compare_interleaves_the_methods_and_returns_a_row_each(model, calls):
    # every prompt starts with token PROMPTS[0][0, 0] as the SelfDrafter assumes
    prompts = [torch.cat([PROMPTS[0][:, :1], p[:, 1:]], dim=1) for p in PROMPTS[:2]]
    table = specfit.compare(model, None, prompts, max_new_tokens=10, as_frame=False)
    assert calls == [(None, 8), ("eagle3", 8), ("specfit", 8)] + [(None, 10), ("eagle3", 10), ("specfit", 10)] * 2
    assert [r["method"] for r in table] == ["ar", "eagle3", "specfit"]
    for row in table:
        assert set(row) == set(COLUMNS)
        assert row["prompts"] == 2 and row["new_tokens"] == 20 and row["seconds"] > 0
        assert row["tok_s"] == pytest.approx(20 / row["seconds"], rel=0.01)
        assert row["tok_s"] == round(row["tok_s"], 1) and row["hit_rate"] == round(row["hit_rate"], 3)
    ar, eagle3, _ = table
    assert ar["speedup"] == 1.0 and ar["tokens_per_cycle"] == 1.0 and ar["nodes_per_cycle"] == 0.0
    assert eagle3["nodes_per_cycle"] > 0
    assert eagle3["speedup"] == pytest.approx(eagle3["tok_s"] / ar["tok_s"], abs=0.01)


def test_compare_returns_a_dataframe_when_pandas_is_there(model):
    pd = pytest.importorskip("pandas")
    frame = specfit.compare(model, None, PROMPTS[0], methods=("ar", "eagle3"), max_new_tokens=6, warmup=False)
    assert isinstance(frame, pd.DataFrame) and list(frame.index) == ["ar", "eagle3"]
    assert frame.index.name == "method" and "tok_s" in frame.columns


def test_compare_returns_rows_without_pandas(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    rows = specfit.compare(model, None, PROMPTS[0], methods=("ar",), max_new_tokens=4, warmup=False)
    assert isinstance(rows, list) and rows[0]["method"] == "ar"
    with pytest.raises(ImportError, match="pandas"):
        specfit.compare(model, None, PROMPTS[0], methods=("ar",), max_new_tokens=4, as_frame=True)


def test_compare_can_draw_its_table(model):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.close("all")
    specfit.compare(model, None, PROMPTS[0], methods=("ar", "eagle3"), max_new_tokens=4, warmup=False, plot=True)
    axes = plt.gcf().axes
    assert len(axes) == 2 and "tok/s" in axes[0].get_ylabel() and "copies" in axes[1].get_ylabel()
    plt.close("all")


@pytest.mark.parametrize("kwargs,match", [
    (dict(methods=("ar", "nope")), r"unknown method 'nope'.*'ar'.*eagle3.*specfit"),
    (dict(methods=("ar", "eagle3-vanilla")), r"eagle3-vanilla need a model of their own.*\{method: model\}"),
    (dict(methods=()), "methods is empty"),
    (dict(max_new_tokens=0), "max_new_tokens must be at least 1"),
    (dict(assistant="specfit"), "leave out assistant="),
    (dict(prompts=["a string"]), "string prompts need a tokenizer"),
    (dict(prompts=torch.ones(2, 5, dtype=torch.long)), "batch of 2"),
])
def test_compare_refuses_before_any_work(model, calls, kwargs, match):
    kwargs = {"prompts": PROMPTS[0], **kwargs}
    with pytest.raises(ValueError, match=match):
        specfit.compare(model, None, max_new_tokens=kwargs.pop("max_new_tokens", 4), **kwargs)
    assert calls == []


def test_compare_refuses_plot_without_matplotlib_before_any_work(model, calls, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r'pip install "specfit\[plot\]"'):
        specfit.compare(model, None, PROMPTS[0], max_new_tokens=4, plot=True)
    assert calls == []


def test_compare_refuses_models_without_specfit_or_a_drafter(calls):
    plain = tiny_moe()
    with pytest.raises(ValueError, match=r"does not have SpecFit enabled.*specfit.enable"):
        specfit.compare(plain, None, PROMPTS[0], max_new_tokens=4)
    no_drafter = specfit.enable(tiny_moe(), cache_slots=4)
    with pytest.raises(ValueError, match=r"'eagle3' needs a drafter"):
        specfit.compare(no_drafter, None, PROMPTS[0], max_new_tokens=4)
    assert calls == []


def test_compare_takes_registered_assistants(model):
    from specfit.decoding.assistants import ASSISTANTS
    from specfit import Eagle3Generator

    specfit.register_assistant("mine", Eagle3Generator, replace=True)
    try:
        rows = specfit.compare(model, None, PROMPTS[0], methods=("ar", "mine"), max_new_tokens=6, as_frame=False)
    finally:
        ASSISTANTS.pop("mine")
    assert rows[1]["method"] == "mine" and rows[1]["nodes_per_cycle"] > 0


@pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed with this package")
def test_demo_runs_on_compare_and_says_where_specfit_pays(capsys, monkeypatch):
    from specfit import cli
    from specfit.evaluation import comparison

    ran = []
    original = comparison.run
    monkeypatch.setattr(comparison, "run", lambda *a, **k: ran.append(a[3]) or original(*a, **k))
    assert cli.main(["demo", "--num-prompts", "2", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert ran == [("ar", "eagle3", "specfit")] * 2  # both workloads measured by compare's code
    pays = [line for line in out.splitlines() if line.startswith("Where SpecFit pays")]
    assert len(pays) == 1 and "slots" in pays[0] and "link" in pays[0]
    assert "1 CPU thread" in out  # the count the demo set, said
    assert out.count("SpecFit + cache") == 2 and "vs AR" in out and "vs EAGLE-3" in out
    tables = [line for line in out.splitlines() if line.startswith(("method ", "AR ", "EAGLE-3 ", "SpecFit + cache"))]
    assert len(tables) == 8 and max(map(len, tables)) <= 80  # the default table fits a terminal
    assert "copies/tok" in out and "MiB/tok" not in out and "fcst/real" not in out  # the rest only with --wide
    # progress: a line per prompt and workload with every method's tok/s (the datasets, or the built-in prompts)
    for workload in ("GSM8K", "CNN/DailyMail"):
        for i in (1, 2):
            assert re.search(rf"^  \[{re.escape(workload)}\] prompt {i} of 2: AR [\d.]+, EAGLE-3 [\d.]+, SpecFit "
                             rf"[\d.]+ tok/s \(\d+ s so far\)$", out, re.M), out[-3000:]
        # the verdict reads the table: SpecFit against AR and against EAGLE-3, each with its spread, and what it says
        assert re.search(rf"^  {re.escape(workload)}: SpecFit [+-]\d+% against AR \(spread \d+%\), [+-]\d+% "
                         rf"against EAGLE-3 \(spread \d+%\), 2 prompts: (faster than both|slower than|not "
                         rf"clearly different from) ", out, re.M)
        assert f"--- {workload}: prompt 1 of 2 ---" in out
    assert "-0%" not in out and "prompt prompt" not in out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(notes) == len(set(notes))  # each note once


def test_compare_reports_what_the_copies_cost_and_both_forecasts(model):
    from specfit.evaluation import comparison

    result = comparison.run(model, None, PROMPTS[0], ("ar", "eagle3"), max_new_tokens=8, warmup=False)
    rows = result.rows()
    for row in rows:
        c = result.counters[row["method"]]
        assert c.bytes_copied > 0 and c.copy_wait_seconds > 0  # 4 slots of 8 experts: copies, each a memcpy here
        assert row["mib_per_token"] == round(c.bytes_copied / 2**20 / c.new_tokens, 2)
        assert row["copy_wait_share"] == round(c.copy_wait_seconds / c.decode_seconds, 3) > 0
        assert row["hit_rate"] == round(c.hits / c.demand, 3)
        assert row["forecast_over_real"] is None  # neither method forecasts its time
    assert rows[0]["expected_over_committed"] == 1.0  # AR expects its one token a step, and gets it
    text = result.format("title")
    head = text.splitlines()[1]
    for column in ("exp/real", "fcst/real", "copies/tok", "MiB/tok", "copy wait", "hit rate"):
        assert column in head
    assert text.splitlines()[3].split()[-5] == "-"  # AR's forecast column: none made


def test_compare_prints_the_forecast_of_a_method_that_makes_one():
    from specfit.evaluation.comparison import Comparison, LEGEND
    from specfit.evaluation.harness import METHODS
    from specfit.stats import Counters

    forecast = Counters(cycles=10, tokens_committed=25, expected_tokens=24.0, new_tokens=25, decode_seconds=2.0,
                        predicted_seconds=1.8, forecast_cycles=10, bytes_copied=25 * 2**21, copy_wait_seconds=0.5)
    result = Comparison({"specfit": METHODS["specfit"]}, 1, {"specfit": forecast}, {"specfit": 2.5},
                        {"specfit": []})
    row = result.rows()[0]
    assert row["forecast_over_real"] == 0.9 and row["expected_over_committed"] == 0.96
    assert row["mib_per_token"] == 2.0 and row["copy_wait_share"] == 0.25
    line = result.format().splitlines()[2].split()
    assert line[-6:] == ["0.96", "0.90", "0.00", "2.00", "25.0%", "0%"]
    assert any(entry.startswith("fcst/real:") for entry in LEGEND) and any("MiB/tok" in e for e in LEGEND)
