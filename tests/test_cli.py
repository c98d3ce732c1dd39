"""The command line as a user meets it: help written for users with every default shown, a version, the terms
explained, refusals without tracebacks, bench without data, calibrate without --slots; and the libraries behind
data access and the user cache."""

import re
from pathlib import Path

import pytest
from conftest import tiny_moe_config

from specfit import cli
from specfit.evaluation import datasets

README = Path(__file__).resolve().parents[1] / "README.md"


def run(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_is_written_for_users_and_explains_the_terms(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and out.startswith("usage: specfit")
    assert "add_arguments" not in out and "imported only when" not in out  # no developer notes
    for term in ("slots", "link", "node", "oracle", "eagle3-vanilla", "profile", "AR"):
        assert re.search(rf"^  {re.escape(term)}\s{{2,}}\S", out, re.M), term
    for name in cli.SUBCOMMANDS:
        assert name in out


def test_version(capsys):
    import specfit

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith(f"specfit {specfit.__version__} (Python ")


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_every_option_has_help_and_shows_its_default(capsys, name):
    parser = cli.command_parser(name)
    for action in parser._actions:
        assert action.help, f"specfit {name} {action.option_strings}: no help"
    code, out, _ = run(capsys, name, "--help")
    assert code == 0 and "terms:" not in out and "under `specfit --help`" in out  # the glossary once, there
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False) and action.dest != "help":
            text = " ".join(out.split())
            option = action.option_strings[-1]
            assert re.search(rf"{re.escape(option)}.*?default", text), f"specfit {name} {option}: default not shown"


def test_demo_help_shows_numbers(capsys):
    code, out, _ = run(capsys, "demo", "--help")
    assert "(default: 32)" in " ".join(out.split()) and "--prompt TEXT" in out


def test_a_refusal_is_one_line_not_a_traceback(capsys):
    code, _, err = run(capsys, "calibrate", "--threads", "0")
    assert code == 2 and err.startswith("specfit calibrate: error: --threads must be >= 1")
    assert "Traceback" not in err


def test_a_missing_file_is_a_refusal_too(capsys, monkeypatch, tmp_path):
    """A file a command needs and cannot find (here the embedded model's config, as after a broken install) is one
    line on stderr and exit status 2, like every other refusal, not a traceback."""
    from specfit.embedded import paths

    monkeypatch.setattr(paths, "TARGET_DIR", tmp_path / "target")
    code, _, err = run(capsys, "estimate")
    assert code == 2 and err.startswith("specfit estimate: error: ") and "config.json" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2  # the refusal, and how to see where


@pytest.mark.parametrize("name", ["demo", "estimate", "bench", "serve", "calibrate"])
def test_link_ms_0_is_a_free_link_not_a_refusal(name):
    """Every command's help says --link-ms 0 is no link cost: its option check takes it."""
    args = cli.command_parser(name).parse_args(["--link-ms", "0"])
    __import__(cli.SUBCOMMANDS[name][0], fromlist=["check_arguments"]).check_arguments(args)
    assert args.link_ms == 0


def test_bench_without_data_says_where_to_get_it_and_stops(capsys, monkeypatch):
    from specfit.evaluation import harness

    def refuse(*args, **kwargs):
        raise AssertionError("bench loaded a model although it has no prompts")

    monkeypatch.setattr(datasets, "data_dir", lambda: None)  # no local folder; the hub is offline in the tests
    monkeypatch.setattr(harness, "load_instances", refuse)
    code, _, err = run(capsys, "bench", "--quick")
    assert code == 2 and "Traceback" not in err
    assert "SPECFIT_DATA_DIR" in err and "gsm8k/test.jsonl" in err and "specfit demo" in err


def test_calibrate_defaults_its_slots(capsys, monkeypatch):
    from transformers import AutoConfig, LlamaConfig

    from specfit import embedded
    from specfit.evaluation import calibrate

    args = cli.command_parser("calibrate").parse_args([])
    assert args.slots is None
    seen = {}

    def load(cache_slots, **kwargs):
        seen["slots"] = cache_slots
        return "model", "tokenizer"

    monkeypatch.setattr(embedded, "load", load)
    calibrate._load(args)
    experts = AutoConfig.from_pretrained(embedded.TARGET_DIR).num_experts
    assert seen["slots"] == args.slots == round(experts * 3 / 8)
    assert "--slots not given" in capsys.readouterr().out
    assert calibrate.default_slots(tiny_moe_config(num_experts=128)) == 48  # the paper's 48 of 128
    with pytest.raises(ValueError, match="pass --slots"):
        calibrate.default_slots(LlamaConfig())  # a dense model: no experts to count


def test_readme_glossary_explains_every_term():
    text = README.read_text(encoding="utf-8")
    glossary = text[text.index("## Glossary"):]
    glossary = glossary[:glossary.index("\n## ", 1)] if "\n## " in glossary[1:] else glossary
    for term in cli.TERMS:
        assert f"**{term}**" in glossary, term


def test_readme_command_table_lists_every_command():
    text = README.read_text(encoding="utf-8")
    for name in cli.SUBCOMMANDS:
        assert f"`specfit {name}" in text, name


def test_offline_hub_datasets_load_from_the_datasets_cache(monkeypatch):
    """Offline (HF_HUB_OFFLINE, as the tests run), a dataset in the datasets library's cache still loads: SpecFit
    leaves offline handling to the library instead of refusing on its own."""
    import datasets as hf_datasets

    rows = [{"question": "What is 2 + 3?", "answer": "5"}]
    calls = []

    def cached(name, config=None, split=None):
        calls.append((name, config, split))
        return rows

    monkeypatch.setattr(datasets, "data_dir", lambda: None)
    monkeypatch.setattr(hf_datasets, "load_dataset", cached)
    assert datasets.gsm8k("test", 1) == rows and calls == [("openai/gsm8k", "main", "test[:1]")]


def test_an_unreachable_hub_is_reported_at_once_with_where_to_get_the_data(monkeypatch):
    import datasets as hf_datasets
    import huggingface_hub

    def unreachable(self, name, timeout=None):
        raise ConnectionError("Name or service not known")

    def never(*args, **kwargs):
        raise AssertionError("load_dataset ran (and retried) although the hub did not answer")

    monkeypatch.setattr(datasets, "data_dir", lambda: None)
    monkeypatch.setattr(hf_datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    monkeypatch.setattr(hf_datasets, "load_dataset", never)
    with pytest.raises(datasets.DataUnavailable, match=r"openai/gsm8k.*Name or service not known.*SPECFIT_DATA_DIR"):
        datasets.gsm8k("test", 1)


def test_the_user_cache_is_the_platforms(monkeypatch, tmp_path):
    import platformdirs

    from specfit.selection.profile_files import cache_root

    monkeypatch.delenv("SPECFIT_CACHE", raising=False)
    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda name, appauthor=None: str(tmp_path / name))
    assert cache_root() == tmp_path / "specfit"
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


# every subcommand's option errors, as typed, and the words of each refusal: the flag, the value, what is right
OPTION_ERRORS = [
    (["demo", "--slots", "100"], "--slots must be in 1..64"), (["demo", "--slots", "0"], "1..64"),
    (["demo", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["demo", "--link-ms", "-1"], "--link-ms must be a finite number of milliseconds"),
    (["demo", "--prompt", " "], "--prompt needs a non-empty TEXT"),
    (["demo", "--link-ms", "0", "--host-ratio", "2"], "--host-ratio scales the host lane to the link, and --link-ms 0 "
                                                       "makes copies free"),
    (["bench", "--slots", "0", "12"], "--slots are expert slots per layer, each in 1..64 (the embedded model's "
                                      "experts per layer) or 'none' (no cache), got 0"),
    (["bench", "--gsm8k-prompts", "0"], "--gsm8k-prompts must be >= 1, got 0"),
    (["bench", "--map-slots", "65"], "--map-slots are expert slots per layer, each in 1..64"),
    (["bench", "--link-ms", "nan"], "--link-ms must be a finite number of milliseconds"),
    (["calibrate", "--probes", "12"], "--probes must be >= 13 (each fit of the 5-fold cross-validation needs more "
                                      "records than coefficients), got 12"),
    (["calibrate", "--bootstrap", "10"], "--bootstrap must be >= 20"),
    (["calibrate", "--repeats", "0"], "--repeats must be >= 1"),
    (["calibrate", "--max-new-tokens", "3"], "--max-new-tokens must be >= 4 (the first 3 cycles of a prompt warm up"),
    (["calibrate", "--prompts", "foo"], "--prompts must be gsm8k, cnn, random or a .jsonl file, got 'foo'"),
    (["calibrate", "--prompts", "nowhere.jsonl"], "--prompts 'nowhere.jsonl': no such file"),
    (["calibrate", "--slots", "0"], "--slots must be in 1..64 (the model's experts per MoE layer), got 0"),
    (["calibrate", "--fp8", "--model", "x"], "--fp8 picks the embedded model's FP8 variant"),
    (["calibrate", "--model", "/nonexistent"], "--model '/nonexistent' is neither a local checkpoint folder"),
    (["calibrate", "--model", "x"], "--model 'x': no local folder of that name, and the hub could not give its "
                                    "config.json"),
    (["calibrate", "--drafter", "/nonexistent"], "--drafter '/nonexistent' is neither a local EAGLE-3 checkpoint"),
    (["calibrate", "--drafter", "eagle3-drafer"], "--drafter 'eagle3-drafer': no local folder of that name, and the "
                                                  "hub could not give its config.json"),
    (["estimate", "--slots", "0"], "--slots must be in 1..64 (the embedded model's experts per layer), got 0"),
    (["estimate", "--hit-rate", "0.9", "2"], "--hit-rate takes shares from 0 to 1, got 2.0"),
    (["estimate", "--profile", "nowhere.json"], "--profile 'nowhere.json': no such file"),
    (["calibrate", "--link-ms", "1", "--default-link"], "give --link-ms or --default-link, not both"),
    (["calibrate", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["calibrate", "--device", "cuda:1"], "--device cuda:1: the embedded model runs on the CPU only"),
    (["make-fp8", "OUT", "--source", "/nonexistent"], "--source '/nonexistent' is not a folder (no such path)"),
    (["train-target", "--out", "x", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["train-target", "--out", "x", "--continue-gsm8k-share", "2"], "--continue-gsm8k-share is a share, from 0 to 1"),
    (["train-drafter", "--out", "x", "--draft-vocab", "5000"], "--draft-vocab must be <= the target's vocabulary "
                                                               "(4096"),
    (["train-drafter", "--out", "x", "--target", "/nonexistent"], "--target '/nonexistent' is not a folder"),
    (["train-router"], "--out is needed with the embedded drafter"),
    (["train-router", "--out", "x", "--num-prompts", "1"], "--num-prompts must be >= 2"),
]

OPTION_RUN = """
import contextlib, io, json, sys
from specfit import cli

results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append([code, err.getvalue()])
for name in cli.SUBCOMMANDS:  # every command's help, too
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main([name, "--help"])
        except SystemExit:
            pass
print(json.dumps({"results": results, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def test_every_option_error_is_answered_before_torch_or_a_model_loads(tmp_path):
    """Every subcommand's refusals, and every --help, in a fresh interpreter: each refusal is one line in the
    flag's own words, and neither torch nor transformers was imported (so no model loaded either). By hand, on the
    shared 2-core machine: all of them together in about 1 s, against 10-16 s per refusal before."""
    import json
    import subprocess
    import sys

    argv = json.dumps([a for a, _ in OPTION_ERRORS])
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", OPTION_RUN, argv], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["heavy"] == [], f"parsing and checking options imported {found['heavy']}"
    for (args, message), (code, err) in zip(OPTION_ERRORS, found["results"]):
        command = args[0]
        assert code == 2 and err.startswith(f"specfit {command}: error: "), (args, err)
        assert message in " ".join(err.split()) and "Traceback" not in err, (args, err)


def test_demo_without_data_says_so_once_naming_both_places(monkeypatch):
    from argparse import Namespace

    from specfit.evaluation import demo

    monkeypatch.setattr(datasets, "data_dir", lambda: None)  # no local folder; the hub is offline in the tests
    texts, note = demo.workload_prompts(Namespace(prompt=None, num_prompts=4))
    assert [len(v) for v in texts.values()] == [4, 4]  # as many built-in prompts as the default asks for
    assert "$SPECFIT_DATA_DIR" in note and "shared/data" in note and "hub" in note
    assert note.count("Get the data") == 1
    texts, note = demo.workload_prompts(Namespace(prompt=["My own prompt"], num_prompts=4))
    assert texts == {demo.YOURS: ["My own prompt"]} and note is None
