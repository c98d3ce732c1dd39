"""What the README and every printed remedy tell a user to type, run as typed: the command named in a warning or a
refusal is taken from the message itself and run through ``specfit.cli.main`` (the console script's entry; in this
process, so torch's import and the emulated link's measurement are paid once), at small settings but through the
default code paths: the embedded model (or its FP8 variant, or a checkpoint folder), the default prompts from the
data folder, the default dtype, slot count and links. Then ``generate()`` runs with no "no calibrated profile"
warning.

A small calibration cannot promise a good fit, so the runs add ``--force`` (the refusal's own remedy, printed when
the fit is poor): the profile is installed either way, and each test checks what the verdict says: a GOOD fit loads
with no warning at all; a POOR one is said so in the flags' words and warns, naming the very command that was run.
The gate refusing a fit, without ``--force``, is ``test_calibrate.py``'s (the command's exit code and files);
``specfit demo`` as printed is ``test_compare.py``'s (its progress lines and verdicts)."""

import json
import re
import shlex
import warnings

import pytest
import torch

import specfit
from specfit import cli, embedded
from specfit.evaluation import datasets
from specfit.selection.profile_files import profile_path
from specfit.selection.profiles import calibrate_command, profile_key, profile_source

needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")
needs_data = pytest.mark.skipif(
    datasets.data_dir() is None,
    reason="calibrate's and bench's default prompts are GSM8K test questions from the local data folder "
           "($SPECFIT_DATA_DIR, or shared/data beside the repository), which is absent here")

# The least that still runs every stage of the default path (load, the default link measured, a planning round,
# timed rounds over no link and the default link, the fit, cross-validation, bootstrap, the selector's stability,
# the plot): one prompt, 13 probe configurations (the least the command takes), one timed round per link, 20
# bootstrap refits (their least). 40 new tokens give the 13 configurations after the 3 warm-up cycles in one
# planning generate (12 tokens took five, and 30% more CPU in all).
SMALL = ["--num-prompts", "1", "--probes", "13", "--repeats", "1", "--bootstrap", "20", "--max-new-tokens", "40"]
PROMPT = "Question: What is 7 times 8?\nAnswer:"


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield tmp_path / "cache"
    torch.set_num_threads(threads)  # the commands set it, as they own their process


def run(capsys, command: str, *extra: str):
    """A command as printed (backticks and all), typed with ``extra`` options appended."""
    argv = shlex.split(command.strip("`"))
    assert argv[0] == "specfit", command
    try:
        code = cli.main(argv[1:] + list(extra))
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


def profile_warnings(model, tokenizer=None, ids=None) -> list[str]:
    """The warnings about cost profiles of one short SpecFit generate()."""
    ids = ids if ids is not None else tokenizer(PROMPT, return_tensors="pt").input_ids
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(ids, max_new_tokens=6, do_sample=False, assistant="specfit")
    return [str(w.message) for w in caught if "profile" in str(w.message)]


def named_command(messages: list[str]) -> str:
    """The command the "no calibrated cost profile" warning names."""
    missing = [m for m in messages if "no calibrated cost profile" in m]
    assert len(missing) == 1, messages
    return re.search(r"Run (`[^`]+`) once on this machine", missing[0]).group(1)


def check_installed(code, out, err, command, model, tokenizer=None, ids=None) -> None:
    """After ``command ... --force``: installed where enable looks; generate() then warns only about a poor fit,
    naming ``command`` and the flags to change."""
    assert code == 0, err[-2000:]
    assert profile_path(**profile_key(model)).is_file()
    verdict = re.search(r"^verdict     (GOOD|POOR)$", out, re.M).group(1)
    messages = profile_warnings(model, tokenizer, ids)
    assert not any("no calibrated cost profile" in m or "reference cost profile" in m for m in messages), messages
    # the same model object, which looked up a profile before the command ran, now prices with the one installed
    assert profile_source(model).startswith("this machine's"), profile_source(model)
    if verdict == "GOOD":
        assert messages == [] and "installed anyway" not in err
    else:
        assert "installed anyway (--force)" in err and "take more probes (--probes, --repeats)" in err
        assert messages and all(command in m and "(--probes, --repeats)" in m for m in messages), messages


@needs_embedded
@needs_data
def test_specfit_calibrate_as_the_readme_prints_it(user_cache, capsys):
    model, tokenizer = embedded.load(12, link=embedded.default_link())
    command = calibrate_command(model)
    assert command == "`specfit calibrate`"  # what the README's Use and command table print
    code, out, err = run(capsys, command, *SMALL, "--force")
    assert "--slots not given: 24 slots" in out and "links: real copies, emulated link, structural default" in out
    assert "specfit/embedded-qwen3-moe [48x64e top4 h80 float32]" in out  # the default dtype's profile
    check_installed(code, out, err, command, model, tokenizer)


@needs_embedded
@needs_data
def test_a_refused_cast_and_the_bf16_warning_name_calls_that_work(user_cache, capsys):
    """A cast refused on a model from embedded.load names embedded.load again with dtype= (drafter and link kept);
    that bf16 model warns that it has no profile, naming `specfit calibrate --dtype bfloat16`, which clears it."""
    link = embedded.default_link()
    model, tokenizer = embedded.load(8, link=link)
    with pytest.raises(RuntimeError) as refused:
        model.model.layers[0].bfloat16()  # a part of the model (the whole model's cast is done, not refused)
    remedy = re.search(r"the call that loaded it \(it keeps the drafter and the link\): (.*) \(with your other "
                       r"options\)$", str(refused.value)).group(1)
    assert remedy == ("model, tokenizer = specfit.embedded.load(8, link=specfit.embedded.default_link(), "
                      "dtype=torch.bfloat16)")
    scope = {"specfit": specfit, "torch": torch}
    exec(remedy, scope)
    model = scope["model"]
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.specfit.drafter is not None and model.specfit.config.link == link
    assert model.specfit.config.cache_slots == 8
    command = named_command(profile_warnings(model, tokenizer))
    assert command == "`specfit calibrate --dtype bfloat16`"
    code, out, err = run(capsys, command, *SMALL, "--force")
    assert "[48x64e top4 h80 bfloat16]" in out  # a profile of its own
    check_installed(code, out, err, command, model, tokenizer)


@needs_embedded
@needs_data
def test_the_fp8_variant_names_calibrate_fp8_which_installs_its_own_profile(user_cache, capsys):
    """The FP8 variant ships a reference profile of its own (calibration/embedded-fp8.json): on another machine
    it warns, naming `specfit calibrate --fp8`; on the reference machine it is silent. Either way the command the
    model names is that one, and it installs a profile of the FP8 model's own."""
    model, tokenizer = embedded.load(12, fp8=True, link=embedded.default_link())
    command = calibrate_command(model)
    assert command == "`specfit calibrate --fp8`"
    messages = profile_warnings(model, tokenizer)
    assert all(command in m for m in messages), messages
    code, out, err = run(capsys, command, *SMALL, "--force")
    assert re.search(r"^model       target-fp8-\w+ \[48x64e top4 h80 float32\]$", out, re.M)
    check_installed(code, out, err, command, model, tokenizer)


def test_a_checkpoint_folders_warning_names_a_command_with_its_drafter_that_clears_it(user_cache, tmp_path, capsys):
    """A model from specfit.from_pretrained(folder, drafter=folder): the warning's command names both folders and
    the dtype, and random prompts for a checkpoint without a tokenizer, so it runs as printed."""
    from conftest import tiny_moe

    from specfit.drafting.formats import save_drafter
    from specfit.training.drafter import make_drafter
    from specfit.training.ttt import draft_vocab_from_counts

    target = tiny_moe()
    target.save_pretrained(tmp_path / "target")
    d2t, t2d = draft_vocab_from_counts(torch.ones(256), 128, 256)
    save_drafter(make_drafter(target, d2t, t2d, intermediate_size=32), tmp_path / "drafter")
    model = specfit.from_pretrained(tmp_path / "target", cache_slots=4, device="cpu",
                                    drafter=str(tmp_path / "drafter"))
    ids = torch.randint(2, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    command = named_command(profile_warnings(model, ids=ids))
    assert command == (f"`specfit calibrate --model {tmp_path / 'target'} --drafter {tmp_path / 'drafter'} --dtype "
                       f"float32{' --device cpu' if torch.cuda.is_available() else ''} --prompts random`")
    code, out, err = run(capsys, command, *SMALL, "--force")
    check_installed(code, out, err, command, model, ids=ids)


def test_specfit_calibrate_in_python_speaks_of_its_keywords_and_raises_what_it_refuses(user_cache):
    from conftest import tiny_moe

    from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter

    model = tiny_moe()
    prompts = [torch.randint(2, 256, (1, 9), generator=torch.Generator().manual_seed(1))]
    torch.manual_seed(0)  # a random drafter: about a token a cycle, so a short generation gives many probes
    drafter = Eagle3Drafter(Eagle3Config.from_target(model.config, draft_vocab_size=256, intermediate_size=32))
    specfit.enable(model, cache_slots=4, link=1e-4, drafter=drafter)
    small = dict(probes=10, repeats=1, bootstrap=20, max_new_tokens=16)
    with pytest.raises(ValueError, match=r"^probes must be an int >= 10, got 5$"):  # before any probe runs
        specfit.calibrate(model, prompts, **{**small, "probes": 5})
    with pytest.raises(ValueError, match=r"^bootstrap must be an int >= 20, got 10$"):
        specfit.calibrate(model, prompts, **{**small, "bootstrap": 10})
    path = profile_path(**profile_key(model))
    strict = {"min_heldout_r2": 1.01}  # no fit passes: the refusal, whatever this machine's noise
    with pytest.raises(specfit.CalibrationRefused) as refused:
        specfit.calibrate(model, prompts, gate=strict, **small)
    text = str(refused.value)
    assert "NOT installed" in text and "(probes=, repeats=)" in text and "torch.set_num_threads(1)" in text
    assert "force=True" in text and "--" not in text  # keywords, not the command's flags
    assert not path.exists() and refused.value.path.is_file()
    assert refused.value.profile.quality["verdict"] == "poor"
    with pytest.warns(RuntimeWarning, match=r"installed anyway \(force=True\)"):
        installed = specfit.calibrate(model, prompts, gate=strict, force=True, **small)
    assert path.is_file() and installed.quality["verdict"] == "poor"
    with pytest.warns(RuntimeWarning, match=r"Recalibrate with `specfit.calibrate\(model, prompts\)`.*\(probes=, "
                                            r"repeats=\)"):
        model.generate(prompts[0], max_new_tokens=4, do_sample=False, assistant="specfit")


def test_demo_notes_each_profile_warning_once():
    from specfit.evaluation.demo import notes

    caught = [warnings.WarningMessage(RuntimeWarning(text), RuntimeWarning, "x", 1) for text in
              ("no calibrated cost profile A", "no calibrated cost profile A", "ThreadsNotice", "reference profile B")]
    assert notes(caught) == ["no calibrated cost profile A", "reference profile B"]


@needs_embedded
@needs_data
def test_specfit_bench_as_the_readme_prints_it(user_cache, tmp_path, capsys):
    """`specfit bench --quick` (the smoke run: one slot count, one regime, the demo's three methods), at two GSM8K
    prompts of 4 tokens: the table, its JSON and its plot."""
    out_dir = tmp_path / "bench"
    code, out, err = run(capsys, "specfit bench --quick", "--workloads", "gsm8k", "--gsm8k-prompts", "2",
                         "--max-new-tokens", "4", "--out", str(out_dir))
    assert code == 0, err[-2000:]
    result = json.loads((out_dir / "results.json").read_text())
    assert sorted(r["method"] for r in result["rows"]) == ["ar", "eagle3", "specfit"]
    assert result["max_new_tokens"] == 4 and all(r["prompts"] == 2 for r in result["rows"])  # given: kept
    assert all(r["tok_s_spread"] == 0.0 for r in result["rows"])  # one timed prompt: no spread
    assert (out_dir / "tok_s_vs_slots.png").is_file()
    assert all(r["regime"] == "emulated link + host lane" and r["slots"] == "12" for r in result["rows"])  # the default lane
    assert "[gsm8k] slots 12 of 64, emulated link + host lane (CPU, emulated)" in out
