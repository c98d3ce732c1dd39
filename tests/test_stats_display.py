"""What a notebook user reads of ``model.specfit.stats``: short rounded reprs with the derived figures, HTML tables,
documented fields, two spans that cannot be mistaken for each other, and a per-cycle trace that exports and plots."""

import dataclasses
import re
import sys

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.stats import Counters, CycleRecord, Stats, Trace, trace_rows

PROMPT = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(9))


def a_call() -> Counters:
    """The figures of one generate() call of 48 tokens: 20 cycles, 36 nodes verified, 1.2 s of decoding."""
    return Counters(forwards=20, demand=600, hits=480, misses=120, cycles=20, nodes_drafted=300, nodes_verified=36,
                    tokens_committed=48, new_tokens=48, prefill_seconds=0.0412345, decode_seconds=1.2)


def test_counters_repr_is_short_rounded_and_shows_the_derived_figures():
    text = repr(a_call())
    assert "\n" not in text and len(text) < 200, text
    assert "tok/s=40.0" in text  # 48 / 1.2: the figure the README promises, rounded
    assert "nodes/cycle=1.80" in text and "tokens/cycle=2.40" in text and "copies/token=2.50" in text
    assert "hit_rate=80.0%" in text
    assert not re.search(r"\d\.\d{4,}", text), f"unrounded float in {text}"
    # a span without tokens (a forward) says what its experts did
    assert repr(Counters(forwards=1, demand=24, hits=20, misses=4)) == "Counters(forwards=1, copies=4, hit_rate=83.3%)"


def test_counters_repr_shows_expected_tokens_when_counted():
    c = a_call()
    assert "expected" not in repr(c)
    c.expected_tokens = 50.0  # a field added beside this display: shown per cycle when non-zero
    assert "expected_tokens/cycle=2.50" in repr(c)


def test_stats_repr_labels_the_last_call_and_the_running_total():
    stats = Stats()
    assert "no generate() call yet" in repr(stats)
    stats.last_generate = a_call()
    stats.total = a_call()
    stats.total += a_call()
    text = repr(stats)
    last, total = text.splitlines()
    assert last.startswith("Stats(last_generate (the last generate() call)") and "new_tokens=48," in last
    assert "total (every call since reset())" in total and "new_tokens=96," in total
    stats.last_method = "specfit"  # the path the last call ran, where the runtime records it
    assert "last_generate (the last generate() call, specfit)" in repr(stats)


def test_html_tables_for_notebooks():
    table = a_call()._repr_html_()
    assert table.startswith("<table") and table.endswith("</table>")
    assert "<th>tok/s</th>" in table.replace("<th style='text-align:left'>", "<th>") and ">40.0<" in table
    stats = Stats(total=a_call(), last_generate=a_call())
    page = stats._repr_html_()
    assert page.count("<table") == 1 and "last_generate (the last generate() call)" in page
    assert "total (since reset())" in page
    # each row's meaning and attribute as its tooltip
    assert "title='new tokens per second of decoding, wall clock (prefill excluded) [tokens_per_second]'" in page
    assert re.search(r"copies/token</th><td[^>]*>2\.50</td><td[^>]*>2\.50</td>", page)


def test_every_field_is_documented():
    for cls in (Counters, CycleRecord):
        missing = [f.name for f in dataclasses.fields(cls) if f"``{f.name}``" not in cls.__doc__]
        assert not missing, f"{cls.__name__} fields without a word in its docstring: {missing}"
    for span in ("last_generate", "total", "last_prefill", "last_forward", "trace"):
        assert f"``{span}``" in Stats.__doc__


def test_enabled_model_stats_display():
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3))
    model.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant="eagle3")
    stats = model.specfit.stats
    assert "tok/s=" in repr(stats.last_generate) and "nodes/cycle=" in repr(stats)
    assert "<table" in stats._repr_html_()


@pytest.fixture
def traced():
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3))
    trace = model.specfit.stats.start_trace()
    model.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant="eagle3")
    return model, trace


def test_the_trace_exports_one_row_per_cycle(traced):
    model, trace = traced
    stats = model.specfit.stats
    assert isinstance(trace, Trace) and stats.trace is trace
    rows = trace.rows()
    assert len(rows) == stats.last_generate.cycles > 0
    assert [r["cycle"] for r in rows] == list(range(len(rows)))
    assert set(rows[0]) == {"cycle"} | {f.name for f in dataclasses.fields(CycleRecord)}
    assert sum(r["committed"] for r in rows) == stats.last_generate.tokens_committed
    assert trace_rows(list(trace)) == rows  # a plain list of records exports the same
    frame = trace.to_pandas()
    assert frame.index.name == "cycle" and len(frame) == len(rows)
    assert list(frame["n_nodes"]) == [r["n_nodes"] for r in rows]


def test_the_trace_plots_tokens_nodes_and_copies(traced):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    _, trace = traced
    top, bottom = trace.plot()
    labels = [line.get_label() for line in top.get_lines()]
    assert labels == ["tokens committed", "draft nodes verified"]
    assert "copies" in bottom.get_ylabel()
    import matplotlib.pyplot as plt

    plt.close("all")


def test_plot_without_matplotlib_names_the_extra(traced, monkeypatch):
    _, trace = traced
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r'pip install "specfit\[plot\]"'):
        trace.plot()


def test_no_trace_says_how_to_start_one():
    with pytest.raises(ValueError, match=r"start_trace\(\)"):
        trace_rows(Stats().trace)


def test_the_forecast_is_summed_per_cycle_and_held_against_the_clock():
    stats = Stats()
    scope = stats.begin_generate()
    scope.prefill_done()
    for predicted in (0.010, 0.030):  # the cost model's seconds for each cycle it ran
        scope.cycle(pool=8, verified=3, committed=2, seconds=0.02, measurement=0.0, demand=40, misses=4,
                    draft_seconds=0.005, expected=2.0, predicted=predicted)
    scope.end(new_tokens=4)
    c = stats.last_generate
    assert c.predicted_seconds == pytest.approx(0.040) and c.forecast_cycles == 2 == c.cycles
    c.decode_seconds = 0.050  # the clock, set by hand so the ratio is exact
    assert c.forecast_over_real == pytest.approx(0.8)
    assert "forecast/real=0.80" in repr(c)
    assert re.search(r"forecast/real</th><td[^>]*>0\.80<", c._repr_html_())
    assert c.as_dict()["forecast_over_real"] == pytest.approx(0.8)
    total = c.copy()
    total += c  # counters add across calls as the others do
    assert total.predicted_seconds == pytest.approx(0.080) and total.forecast_over_real == pytest.approx(0.8)


def test_no_forecast_means_no_ratio_not_a_zero():
    stats = Stats()
    scope = stats.begin_generate()
    scope.prefill_done()
    scope.cycle(pool=8, verified=7, committed=3, seconds=0.02, measurement=0.0, demand=40, misses=4,
                draft_seconds=0.005, expected=2.5)  # EAGLE-3: no predicted=
    scope.end(new_tokens=3)
    c = stats.last_generate
    assert c.predicted_seconds == 0.0 and c.forecast_cycles == 0 and c.forecast_over_real is None
    assert "forecast" not in repr(c) and "forecast" not in c._repr_html_() and "predicted" not in repr(c)
    # a span where only some cycles were forecast (AR calls beside SpecFit ones in `total`) shows no ratio either
    mixed = a_call()
    mixed.predicted_seconds, mixed.forecast_cycles = 0.5, 10
    assert mixed.forecast_over_real is None
    page = Stats(total=mixed, last_generate=a_call())._repr_html_()
    assert re.search(r"predicted s</th><td[^>]*></td><td[^>]*>0\.500</td>", page) and "forecast/real" not in page


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_a_forecast_that_is_not_seconds_is_refused(bad):
    scope = Stats().begin_generate()
    scope.prefill_done()
    with pytest.raises(ValueError, match=r"predicted= is the cost model's forecast .* seconds.*got"):
        scope.cycle(pool=1, verified=1, committed=1, seconds=0.01, measurement=0.0, demand=1, misses=0,
                    draft_seconds=0.0, predicted=bad)


def test_the_trace_has_the_forecast_of_each_cycle():
    stats = Stats()
    trace = stats.start_trace()
    scope = stats.begin_generate()
    scope.prefill_done()
    for predicted in (0.012, None):
        scope.cycle(pool=8, verified=3, committed=2, seconds=0.02, measurement=0.0, demand=40, misses=4,
                    draft_seconds=0.005, predicted=predicted)
    assert [r["predicted_seconds"] for r in trace.rows()] == [0.012, None]
    assert [r["seconds"] for r in trace.rows()] == [0.02, 0.02]


def test_what_the_copies_cost_per_token_and_in_time():
    c = a_call()
    c.bytes_copied, c.copy_wait_seconds = 48 * 3 * 2**20, 0.3  # 3 MiB a token; 0.3 of 1.2 s blocked by copies
    assert c.mib_copied_per_token == pytest.approx(3.0) and c.copy_wait_share == pytest.approx(0.25)
    text = repr(c)
    assert "MiB/token=3.00" in text and "copy_wait=25.0%" in text and "hit_rate=80.0%" in text
    table = c._repr_html_()
    assert re.search(r"MiB/token</th><td[^>]*>3\.00<", table) and re.search(r"copy wait</th><td[^>]*>25\.0%<", table)
    assert "CUDA: issue time only" in table  # the tooltip says what a host clock sees on each device
    assert Counters().mib_copied_per_token == 0.0 and Counters().copy_wait_share == 0.0
