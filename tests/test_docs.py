"""The README reads in five minutes and points to docs/ for the rest; docs/options.md names only options that exist
(every ``name=`` keyword is taken by a SpecFit call, a generate() setting or the transformers/torch call it names,
and every ``--flag`` by a ``specfit`` command)."""

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
OPTIONS = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")


def test_the_readme_is_short_and_starts_with_the_commands():
    assert len(README.split()) < 1500
    lines = README.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.startswith("python3 -m venv"))
    assert first_command < 60
    opening = "\n".join(lines[:first_command])
    assert "never yet run on a GPU" in opening and "emulated" in opening  # what it was measured on, said first


def test_the_readme_links_the_docs_and_shows_serving_and_batches():
    for name in ("design", "options", "results"):
        assert f"(docs/{name}.md)" in README and (ROOT / "docs" / f"{name}.md").is_file(), name
    assert "## Serving and batches" in README and "`specfit serve" in README and "(docs/serve.md)" in README
    assert "(docs/batch.md)" in README and "--batch" in README


def python_keywords() -> set[str]:
    """Every keyword a user can pass where docs/options.md says: SpecFit's calls, its decoding options,
    generate()'s settings, and the transformers / torch calls the text names."""
    import torch
    from transformers import GenerationConfig, GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

    import specfit
    from specfit import enable_checks
    from specfit.evaluation import calibrate, probes

    calls = [specfit.enable, specfit.from_pretrained, specfit.configure, specfit.embedded.load, specfit.compare,
             specfit.embedded.demo_settings,
             calibrate.fit_profile, probes.calibrate, specfit.register_assistant, PreTrainedModel.save_pretrained,
             PreTrainedTokenizerBase.__call__, GenerationMixin.generate, torch.compile]
    names = {p for call in calls for p in inspect.signature(call).parameters}
    names |= set(enable_checks.FROM_PRETRAINED_KEYWORDS + enable_checks.ENABLE_ONLY)  # enable's **decoding too
    names |= set(GenerationConfig().to_dict()) | {"assistant", "streamer", "stopping_criteria", "stop_strings"}
    return names


def test_every_keyword_in_the_options_reference_exists():
    named = set(re.findall(r"[`(, ]([a-z_][a-z0-9_]*)=", OPTIONS))
    assert len(named) >= 25  # the reference names them as name=...
    assert sorted(named - python_keywords()) == []


def test_every_flag_in_the_options_reference_exists():
    from specfit import cli

    flags = {o for action in cli.build_parser()._actions for o in action.option_strings}  # --version
    for name in cli.SUBCOMMANDS:
        for action in cli.command_parser(name)._actions:
            flags.update(action.option_strings)
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", OPTIONS))
    assert len(named) > 10
    assert sorted(named - flags) == []


@pytest.mark.parametrize("stale", ["cache_slot=", "--num-prompt "])
def test_the_check_would_catch_a_stale_name(stale):
    """A misspelt keyword or flag is not among the names the checks accept."""
    from specfit import cli

    if stale.startswith("--"):
        flags = {o for n in cli.SUBCOMMANDS for a in cli.command_parser(n)._actions for o in a.option_strings}
        assert stale.strip() not in flags
    else:
        assert stale.rstrip("=") not in python_keywords()
