"""Ctrl-C in a long command (issue 53, item 5) keeps what was done and says so in one line, with no traceback:
``specfit.compare`` returns the prompts every method finished, ``specfit demo`` prints their tables, ``specfit bench``
writes the finished cells to results.json, ``specfit calibrate`` installs nothing half-fitted. A real SIGINT to a
``specfit demo`` process, too."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit import cli, embedded
from specfit.evaluation import comparison, datasets

needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")
PROMPTS = [torch.randint(2, 256, (1, 7 + i), generator=torch.Generator().manual_seed(i)) for i in range(3)]


@pytest.fixture
def model():
    m = tiny_moe()
    return specfit.enable(m, cache_slots=4, drafter=SelfDrafter(m, first_token=int(PROMPTS[0][0, 0]), noise=0.3))


def stop_after(monkeypatch, prompts_done: int):
    """Ctrl-C right after every method finished ``prompts_done`` prompts (0: during the first)."""
    real = comparison.interleave

    def interleave(*args, on_prompt=None, **kwargs):
        def done(i):
            on_prompt(i)
            if i + 1 == prompts_done:
                raise KeyboardInterrupt
        if prompts_done == 0:
            raise KeyboardInterrupt
        return real(*args, on_prompt=done, **kwargs)

    monkeypatch.setattr(comparison, "interleave", interleave)


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # tqdm's bars aside
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_compare_returns_the_prompts_every_method_finished(model, monkeypatch, capsys):
    stop_after(monkeypatch, 2)
    rows = specfit.compare(model, None, PROMPTS, max_new_tokens=5, warmup=False, as_frame=False, progress=False)
    assert [r["prompts"] for r in rows] == [2, 2, 2] and all(r["new_tokens"] == 10 for r in rows)
    said = one_line(capsys.readouterr().err)
    assert said == ("specfit.compare: interrupted (Ctrl-C) after 2 of 3 prompts measured by every method: the table "
                    "holds those 2")


def test_compare_with_nothing_finished_lets_the_interrupt_go_on(model, monkeypatch):
    stop_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        specfit.compare(model, None, PROMPTS, max_new_tokens=5, warmup=False, as_frame=False, progress=False)


def test_an_interrupted_comparison_keeps_only_whole_prompts(model, monkeypatch):
    """Ctrl-C in the middle of a prompt (one method done with it, not the next): that prompt counts for none."""
    calls = []
    original = model.generate

    def generate(*args, **kwargs):
        calls.append(kwargs.get("assistant"))
        if len(calls) == 5:  # prompt 2's second method
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    with pytest.raises(comparison.Interrupted) as stop:
        comparison.run(model, None, PROMPTS, max_new_tokens=5, warmup=False)
    partial = stop.value.partial
    assert partial.prompts == 1 and partial.interrupted and partial.total == 3
    assert all(len(out) == 1 for out in partial.outputs.values())
    assert all(c.new_tokens == 5 for c in partial.counters.values())


@needs_embedded
def test_demo_prints_the_tables_of_what_finished_and_one_line(monkeypatch, capsys):
    stop_after(monkeypatch, 1)
    code = cli.main(["demo", "--num-prompts", "2", "--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert code == 130
    said = one_line(err)
    assert said.startswith("specfit demo: interrupted (Ctrl-C): [GSM8K] after 1 of 2 prompts measured by every "
                           "method") and "the tables above hold" in said
    assert "[GSM8K] 12 slots of 64" in out and "1 of 2 prompts (interrupted)" in out
    assert "  GSM8K: SpecFit" in out and "CNN/DailyMail: SpecFit" not in out  # the workload never started: no verdict


@needs_embedded
@pytest.mark.skipif(datasets.data_dir() is None, reason="bench reads its prompts from the local data folder")
def test_bench_writes_the_cells_that_finished(monkeypatch, tmp_path, capsys):
    from specfit.evaluation import bench

    real, cells = bench.side_by_side, []

    def side_by_side(*args, **kwargs):
        if cells:
            raise KeyboardInterrupt
        cells.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "side_by_side", side_by_side)
    code = cli.main(["bench", "--quick", "--max-new-tokens", "4", "--gsm8k-prompts", "2", "--cnn-prompts", "2",
                     "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 130
    assert one_line(err) == (f"specfit bench: interrupted (Ctrl-C): after 1 of 2 cells of the table; the rows of the "
                             f"cells finished are in {tmp_path / 'results.json'}")
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["interrupted"] and {r["workload"] for r in result["rows"]} == {"cnn"}
    assert sorted(r["method"] for r in result["rows"]) == ["ar", "eagle3", "specfit"]


def test_calibrate_installs_nothing_half_fitted(monkeypatch, tmp_path, capsys):
    from specfit.evaluation import calibrate

    def load(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate, "_load", load)
    out = tmp_path / "profile.json"
    code = cli.main(["calibrate", "--model", str(embedded.TARGET_DIR), "--prompts", "random", "--out", str(out)])
    assert code == 130 and not out.exists()
    assert one_line(capsys.readouterr().err) == (f"specfit calibrate: interrupted (Ctrl-C): before the fit: no profile "
                                                 f"installed ({out} unchanged)")


@needs_embedded
@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_a_real_sigint_stops_the_demo_in_one_line(tmp_path):
    """What a user's Ctrl-C sends: SIGINT to the process, here once the first prompt's line is out."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # SIGINT's default action in the child: an xdist worker ignores SIGINT, and a child inherits an ignored signal
    proc = subprocess.Popen([sys.executable, "-m", "specfit.cli", "demo", "--max-new-tokens", "16",
                             "--prompt", "Question: What is 7 times 8?\nAnswer:", "--prompt", "Article: Rain.\n"
                             "Summary:", "--prompt", "Question: 2 + 2?\nAnswer:"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "prompt 1 of 3" in line:
            proc.send_signal(signal.SIGINT)
            break
    out = "".join(seen) + proc.stdout.read()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, err[-2000:]
    said = one_line(err)
    assert said.startswith("specfit demo: interrupted (Ctrl-C)"), said
    assert "prompt 1 of 3" in out
