"""The bench's regime map and its prompt-lookup row, on synthetic figures and on the harness's method table."""

import pytest

from specfit.evaluation import bench, harness


def cells():
    out = []
    for ratio in (0.0, 1.0):
        for slots in (6, 64):
            slow_ar = 1.0 + ratio * (64 - slots) / 64  # copies cost AR more where the link is dear and slots few
            out.append(dict(link_ratio=ratio, slots=slots, workload="gsm8k", prompts=2,
                            tok_s={"ar": 10 / slow_ar, "eagle3": 9.0, "specfit": 12.0, "prompt-lookup": 10.0}))
    return out


def test_the_map_report_gives_specfit_over_each_baseline_per_cell():
    text = bench._map_report(cells())
    assert "[gsm8k] SpecFit / AR" in text and "[gsm8k] SpecFit / EAGLE-3 + cache" in text
    assert "[gsm8k] SpecFit / Prompt lookup (10)" in text
    rows = text.split("[gsm8k] SpecFit / AR")[1].splitlines()
    assert rows[2].split() == ["0", "1.20", "1.20"] and rows[3].split() == ["1", "2.29", "1.20"]


def test_the_map_is_drawn_as_heat_maps(tmp_path):
    pytest.importorskip("matplotlib")
    bench._plot_map(cells(), tmp_path / "regime_map.png")
    assert (tmp_path / "regime_map.png").stat().st_size > 10_000


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
