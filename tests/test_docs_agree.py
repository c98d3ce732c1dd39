"""Docs that agree with the code (issue 53, item 3), where a doc states a limit or a list: batches with an assistant
(they work: no doc says batch size 1), the assistants (every one named exists, every built-in one is named), the
options (every keyword and flag that exists is named in docs/options.md; tests/test_docs.py checks the other way),
and the style limit on file sizes."""

import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit import cli, enable_checks, embedded
from specfit.decoding.options import DecodingOptions
from specfit.evaluation import comparison

ROOT = Path(__file__).resolve().parents[1]
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
OPTIONS = DOCS["docs/options.md"]
MAX_LINES = 450
BEING_SPLIT = {"decoding/assistants.py"}  # split by the batch work, in its own branch


def test_batches_with_an_assistant_work_as_the_docs_say():
    """A left-padded batch of two with assistant="specfit" decodes each row as plain generate() does, so no doc may
    say an assistant takes batch size 1; those that speak of batches point to docs/batch.md."""
    ids = torch.tensor([[0, 0, 5, 9, 17], [3, 8, 11, 2, 40]])
    mask = (ids != 0).long()
    mask[1] = 1
    expected = tiny_moe().generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=3, noise=0.3), route_source="gate")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, assistant="specfit")
    assert torch.equal(out, expected)
    for name, text in DOCS.items():
        flat = " ".join(text.split())
        assert not re.search(r"batch size 1\b|batch size of 1\b|one prompt at a time", flat, re.I), name
    for name in ("README.md", "docs/design.md", "docs/options.md"):
        assert "batch.md" in DOCS[name], name


def test_the_assistants_the_docs_name_exist_and_each_built_in_one_is_named():
    from specfit.decoding import oracle  # noqa: F401  registers "acceptance-oracle"
    from specfit.decoding.assistants import ASSISTANTS

    named = {m for text in DOCS.values() for m in re.findall(r'assistant="([\w-]+)"', text)}
    assert named and sorted(named - set(ASSISTANTS)) == []
    assert sorted(a for a in ASSISTANTS if f'"{a}"' not in OPTIONS) == []


def test_every_python_option_that_exists_is_named_in_the_options_reference():
    named = set(re.findall(r"[`(, ]([a-z_][a-z0-9_]*)=", OPTIONS))
    exists = {f.name for f in fields(DecodingOptions)}
    exists |= set(enable_checks.FROM_PRETRAINED_KEYWORDS + enable_checks.ENABLE_ONLY)
    exists |= {p for p in inspect.signature(specfit.compare).parameters if p not in ("model", "tokenizer", "prompts",
                                                                                     "generate_kwargs", "as_frame")}
    exists |= set(inspect.signature(embedded.demo_settings).parameters)
    assert sorted(exists - named) == []


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_flag_of_every_command_is_named_in_the_docs(name):
    text = DOCS["docs/serve.md"] if name == "serve" else OPTIONS
    flags = {o for action in cli.command_parser(name)._actions for o in action.option_strings
             if o.startswith("--") and o != "--help"}
    assert sorted(f for f in flags if not re.search(rf"`[^`]*{re.escape(f)}(?![\w-])", text)) == []


def test_the_stale_claims_would_be_caught():
    """The checks above would have failed on the docs before issue 53."""
    assert re.search(r"batch size 1\b", "Batch size 1 with an assistant", re.I)
    assert not re.search(r"`[^`]*--quick(?![\w-])", "`specfit bench` (a smoke run)")


def test_no_source_file_is_over_450_lines():
    src = ROOT / "src" / "specfit"
    long = {p.relative_to(src).as_posix(): len(p.read_text().splitlines()) for p in src.rglob("*.py")}
    assert {p: n for p, n in long.items() if n > MAX_LINES and p not in BEING_SPLIT} == {}


def test_the_wide_table_keeps_every_column_of_the_narrow_one():
    from specfit.evaluation.demo import narrow_table

    rows = [dict(method=m, label=label, tok_s=t, tok_s_spread=None, speedup=t / 10, nodes_per_cycle=n,
                 tokens_per_cycle=c, expected_over_committed=1.0, forecast_over_real=None, copies_per_token=k,
                 mib_per_token=0.1, copy_wait_share=0.1, hit_rate=0.9, hits_per_token=0.0, host_per_token=0.0,
                 host_wait_share=0.0)
            for m, label, t, n, c, k in (("ar", "AR", 10.0, 0, 1.0, 9.0), ("eagle3", "EAGLE-3", 12.0, 7, 3.1, 12.0),
                                         ("specfit", "SpecFit", 13.0, 4, 2.4, 8.0))]
    narrow = narrow_table(rows).splitlines()
    wide = comparison.format_rows(rows).splitlines()
    for column in ("tok/s", "vs AR", "vs EAGLE-3", "tok/cyc", "copies/tok"):
        assert column in narrow[0] and column in wide[0], column
    assert wide[0].index("vs EAGLE-3") < wide[0].index("tok/cyc")
    for n, w in zip(narrow[2:], wide[2:]):  # the same ratios in both
        assert n.split()[-3] in w.split(), (n, w)


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_the_link_option_says_the_link_is_kept(command):
    text = " ".join(next(a.help for a in cli.command_parser(command)._actions if "--link-ms" in a.option_strings)
                    .split())
    assert "measured at start" not in text and "kept in the user cache" in text and "specfit calibrate" in text
