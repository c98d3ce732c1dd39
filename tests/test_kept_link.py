"""The kept link is a measurement a user can trust (issue 53, item 1; issue 54, "the lane and the kept link"): each
part of a forward timed at its fastest, so a busy moment does not decide it; kept per machine, thread count and
weights, other entries untouched; measured again (and replaced, said so) by ``specfit calibrate``; the messages say
where it is kept and how to measure it again. And the suite itself keeps what it writes in a cache of its own."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import SESSION_CACHE, snapshot, tiny_moe, written

from specfit import embedded
from specfit.embedded import link_store

needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")
IDS = torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(3))


def busy(model, every: int = 4, seconds: float = 0.004):
    """A machine busy most of the time: in each forward, all but one MoE block in ``every`` wait ``seconds`` (a
    core taken by another process), a different block spared each forward, so every block has clean runs."""
    blocks = [layer.mlp for layer in model.model.layers]
    calls = [0]

    def slowed(i, forward):
        def run(*args, **kwargs):
            if i == 0:
                calls[0] += 1
            if (calls[0] + i) % every:
                time.sleep(seconds)
            return forward(*args, **kwargs)
        return run

    for i, block in enumerate(blocks):
        block.forward = slowed(i, block.forward)


def whole_forward_median(model, n: int = 8) -> float:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    times = []
    with torch.no_grad():
        model(IDS, cache=cache, use_cache=True)
        for _ in range(n):
            t0 = time.perf_counter()
            model(IDS[:, -1:], cache=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-1)
    return sorted(times)[n // 2]


def test_a_busy_moment_does_not_decide_the_measurement():
    """Whole forwards run 4 x 4 ms slower here; the forward's parts, each at its fastest, read as on a quiet
    machine (the old rule, the fastest of rounds of whole forwards, read the busy figure)."""
    model = tiny_moe()
    quiet = embedded.fastest_forward_seconds(model, IDS)
    busy(model)
    disturbed = embedded.fastest_forward_seconds(model, IDS)
    assert whole_forward_median(model) > quiet + 0.010  # what a whole-forward timing reads now
    assert disturbed < quiet * 1.5 + 0.001, (quiet, disturbed)


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Timed(torch.nn.Module):
    """A decoder whose parts take known times: layer i ``layer_seconds[i]``, the rest (embeddings, head)
    ``rest_seconds``; ``hit(forward, part)`` adds 3 ms to a part of a forward (a busy moment)."""

    def __init__(self, layer_seconds, rest_seconds, hit=lambda forward, part: False):
        super().__init__()
        self.config = tiny_moe().config
        self.calls = 0
        outer = self

        class Layer(torch.nn.Module):
            def __init__(self, i):
                super().__init__()
                self.i = i

            def forward(self, x):
                spin(layer_seconds[self.i] + (3e-3 if hit(outer.calls, self.i) else 0.0))
                return x

        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(Layer(i) for i in range(len(layer_seconds)))
        self.rest_seconds, self.hit = rest_seconds, hit

    def forward(self, ids, cache=None, use_cache=True):
        self.calls += 1
        spin(self.rest_seconds + (3e-3 if self.hit(self.calls, -1) else 0.0))
        x = ids
        for layer in self.model.layers:
            x = layer(x)
        return x


def test_the_parts_add_up_to_a_forward_and_each_is_taken_at_its_fastest():
    layers, rest = [1e-3, 2e-3, 1.5e-3], 2.5e-3
    quiet = embedded.fastest_forward_seconds(Timed(layers, rest), IDS, forwards=12)
    assert quiet == pytest.approx(sum(layers) + rest, rel=0.2)  # every layer once, and the rest
    # busy: every forward has a part 3 ms slower, a different part each time, the rest included
    hit = lambda forward, part: part == (forward % 4) - 1  # noqa: E731
    busy = embedded.fastest_forward_seconds(Timed(layers, rest, hit), IDS, forwards=12)
    assert busy == pytest.approx(sum(layers) + rest, rel=0.2), busy


def test_every_part_counts_once():
    """The sum of the parts is a forward: not a layer left out, none counted twice (a model of twice the layers
    takes about twice as long), and the hooks are gone afterwards."""
    one, two = tiny_moe(num_hidden_layers=4), tiny_moe(num_hidden_layers=8)
    small, large = (min(embedded.fastest_forward_seconds(m, IDS) for _ in range(3)) for m in (one, two))
    assert 1.4 < large / small < 2.6, (small, large)
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in two.model.layers)


def test_keeping_one_entry_keeps_the_others(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    link_store.write("machine A", 2e-4, 0.030)
    link_store.write("machine B", 3e-4, 0.045)
    link_store.write("machine A", 2.2e-4, 0.033)  # measured again: replaces A's only
    assert link_store.read("machine A") == (2.2e-4, 0.033) and link_store.read("machine B") == (3e-4, 0.045)
    assert link_store.read_entry("machine B")["measured"][:2] == "20"  # when, for the header
    assert sorted(json.loads(link_store.path().read_text())) == ["machine A", "machine B"]
    assert [p.name for p in tmp_path.iterdir()] == [link_store.FILE_NAME]  # no scratch file left


def test_an_unwritable_cache_is_said_and_the_run_keeps_its_value(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("in the way")
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.warns(UserWarning, match="could not be kept in .*SPECFIT_CACHE"):
        link_store.write("machine A", 2e-4, 0.030)
    assert link_store.read("machine A") is None


@needs_embedded
def test_a_model_of_another_size_measures_its_own_link(monkeypatch, tmp_path):
    """The key holds the weights' size: a retrained model of another size never borrows the first one's link."""
    model, tokenizer = embedded.load(64, drafter=False)
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "load", lambda *a, **k: (model, tokenizer))
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.030)
    first = embedded.default_link_seconds()
    other = tmp_path / "bigger"
    other.mkdir()
    (other / "config.json").write_text((embedded.TARGET_DIR / "config.json").read_text())
    (other / "model.safetensors").write_bytes(b"0" * ((embedded.TARGET_DIR / "model.safetensors").stat().st_size + 1))
    monkeypatch.setattr(embedded, "TARGET_DIR", other)
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.060)
    assert embedded.default_link_seconds() == pytest.approx(2 * first)  # measured for it, not read
    assert len(json.loads(link_store.path().read_text())) == 2  # both kept


@needs_embedded
def test_calibrate_replaces_the_kept_link_and_says_what_it_was(monkeypatch, tmp_path, capsys):
    from specfit import cli
    from specfit.evaluation import calibrate

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.040)
    embedded.default_link_seconds()  # kept by an earlier run
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.050)

    def load(args):
        raise RuntimeError("the probes would run from here")

    monkeypatch.setattr(calibrate, "_load", load)
    with pytest.raises(RuntimeError, match="the probes"):
        calibrate.main(cli.command_parser("calibrate").parse_args(["--prompts", "random", "--threads", "1"]))
    said = capsys.readouterr().out
    assert "one token's compute 50.00 ms; it was 0.292 ms, +25%" in said, said
    assert f"kept in {tmp_path / link_store.FILE_NAME}" in said
    monkeypatch.setattr(embedded, "_link", {})
    assert embedded.token_compute_seconds() == 0.050  # the next run reads the new figure


@needs_embedded
def test_the_header_says_where_the_link_is_kept_and_how_to_measure_it_again(monkeypatch, tmp_path):
    from specfit.evaluation.harness import link_seconds

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "_link", {})
    monkeypatch.setattr(embedded, "fastest_forward_seconds", lambda model, ids: 0.031)
    assert not embedded.default_link_known()
    _, how = link_seconds(None)
    assert embedded.default_link_known()
    assert "31.00 ms, measured 20" in how and str(tmp_path / link_store.FILE_NAME) in how
    assert "`specfit calibrate` measures it again" in how


def test_the_suite_keeps_its_writes_in_a_cache_of_its_own():
    """tests/conftest.py: the run's cache is a temporary folder, shared by the xdist workers (they inherit it: a
    worker that made its own would not see the first process's), never the user's."""
    assert Path(os.environ["SPECFIT_CACHE"]) == SESSION_CACHE and SESSION_CACHE.name.startswith("specfit-tests-cache")
    assert SESSION_CACHE != Path(os.environ["SPECFIT_TESTS_USER_CACHE"])
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import conftest

        assert not conftest.FIRST_PROCESS  # the controller made the folder before it started this worker


def test_the_watch_sees_a_file_appear_or_change(tmp_path):
    before = snapshot([tmp_path])
    (tmp_path / "a.json").write_text("{}")
    after = snapshot([tmp_path])
    assert written(before, after) == [str(tmp_path / "a.json")]
    os.utime(tmp_path / "a.json", ns=(1, 1))
    assert written(after, snapshot([tmp_path])) == [str(tmp_path / "a.json")]
    assert written(after, after) == []
