"""The bench's regime map (SpecFit / the best of AR, EAGLE-3 and prompt lookup over link ratio x slots), its
prompt-lookup row, and the acceptance oracle's row shown apart, on synthetic figures and on the harness."""

from argparse import Namespace

import pytest

from specfit.evaluation import bench, harness, regime_map
from specfit.stats import Counters


def cells():
    out = []
    for ratio in (0.0, 1.0):
        for slots in (6, 64):
            slow_ar = 1.0 + ratio * (64 - slots) / 64  # copies cost AR more where the link is dear and slots few
            out.append(dict(link_ratio=ratio, slots=slots, workload="gsm8k", prompts=2,
                            tok_s={"ar": 10 / slow_ar, "eagle3": 9.0, "specfit": 12.0, "prompt-lookup": 10.0}))
    return out


def test_the_map_report_gives_specfit_over_the_best_baseline_and_each_one_per_cell():
    text = regime_map.report(cells())
    assert "[gsm8k] SpecFit / the best of AR, EAGLE-3 and prompt lookup" in text
    best = text.split("[gsm8k] SpecFit / the best of")[1].splitlines()
    # ratio 0: AR and prompt lookup tie at 10 (AR named first); ratio 1, 6 slots: AR is slow, prompt lookup best
    assert best[2].split() == ["0", "1.20A", "1.20A"] and best[3].split() == ["1", "1.20P", "1.20A"]
    assert "[gsm8k] SpecFit / EAGLE-3 + cache" in text and "[gsm8k] SpecFit / Prompt lookup (10)" in text
    rows = text.split("[gsm8k] SpecFit / AR")[1].splitlines()
    assert rows[2].split() == ["0", "1.20", "1.20"] and rows[3].split() == ["1", "2.29", "1.20"]


def test_the_map_is_drawn_as_heat_maps(tmp_path):
    pytest.importorskip("matplotlib")
    regime_map.plot(cells(), tmp_path / "regime_map.png")
    assert (tmp_path / "regime_map.png").stat().st_size > 10_000


def test_the_map_grid_is_the_issues_and_its_size_is_an_option():
    assert regime_map.MAP_RATIOS == (0.5, 1.0, 1.4, 2.0, 4.0, 8.0) and regime_map.MAP_SLOTS == (6, 12, 24, 64)
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--map-only", "--map-prompts", "1", "--map-tokens", "8", "--map-ratios", "1.4", "4",
                              "--map-slots", "12", "24"])
    assert (args.map_prompts, args.map_tokens, args.map_ratios, args.map_slots) == (1, 8, [1.4, 4.0], [12, 24])
    assert parser.parse_args([]).map_tokens is None  # default: --max-new-tokens


@pytest.mark.parametrize("field,value,match", [
    ("map_prompts", 0, "--map-prompts must be at least 1, got 0"),
    ("map_tokens", 0, "--map-tokens must be at least 1, got 0"),
    ("map_ratios", [1.0, -2.0], r"--map-ratios .* >= 0 \(0: no link\), got \[-2.0\]"),
    ("map_slots", [0, 12], r"--map-slots .* >= 1, got \[0\]"),
])
def test_bad_map_options_are_refused_before_any_model_loads(field, value, match):
    args = Namespace(map_prompts=1, map_tokens=None, map_ratios=[1.0], map_slots=[12])
    setattr(args, field, value)
    with pytest.raises(ValueError, match=match):
        regime_map.check_arguments(args)


def test_a_map_row_scales_the_link_to_its_ratio_of_compute(monkeypatch):
    from specfit import embedded
    from specfit.offload.link import LinkConfig

    default = LinkConfig(seconds_per_expert=1e-3, relative=1.0)  # the structural default: 1.4 x compute
    four = regime_map.map_link(default, 1.39, 4.0)
    assert four.seconds_per_expert == pytest.approx(1e-3 * 4.0 / embedded.DEMAND_TO_COMPUTE)
    assert four.relative == pytest.approx(4.0 / 1.4) and "structural default" in four.label
    assert regime_map.map_link(default, 1.39, 1.4) == default
    given = LinkConfig(seconds_per_expert=2e-3)  # --link-ms: its ratio was measured as 0.8
    assert regime_map.map_link(given, 0.8, 4.0).seconds_per_expert == pytest.approx(1e-2)
    assert regime_map.map_link(given, 0.8, 0.0) is None  # no link


def test_a_map_cell_names_the_best_baseline_and_carries_specfits_figures():
    runs = harness.Runs(
        counters={m: Counters(new_tokens=20, cycles=10, nodes_verified=25, tokens_committed=20, decode_seconds=1.0,
                              predicted_seconds=0.9, forecast_cycles=10 if m == "specfit" else 0,
                              bytes_copied=20 * 2**20, copy_wait_seconds=0.1) for m in regime_map.MAP_METHODS},
        seconds={"ar": 2.0, "eagle3": 1.6, "specfit": 1.0, "prompt-lookup": 2.5}, calls={}, outputs={})
    cell = regime_map.map_cell(4.0, 12, "gsm8k", 1, runs)
    assert cell["best_baseline"] == "eagle3" and cell["specfit_over_best"] == pytest.approx(1.6)
    assert cell["specfit_forecast_over_real"] == pytest.approx(0.9)
    assert cell["mib_per_token"]["ar"] == pytest.approx(1.0) and cell["copy_wait_share"]["ar"] == pytest.approx(0.1)


def oracle_rows():
    def row(method, tok_s, measurement=0.0, excluding=None):
        return harness.Row(method, "gsm8k", "12", "emulated link", 2, 64, tok_s, 2.0, 2.5, 50.0, 10.0, 0.8, 0.0, 0.0,
                           measurement, excluding if excluding is not None else tok_s, 0.1, tok_s, 1.0, tok_s)
    return [row("ar", 10.0), row("specfit", 12.0), row("acceptance-oracle", 9.0, measurement=2.0, excluding=16.0)]


def test_specfit_is_reported_as_a_fraction_of_the_acceptance_oracle_shown_apart():
    rows = oracle_rows()
    assert bench.oracle_fractions(rows) == [dict(regime="emulated link", workload="gsm8k", slots="12",
                                                 specfit_tok_s=12.0, oracle_tok_s_excluding_measurement=16.0,
                                                 fraction=0.75)]
    text = bench._report(rows, Namespace(workloads=["gsm8k"], slots=["12"]))
    table, apart = text.split("Acceptance oracle*", 1)
    assert "SpecFit + cache" in table  # the methods' table, without the oracle in it
    assert apart.split()[0] == "16.0" and "without its look-ahead" in apart
    assert "SpecFit / acceptance oracle (decode tok/s; the oracle's without its look-ahead): 75%" in apart
    assert "[gsm8k] emulated link, by slots: 12: 75%" in text
    assert "acceptance-oracle" in harness.METHODS and "acceptance-oracle" not in harness.PAPER_METHODS


def test_prompt_lookup_is_a_method_with_its_own_generate_keywords():
    method = harness.METHODS["prompt-lookup"]
    assert method.assistant is None and dict(method.generate) == {"prompt_lookup_num_tokens": 10}
    assert harness.GENERATE["prompt-lookup"] == {"prompt_lookup_num_tokens": 10} and harness.GENERATE["ar"] == {}


def test_prompt_lookup_runs_on_an_offloaded_model_and_leaves_its_own_figures():
    import torch
    from conftest import tiny_moe

    import specfit

    model = specfit.enable(tiny_moe(), cache_slots=4)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]])
    runs = harness.interleave({"ar": model, "prompt-lookup": model}, [ids], 12, warmup_tokens=0)
    assert torch.equal(runs.outputs["ar"][0], runs.outputs["prompt-lookup"][0])  # lossless
    assert model.specfit.stats.last_method == "prompt_lookup" and runs.counters["prompt-lookup"].new_tokens == 12
