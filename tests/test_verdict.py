"""The demo's verdict line: SpecFit against the best other method, with the prompt-to-prompt spread of the run."""

import pytest

from specfit.evaluation.verdict import verdict


def test_the_best_other_method_and_the_spread():
    line = verdict({"ar": [10, 10, 10, 10], "eagle3": [20, 22, 18, 20], "specfit": [23, 24, 21, 24]})
    assert line == "SpecFit +15% over EAGLE-3 (spread +-5%, 4 prompts)"


def test_a_gain_inside_the_spread_is_not_called_a_difference():
    line = verdict({"eagle3": [20, 20, 20], "specfit": [16, 25, 22]})
    assert line.startswith("SpecFit +5% over EAGLE-3 (spread +-23%, 3 prompts)") and "not a clear difference" in line


def test_one_prompt_has_no_spread_and_bad_input_is_refused():
    assert "1 prompt: no spread" in verdict({"ar": [5.0], "specfit": [6.0]})
    with pytest.raises(ValueError, match="same prompts"):
        verdict({"ar": [5.0, 4.0], "specfit": [6.0]})
    with pytest.raises(ValueError, match="at least one other method"):
        verdict({"specfit": [6.0]})


def test_a_loss_that_rounds_to_nothing_reads_plus_zero_not_minus_zero():
    line = verdict({"eagle3": [100.0, 100.0], "specfit": [99.6, 99.6]})  # -0.4%
    assert line.startswith("SpecFit +0% over EAGLE-3 (spread under 1%, 2 prompts)"), line
    assert verdict({"eagle3": [100.0], "specfit": [94.0]}).startswith("SpecFit -6% over EAGLE-3")
