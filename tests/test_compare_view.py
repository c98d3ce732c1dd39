"""``specfit.compare`` shows progress, and its table and plot carry the spread over prompts and say what ran (issue
53, item 5): each call's tok/s is its own new tokens over its own wall clock, the spread their standard deviation,
the plot's error bars that spread and its title the configuration."""

import statistics
from types import SimpleNamespace

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.evaluation import comparison, harness

PROMPTS = [torch.randint(2, 256, (1, 7 + i), generator=torch.Generator().manual_seed(i)) for i in range(3)]


@pytest.fixture
def model():
    m = tiny_moe()
    return specfit.enable(m, cache_slots=4, drafter=SelfDrafter(m, first_token=int(PROMPTS[0][0, 0]), noise=0.3))


class Clock:
    """harness's clock: generate() call n takes ``seconds[n]``."""

    def __init__(self, seconds):
        self.seconds, self.t, self.reads = list(seconds), 0.0, 0

    def perf_counter(self):
        if self.reads % 2:
            self.t += self.seconds[self.reads // 2]
        self.reads += 1
        return self.t


def test_each_calls_tok_s_and_their_spread(model, monkeypatch):
    seconds = [1.0, 2.0, 4.0, 0.5, 1.0, 2.0, 0.25, 0.5, 1.0]  # prompt by prompt: AR, EAGLE-3, SpecFit
    monkeypatch.setattr(harness, "time", SimpleNamespace(perf_counter=Clock(seconds).perf_counter))
    tokens = {m: [] for m in ("ar", "eagle3", "specfit")}
    original = model.generate

    def generate(*args, **kwargs):
        out = original(*args, **kwargs)
        tokens[kwargs.get("assistant") or "ar"].append(model.specfit.stats.last_generate.new_tokens)
        return out

    monkeypatch.setattr(model, "generate", generate)
    result = comparison.run(model, None, PROMPTS, max_new_tokens=5, warmup=False)
    for j, m in enumerate(("ar", "eagle3", "specfit")):
        expected = [tokens[m][i] / seconds[3 * i + j] for i in range(3)]
        assert result.per_prompt[m] == pytest.approx(expected)
        row = next(r for r in result.rows() if r["method"] == m)
        assert row["tok_s_spread"] == round(statistics.stdev(expected), 1)
        assert row["tok_s"] == round(sum(tokens[m]) / sum(seconds[j::3]), 1)
    monkeypatch.setattr(harness, "time", SimpleNamespace(perf_counter=Clock([1.0] * 3).perf_counter))
    one = comparison.run(model, None, PROMPTS[:1], max_new_tokens=5, warmup=False)
    assert all(r["tok_s_spread"] is None for r in one.rows())  # one prompt: no spread


def test_compare_shows_its_progress_unless_told_not_to(model, capsys):
    specfit.compare(model, None, PROMPTS[:2], max_new_tokens=3, warmup=False, as_frame=False)
    err = capsys.readouterr().err
    assert "specfit.compare" in err and "2/2" in err and "tok/s" in err
    specfit.compare(model, None, PROMPTS[:2], max_new_tokens=3, warmup=False, as_frame=False, progress=False)
    assert capsys.readouterr().err == ""


def test_the_plot_has_a_title_and_the_spread(model):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.close("all")
    specfit.compare(model, None, PROMPTS, max_new_tokens=4, warmup=False, plot=True, progress=False)
    figure = plt.gcf()
    title = figure._suptitle.get_text()
    assert title.startswith("specfit.compare: 3 prompts; 4 slots of 16 per layer") and "CPU (not GPU speed)" in title
    speed = figure.axes[0]
    bars = [c for c in speed.containers if isinstance(c, matplotlib.container.BarContainer)]
    assert bars and bars[0].errorbar is not None  # the spread as error bars
    assert "standard deviation over prompts" in speed.get_title()
    plt.close("all")
    specfit.compare(model, None, PROMPTS[:1], max_new_tokens=4, warmup=False, plot=True, progress=False)
    assert "1 prompt: no spread to show" in plt.gcf().axes[0].get_title()
    plt.close("all")
