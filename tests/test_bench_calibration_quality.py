"""The calibration and quality suites (``python benchmarks/run.py calibration|quality PART``): every part through its
``main`` at tiny settings on the embedded model, checked on what it prints and writes; one bad value per part refused
by name before any weight loads."""

import json
import math
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

from specfit import embedded
from specfit.evaluation import datasets
from specfit.evaluation import acceptance_tables
from specfit.evaluation.reliability import ece, replay as replay_cycles
from specfit.selection.acceptance_model import AcceptanceModel, AcceptanceTables

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import calibrating as calibration  # noqa: E402  (benchmarks/calibrating.py)
import quality  # noqa: E402

pytestmark = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")


def needs_data(*readers):
    """Skip where the held-out test prompts (or what ``readers`` read) cannot be had."""
    try:
        datasets.prompts("gsm8k", 101)
        for read in readers:
            read()
    except datasets.DataUnavailable as err:
        pytest.skip(f"GSM8K / CNN-DailyMail are not reachable (no local data folder and no hub): {err}")


@pytest.fixture
def no_load(monkeypatch):
    """A part that loads a model fails the test: bad values are refused before."""
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad value was refused")

    monkeypatch.setattr(embedded, "load", load)


def refused(main, argv, capsys) -> str:
    """What ``main(argv)`` printed when it refused (argparse's exit status 2)."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    return capsys.readouterr().err


def busy_children() -> list[int]:
    """Processes of ours still running a busy loop."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid() and \
                    b"while True" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_refresh_forecasts_from_the_shipped_profile_and_after_a_load_change(tmp_path, capsys, monkeypatch):
    needs_data()
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "user-cache"))  # refresh points it elsewhere: restored after
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its empty cache made here
    cpus = os.sched_getaffinity(0)
    try:
        assert calibration.main(["refresh", "--prompts", "2", "--tokens", "6", "--load-after", "1",
                                 "--out", str(tmp_path / "out")]) == 0
    finally:
        os.sched_setaffinity(0, cpus)
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["prompts"] == 2 and result["load_after"] == 1 and result["wall_s"] > 0
    assert busy_children() == []  # the busy process is gone
    assert [p.name for p in tmp_path.glob("specfit-empty-cache-*")]  # the empty cache, not the user's
    for name, r in result["models"].items():
        assert r["cost_profile"].startswith("the reference profile shipped with specfit")
        assert ("refreshed online" if name == "refreshed" else "frozen") in r["cost_profile"]
        start, change = r["from_start"], r["from_change"]
        assert sum(n for _, n in start.values()) == r["cycles"] >= 2
        assert 0 < sum(n for _, n in change.values()) < r["cycles"]  # from the second prompt on
        assert start["0-10"][1] == min(10, r["cycles"]) and 0.05 < start["0-10"][0] < 20
        assert all((v is None) == (n == 0) for v, n in [*start.values(), *change.values()])
    assert "busy process from prompt 1" in printed and "not GPU speed" in printed
    assert printed.count("forecast/real from the change") == 2 and printed.rstrip().endswith("results.json")


def test_counterfactual_cell_joins_what_was_forecast_with_what_happened(tmp_path, capsys):
    needs_data()
    assert calibration.main(["counterfactual", "--cells", "gsm8k:12", "--prompts", "1", "--tokens", "6",
                             "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    [cell] = json.loads((tmp_path / "counterfactual.json").read_text())
    assert cell["cell"] == {"workload": "gsm8k", "slots": 12, "ratio": 1.4, "sample": False, "name": "gsm8k:12"}
    rows, own = cell["rows"], cell["summary"]["eagle3_itself"]
    assert rows and all("seconds" in r and "tokens" in r and "parents" not in r for r in rows)  # joined, no pools
    assert 1 <= sum(r["tokens"] for r in rows) <= 6  # the timed prompt's tokens only: the warm-up left out
    assert 1 <= own["cycles"] <= 6 and own["tok_s"] > 0 and own["draft_ms"] > 0
    assert own["tokens_per_cycle"] == pytest.approx(own["tok_s"] * own["ms_per_cycle"] / 1e3)
    assert any(f"{key}_tokens" in r for r in rows if r["kind"] == "eagle3" for key in ("sf", "full", "tp"))  # greedy
    default = embedded.link_seconds_per_expert(embedded.default_link()) * 1e3  # 1.4: the structural default link
    assert "gsm8k:12 (1 prompts x 6 tokens" in printed and f"link {default:.3f} ms/copy; CPU, emulated" in printed
    assert "EAGLE-3 itself (its own drafting" in printed and "not GPU speed" in printed


def test_acceptance_streams_recorded_then_replayed(tmp_path, capsys, monkeypatch):
    needs_data(lambda: datasets.gsm8k("train", 101), lambda: datasets.cnn_dailymail(1))
    path, read = tmp_path / "streams.json", []
    real = acceptance_tables.calibration_prompts
    monkeypatch.setattr(acceptance_tables, "calibration_prompts", lambda tok, n, texts: read.append(texts) or real(
        tok, n, texts))  # what the record reads, read as it is
    assert calibration.main(["acceptance", "record", "--prompts", "1", "--tokens", "6", "--out", str(path)]) == 0
    streams = json.loads(path.read_text())
    counts = {w: sum(len(c) for p in streams[w] for c in p) for w in ("gsm8k", "cnn")}
    assert f"{counts} labels; wrote {path}" in capsys.readouterr().out
    assert read == [[datasets.GSM8K_PROMPT.format(question=datasets.gsm8k("train", 101)[100]["question"])],
                    [datasets.CNN_PROMPT.format(article=datasets.cnn_dailymail()[-25]["article"][:1500])]]
    for prompts in streams.values():
        [cycles] = prompts  # one prompt per workload, its cycles in order
        assert len(cycles) >= 2 and all(c for c in cycles)  # EAGLE-3 labels children every cycle
        assert all(d >= 1 and r >= 1 and 0 <= q <= 1 and y in (0, 1) for c in cycles for d, r, q, y in c)
    assert calibration.main(["acceptance", "replay", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 5 * 4 and all(labels(s) == counts for s in lines)
    # one model per (prior, strength, decay), learning GSM8K first, then CNN/DailyMail
    model = AcceptanceModel(AcceptanceTables.default().greedy, 16, 0.95)
    want = [replay_cycles(model, (c for p in streams[w] for c in p)) for w in ("gsm8k", "cnn")]
    assert f"default   strength 16  decay 0.95  gsm8k {want[0]['ece']:.3f} (floor {want[0]['floor']:.3f}, " \
           f"{counts['gsm8k']} labels)  cnn {want[1]['ece']:.3f} (floor {want[1]['floor']:.3f}, " \
           f"{counts['cnn']} labels)" in lines
    assert calibration.main(["acceptance", "replay", str(path), "--sparse"]) == 0
    sparse = {w: sum(x[0] == 1 for c in streams[w][0][::3] for x in c) for w in streams}  # depth 1, every third cycle
    assert all(labels(s) == sparse for s in capsys.readouterr().out.splitlines()) and sparse != counts


def labels(line: str) -> dict:
    """Workload -> labels of one replay line."""
    return {w: int(n) for w, n in re.findall(r"(\w+) \S+ \(floor \S+, (\d+) labels\)", line)}


def test_near_ties_judges_each_method_against_plain_bf16(tmp_path, capsys, monkeypatch):
    needs_data()
    plain, loaded = transformers.AutoModelForCausalLM.from_pretrained, []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loaded.append(plain(*a, **k)) or loaded[-1])  # the reference, as loaded
    assert quality.main(["near-ties", "--slots", "6", "--gsm8k", "1", "--cnn", "0", "--tokens", "4",
                         "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["prompts"] == 1 and result["dtype"] == "bfloat16" and result["link"] is None
    assert result["noise_positions"] == 3 and result["noise_unit"] > 0  # positions after the first, per prompt
    assert set(result["near_tie_rate"]) == {"median noise", "p99 noise", "1 unit", "2 units"}
    assert [r["method"] for r in result["rows"]] == ["ar", "eagle3", "specfit"]
    for r in result["rows"]:
        assert r["slots"] == 6 and r["prompts"] == len(r["verdicts"]) == 1 and r["tokens_compared"] >= 1
        assert r["first_token_equal"] == 1 and r["ok"] == 1  # rounding only: within k noise units
        assert r["identical"] + r["divergences"] == 1 and r["max_deviation_units"] <= result["k"]
        assert f"    6 {r['method']:8s}   1/1" in printed
    assert "shape noise over 3 positions" in printed
    assert [(m.dtype, type(m).__name__, hasattr(m, "specfit")) for m in loaded] == [
        (torch.bfloat16, "Qwen3MoeForCausalLM", False)]  # plain transformers in bf16


def test_seeded_sampling_repeats_give_one_text(tmp_path, capsys):
    needs_data()
    assert quality.main(["seeded", "--prompts", "1", "--repeats", "2", "--tokens", "4", "--out", str(tmp_path)]) == 0
    [row] = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["repeats"] == 2 and row["distinct_texts"] == 1 and row["same_as_first"] == 2 and row["eagle3_same"]
    seen = row["labels_seen_after_each_call"]
    assert len(seen) == 2 and 0 < seen[0] < seen[1]  # the acceptance model learnt between the calls
    assert "2/2 calls gave the first call's text (1 distinct); EAGLE-3 same text: True" in capsys.readouterr().out


def test_soak_checks_every_greedy_call_and_reports_drift(tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert quality.main(["soak", "--calls", "6", "--threads-every", "2", "--gsm8k", "1", "--cnn", "1",
                         "--lengths", "4", "5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert printed.startswith(json.dumps(report, indent=1)) and f"wrote {out}" in printed
    assert report["calls"] == 6  # calls 2-5 in a burst of 4 threads
    assert report["greedy_calls"] == report["greedy_identical"] == sum(k % 7 != 3 for k in range(6))
    assert len(report["rss_mb_after_each_third"]) == 3 and min(report["rss_mb_after_each_third"]) > 50
    assert report["link"] == "emulated link, structural default" and report["link_ms"] > 0
    for key in ("ms_per_token_first_third", "ms_per_token_last_third", "median_ms_per_token"):
        assert 1 < report[key] < 10_000 and math.isfinite(report[key])


@pytest.mark.parametrize("main, argv, says", [
    (calibration.main, ["refresh", "--prompts", "2", "--load-after", "2"],
     "--load-after 2: the busy process starts before that prompt, so it must be below --prompts (2)"),
    (calibration.main, ["counterfactual", "--cells", "gsm8k:12", "gsm8k:64:0", "--host-ratio", "2.5"],
     "--host-ratio 2.5: the host lane is scaled to the link, and cell gsm8k:64:0 has none"),
    (calibration.main, ["counterfactual", "--cells", "gsm8k:12:1.4:greedy"],
     "argument --cells: a cell is workload:slots[:link ratio[:sample]]"),
    (calibration.main, ["acceptance", "record", "--tokens", "0"], "--tokens must be >= 1, got 0"),
    (quality.main, ["near-ties", "--tokens", "1"], "--tokens must be >= 2 (the shape noise is measured from the"),
    (quality.main, ["seeded", "--top-p", "0"], "--top-p 0.0 in (0, 1]"),
    (quality.main, ["soak", "--slots", "65"], "slots must be an integer from 1 to 64"),
])
def test_bad_values_are_refused_by_name_before_a_model_loads(main, argv, says, no_load, capsys):
    err = refused(main, argv, capsys)
    assert says in err and f"run.py {'calibration' if main is calibration.main else 'quality'} {argv[0]}" in err


def test_replay_refuses_a_file_record_did_not_write(tmp_path, capsys, no_load):
    (tmp_path / "x.json").write_text('{"gsm8k": []}')
    assert "x.json' is not a file `acceptance record` wrote" in refused(
        calibration.main, ["acceptance", "replay", str(tmp_path / "x.json")], capsys)


def test_the_commands_each_suite_shows_reach_their_part(monkeypatch):
    """Every command in a suite's help (its docstring) parses and reaches its part; --smoke is the small run said."""
    ran = []
    for module, parts in ((calibration, ("refresh", "counterfactual", "record", "replay")),
                          (quality, ("near_ties", "seeded", "soak"))):
        for name in parts:
            monkeypatch.setattr(module, name, lambda args, name=name: ran.append((name, vars(args))) or 0)
    for module in (calibration, quality):
        text = re.sub(r"\\\n\s*", "", module.__doc__)  # continued lines joined
        for command in re.findall(r"python benchmarks/run\.py (.*)", text):
            suite, *argv = shlex.split(re.sub(r"#.*|[\[\]]", "", command))
            assert {"calibration": "calibrating"}.get(suite, suite) == module.__name__ and module.main(argv) == 0
    assert [name for name, _ in ran] == ["refresh", "counterfactual", "record", "replay", "near_ties", "near_ties",
                                         "seeded", "soak"]
    smoke = [args for name, args in ran if args.get("smoke")]
    assert [(a["slots"], a["gsm8k"], a["cnn"], a["tokens"]) for a in smoke] == [([6], 1, 1, 24)]
    assert [(c["name"], c["slots"], c["ratio"], c["sample"]) for c in ran[1][1]["cells"]] == [
        ("gsm8k:12", 12, 1.4, False), ("cnn:12", 12, 1.4, False), ("gsm8k:24", 24, 1.4, False),
        ("cnn:24", 24, 1.4, False), ("gsm8k:64:0", 64, 0.0, False), ("gsm8k:12:1.4:sample", 12, 1.4, True)]
    assert ran[3][1]["sparse"] and ran[0][1]["cache"] is None
    quality.main(["seeded", "--smoke"])
    assert {k: ran[-1][1][k] for k in ("prompts", "repeats", "tokens")} == {"prompts": 1, "repeats": 3, "tokens": 12}


def test_replay_predicts_each_cycle_before_learning_it():
    class Counting:  # predicts the share of labels learnt so far that were 1, out of 10
        def __init__(self):
            self.learnt = []

        def predict(self, depth, rank, q):
            return sum(self.learnt) / 10

        def update(self, cycle):
            self.learnt += [y for *_, y in cycle]

    model = Counting()
    result = replay_cycles(model, [[(1, 1, 0.5, 1), (1, 2, 0.2, 0)], [], [(2, 1, 0.4, 1)]])
    assert model.learnt == [1, 0, 1] and result["labels"] == 3
    assert result["ece"] == pytest.approx(ece([0.0, 0.0, 0.1], [1, 0, 1]))  # the third predicted after two learnt


def test_soak_fails_when_a_greedy_output_differs(monkeypatch, capsys):
    """EAGLE-3's greedy outputs made wrong in their last token: the soak counts them and exits 1."""
    real = embedded.load

    def load(*args, **kwargs):
        model, tokenizer = real(*args, **kwargs)
        generate = model.generate

        def wrong(*a, **k):
            out = generate(*a, **k)
            if k.get("assistant") == "eagle3" and not k.get("do_sample"):
                out = out.clone()
                out[0, -1] = (out[0, -1] + 1) % model.config.vocab_size
            return out

        model.generate = wrong
        return model, tokenizer

    monkeypatch.setattr(embedded, "load", load)
    argv = ["soak", "--calls", "3", "--threads-every", "0", "--gsm8k", "1", "--cnn", "0", "--lengths", "4"]
    assert quality.main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["greedy_calls"] == 3 and report["greedy_identical"] == 2  # calls: AR, EAGLE-3, SpecFit


def test_sparse_replay_keeps_depth_one_of_every_third_cycle(tmp_path, capsys):
    cycles = [[(1, r, 0.5, r % 2) for r in range(1, i + 2)] + [(2, 1, 0.3, 0)] for i in range(5)]  # 1..5 at depth 1
    (tmp_path / "s.json").write_text(json.dumps({"gsm8k": [cycles], "cnn": [cycles[:2], cycles[2:]]}))
    assert calibration.main(["acceptance", "replay", str(tmp_path / "s.json")]) == 0
    assert {tuple(labels(s).values()) for s in capsys.readouterr().out.splitlines()} == {(20, 20)}
    assert calibration.main(["acceptance", "replay", str(tmp_path / "s.json"), "--sparse"]) == 0
    # cycles 0 and 3 of GSM8K's prompt (1 + 4 labels); of CNN/DailyMail's two prompts, cycle 0 of each (1 + 3)
    assert {tuple(labels(s).values()) for s in capsys.readouterr().out.splitlines()} == {(5, 4)}
