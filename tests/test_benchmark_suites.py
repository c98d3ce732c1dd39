"""``python benchmarks/run.py SUITE``: every suite runs here at tiny settings (what BENCHMARKS.md's commands run, made
small), bad options are refused before any model loads, and every command BENCHMARKS.md and README.md print parses
under its suite (tests/test_benchmark_parts.py and tests/test_serve_command.py run the instruments' own parts)."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402
import run  # noqa: E402

from specfit.evaluation import datasets  # noqa: E402


def needs_data():
    try:
        datasets.prompts("gsm8k", 1)
    except datasets.DataUnavailable as err:
        pytest.skip(f"GSM8K is not reachable (no local data folder and no hub): {err}")


def suite(argv, tmp_path, capsys):
    """Run a timed suite in this process; (its results.json, what it printed)."""
    assert run.main([*argv, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    return json.loads((tmp_path / "results.json").read_text()), printed


def test_the_readme_question_on_your_prompts(tmp_path):
    """README's one command (``speed --prompts FILE``), as typed, tokens cut short: batch 1 and 4 by default, the
    three methods, greedy rows identical, tok/s from each method's own output, labelled as a CPU run."""
    prompts = tmp_path / "my_prompts.txt"
    prompts.write_text("A farmer has 3 cows and buys 2 more. How many cows?\n\nWrite a haiku about the sea.\n"
                       "Name three primes.\nWhat is 12 times 7?\nSay hello.\n")
    done = subprocess.run([sys.executable, "benchmarks/run.py", "speed", "--prompts", str(prompts), "--tokens", "4",
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("CPU, embedded model, emulated default link") and "not GPU speed" in done.stdout
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    cells = report["cells"]
    assert [c["batch"] for c in cells] == [1, 4] and {c["workload"] for c in cells} == {"my_prompts.txt"}
    assert [c["groups"] for c in cells] == [5, 2]  # every prompt of the file (blank lines skipped), in calls of B
    for c in cells:
        assert set(c["tok_s"]) == {"ar", "eagle3", "specfit"} and min(c["tok_s"].values()) > 0
        assert c["specfit_vs_plain"] == pytest.approx(c["tok_s"]["specfit"] / c["tok_s"]["ar"])
        assert c["specfit_vs_best"] == pytest.approx(c["tok_s"]["specfit"] / max(c["tok_s"]["ar"],
                                                                                 c["tok_s"]["eagle3"]))
        assert sum(c["ways"].values()) > 0  # SpecFit's cycles, by the way each ran


def test_batch_suite_counts_rows_and_ways(tmp_path, capsys):
    needs_data()
    report, printed = suite(["batch", "--workloads", "gsm8k", "--batches", "2", "--groups", "1", "--tokens", "5"],
                            tmp_path, capsys)
    (c,) = report["cells"]
    assert (c["workload"], c["batch"], c["slots"], c["lane"], c["groups"]) == ("gsm8k", 2, 12, "host", 1)
    assert set(c["ways"]) == {"specfit", "eagle3", "plain"} and c["nodes_per_row_cycle"]["eagle3"] > 0
    assert re.search(r"^gsm8k\s+2\s+12 host", printed, re.M), printed


def test_lane_and_regimes_cells(tmp_path, capsys):
    """The lane suite's ar-copy method copies every cold expert (none on the host), the regimes suite's link
    column (0: no link, so no lane either)."""
    needs_data()
    report, _ = suite(["lane", "--workloads", "gsm8k", "--slots", "12", "--groups", "1", "--tokens", "4",
                       "--methods", "ar-copy", "ar"], tmp_path / "lane", capsys)
    (c,) = report["cells"]
    assert c["cold_per_token"]["ar-copy"] > 0 and set(c["tok_s"]) == {"ar-copy", "ar"}
    assert c["specfit_vs_plain"] is None  # no SpecFit in the run: no ratio made up
    report, printed = suite(["regimes", "--workloads", "gsm8k", "--slots", "12", "--links", "0", "2", "--groups", "1",
                             "--tokens", "4", "--methods", "ar", "specfit"], tmp_path / "reg", capsys)
    assert [(c["link"] if "link" in c else 1.0, c["lane"]) for c in report["cells"]] == [(0.0, "copy"), (2.0, "host")]
    assert "link" in printed.splitlines()[1]


def test_forecast_suite_with_the_oracle_and_calibration(tmp_path, capsys):
    needs_data()
    report, printed = suite(["forecast", "--workloads", "gsm8k", "--slots", "12", "--groups", "1", "--tokens", "4",
                             "--methods", "ar", "specfit", "specfit-paper", "acceptance-oracle"], tmp_path, capsys)
    (c,) = report["cells"]
    assert c["forecast_over_real"] > 0 and c["acceptance"]["specfit"]["labels"] > 0
    assert "specfit: per-node ECE calibrated" in printed
    assert c["acceptance"]["specfit-paper"]["labels"] == 0 and "specfit-paper: no labelled children" in printed
    assert c["tok_s_excl_measurement"]["acceptance-oracle"] > c["tok_s"]["acceptance-oracle"]


def test_fp8_suite_checks_against_transformers(tmp_path, capsys):
    needs_data()
    report, _ = suite(["fp8", "--workloads", "gsm8k", "--groups", "1", "--tokens", "3", "--methods", "specfit-bf16",
                       "specfit"], tmp_path, capsys)
    (c,) = report["cells"]
    assert c["fp8"] is True and set(c["tok_s"]) == {"specfit-bf16", "specfit"}


def test_a_lossless_break_names_the_cell():
    cell = harness.Cell("gsm8k", 2, 12, "host")
    same, other = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])
    harness.check_lossless(cell, 0, {"ar": same, "specfit": same.clone()}, None, None, None, 1)
    with pytest.raises(AssertionError, match=r"gsm8k, batch 2, 12 slots, lane host, batch call 3: greedy rows of "
                                             r"specfit differ from ar's"):
        harness.check_lossless(cell, 3, {"ar": same, "eagle3": same, "specfit": other}, None, None, None, 1)


def test_padding_is_no_token():
    """A row that ended early counts its tokens through its end token only (transformers pads the rest)."""
    from specfit.decoding.batch_rows import new_tokens

    class Config:
        eos_token_id = [9]

    out = torch.tensor([[5, 5, 1, 9, 0, 0], [5, 5, 1, 2, 3, 4]])  # prompt of 2, then 4 new tokens per row
    assert new_tokens(out, 2, Config()) == 2 + 4


@pytest.mark.parametrize("argv, says", [
    (["nosuch"], "no suite 'nosuch'"),
    (["speed", "--methods", "specfit", "magic"], "--methods magic: not a method"),
    (["speed", "--methods", "specfit-bf16"], "--methods specfit-bf16: not a method"),
    (["batch", "--batches", "0", "4"], "--batches 0 4: every value must be 1 or more"),
    (["speed", "--prompts", "no/such/file.txt"], "--prompts no/such/file.txt: no such file"),
    (["speed", "--drafter", "d"], "--drafter, --dtype and --link-ms go with --model"),
    (["lane", "--tokens", "0"], "groups and tokens must be 1 or more"),
])
def test_bad_options_are_named_before_any_load(argv, says, capsys, monkeypatch):
    import specfit.embedded

    monkeypatch.setattr(specfit.embedded, "load", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as stop:
        run.main(argv)
    assert stop.value.code not in (0, None)
    assert says in str(stop.value.code) + capsys.readouterr().err


def test_prompt_files_read_as_said(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("one\n\n  \ntwo\\nlines\n")
    assert harness.read_prompts(str(text)) == ["one", "two\nlines"]
    rows = tmp_path / "p.jsonl"
    rows.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(SystemExit, match='line 2 has no "prompt" string field'):
        harness.read_prompts(str(rows))


def commands(doc: str) -> list[list[str]]:
    """Every ``python benchmarks/run.py ...`` command a document shows (code spans and code blocks)."""
    text = (ROOT / doc).read_text()
    found = re.findall(r"python benchmarks/run\.py ([a-z][^`\n#]*)", text)  # a suite's name: lower case
    return [shlex.split(c.strip()) for c in found]


@pytest.mark.parametrize("doc", ["BENCHMARKS.md", "README.md", "docs/batch.md"])
def test_every_command_shown_parses(doc):
    """The commands the documents print name a suite, and a timed suite's options all parse (its defaults apply)."""
    shown = commands(doc)
    assert shown, f"{doc} shows no benchmark command"
    for argv in shown:
        assert argv[0] in {*run.GRIDS, *run.SUITES}, argv
        if argv[0] in run.GRIDS:
            p = run.grid_parser(argv[0])
            args = p.parse_args(argv[1:])
            args.prompts = args.prompts and str(ROOT / "README.md")  # the user's file: any file that exists
            run.check(p, args)


def test_every_suite_has_its_instrument():
    for name, (module, what) in run.SUITES.items():
        if module is not None:
            assert (ROOT / "benchmarks" / f"{module}.py").is_file(), name
    assert len(list((ROOT / "benchmarks").glob("*.py"))) <= 12


def test_syncs_and_profile(tmp_path, capsys):
    """The would-be host syncs and the cycle profile at tiny settings: every part non-negative, the parts (with
    'other') the cycle; each method's tokens checked against AR's by the profile itself."""
    needs_data()
    assert run.main(["syncs", "--tokens", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [s.split(":")[0] for s in lines] == ["AR", "eagle3", "specfit"]
    assert all(re.search(r"\d+\.\d syncs/token", s) for s in lines)
    assert run.main(["profile", "--prompts", "2", "--max-new-tokens", "6", "--methods", "ar", "specfit",
                     "--eagle3-depth", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "profile.json").read_text())["result"]
    for method, r in result.items():
        parts = r["parts_ms"]
        assert sum(parts.values()) == pytest.approx(r["cycle_ms"], rel=1e-9)
        assert all(v >= 0 for k, v in parts.items() if not k.startswith("other")), (method, parts)
    assert result["ar"]["tokens_per_cycle"] == 1 and result["eagle3-depth2"]["levels_per_cycle"] == 2


def test_cache_suite_smoke(tmp_path):
    needs_data()
    assert run.main(["cache", "--smoke", "--out", str(tmp_path)]) in (0, None)
    report = json.loads((tmp_path / "results.json").read_text())
    assert report  # the replay and the clock, written


def test_the_grid_runs_every_cell_once_in_order():
    """A timed suite's cells: every combination of its options, batch sizes innermost, a cell without a link on the
    copy lane (the lane is scaled to the link), duplicates run once."""
    from argparse import Namespace

    args = Namespace(prompts=None, workloads=["gsm8k", "cnn"], batches=[1, 4], slots=[12], lanes=["host", "copy"],
                     links=[0.0, 1.0], policies=None, threads=[1, 2])
    cells = harness.cells(args)
    assert len(cells) == 2 * 2 * 2 * 2 * 2 - 8  # a cell with no link has the copy lane only: 8 of them fold away
    assert [c.batch for c in cells[:2]] == [1, 4] and cells[0] == harness.Cell("gsm8k", 1, 12, "copy", 0.0, None, 1)
    assert {c.threads for c in cells} == {1, 2} and {(c.link, c.lane) for c in cells} == {
        (0.0, "copy"), (1.0, "host"), (1.0, "copy")}
    args.prompts = "my/prompts.txt"
    assert {c.workload for c in harness.cells(args)} == {"prompts.txt"}


def test_a_model_of_yours_on_a_cpu_says_what_it_emulates(tmp_path, capsys):
    """``--model FOLDER --drafter FOLDER --link-ms N`` (the shipped model's folders stand in for yours): loaded
    through specfit.from_pretrained, its own tokenizer, the link emulated at N ms per copy, and the table says so."""
    embedded = ROOT / "src" / "specfit" / "embedded"
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is 12 times 7?\nName a prime.\n")
    report, printed = suite(["speed", "--model", str(embedded / "target"), "--drafter", str(embedded / "drafter"),
                             "--link-ms", "0.1", "--prompts", str(prompts), "--batches", "2", "--tokens", "3",
                             "--methods", "ar", "specfit"], tmp_path / "out", capsys)
    assert printed.splitlines()[0] == (f"CPU, {embedded / 'target'}, emulated link, 0.1 ms per expert copy: "
                                       f"not GPU speed")
    (c,) = report["cells"]
    assert c["model"] == str(embedded / "target") and c["groups"] == 1 and min(c["tok_s"].values()) > 0
