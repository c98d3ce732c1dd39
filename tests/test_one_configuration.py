"""One set of defaults everywhere (issue 53, item 2): ``specfit demo``, the README's snippet and results table, the
quickstart notebook and script, and ``specfit.compare`` on their model run ``specfit.embedded.demo_settings()``; the
demo says where a run differs; the README table names the command that prints it; and what a header or the README
claims is what the table beside it shows."""

import json
import re
from argparse import Namespace
from pathlib import Path

import pytest

from specfit import cli, embedded
from specfit.evaluation import demo

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = README[README.index("## Results"):README.index("## Use")]
needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")
LOAD = "specfit.embedded.load(**specfit.embedded.demo_settings())"


def test_the_snippet_the_notebook_and_the_script_load_the_demos_configuration():
    use = README[README.index("## Use"):README.index("## Commands")]
    assert LOAD in use
    notebook = "\n".join("".join(c["source"]) for c in json.loads((ROOT / "examples/quickstart.ipynb").read_text())
                         ["cells"])
    assert "specfit.embedded.demo_settings(SLOTS, link_ratio=LINK_RATIO, host_ratio=HOST_RATIO)" in notebook
    assert re.search(r"^SLOTS = 12\b", notebook, re.M) and "LINK_RATIO = 1.0" in notebook
    assert "HOST_RATIO = 2.5" in notebook and "HOST_RATIO = 2.5" in notebook
    assert "embedded.load(**embedded.demo_settings())" in (ROOT / "examples/quickstart.py").read_text()
    defaults = embedded.demo_settings.__defaults__
    assert defaults == (embedded.DEMO_SLOTS, 1.0, embedded.HOST_TO_LINK) and embedded.DEMO_SLOTS == 12


def test_the_readme_table_names_the_command_that_prints_it_in_that_configuration():
    command = re.search(r"`(specfit demo[^`]*)`", RESULTS).group(1)
    args = cli.command_parser("demo").parse_args(command.split()[2:])
    assert (args.slots, args.link_ms, args.host_ratio, args.fp8) == (embedded.DEMO_SLOTS, None, None, False)
    assert "demo_settings()" in RESULTS and "host lane" in RESULTS and "three runs" in RESULTS
    demo.check_arguments(args)
    assert demo.same_as_elsewhere(args).startswith("Configuration: specfit.embedded.demo_settings()")


def table_cells() -> dict:
    """The README results table: workload -> {column: cell text}."""
    lines = [line for line in RESULTS.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(head, cells)) for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}


def test_what_the_readme_says_of_copies_is_what_its_table_shows():
    cells = table_cells()
    assert set(cells) == {"GSM8K", "CNN/DailyMail"}
    column = next(c for c in next(iter(cells.values())) if c.startswith("copies per token"))
    for workload, row in cells.items():
        runs = [tuple(map(float, pair.split("/"))) for pair in row[column].split(",")]
        assert len(runs) == 3, row[column]
        said = re.search(rf"{re.escape(workload)}: SpecFit\s+copied (?:about )?(fewer|more|as many)", RESULTS)
        if said is None:
            continue
        fewer = all(s < e for s, e in runs)
        more = all(s > e for s, e in runs)
        assert said.group(1) == ("fewer" if fewer else "more" if more else "as many"), (workload, runs)
    assert "copies fewer experts per token than EAGLE-3" not in RESULTS  # only per workload, as measured


@needs_embedded
def test_the_demo_runs_demo_settings_unless_told_otherwise():
    args = cli.command_parser("demo").parse_args([])
    demo.check_arguments(args)
    link, _, host = demo.settings(args)
    expected = embedded.demo_settings()
    assert link == expected["link"] and host == expected["host"] and args.slots == expected["cache_slots"]
    assert demo.same_as_elsewhere(args).startswith("Configuration: specfit.embedded.demo_settings()")
    changed = cli.command_parser("demo").parse_args(["--slots", "6", "--host-ratio", "0", "--link-ms", "0.3"])
    demo.check_arguments(changed)
    _, how, host = demo.settings(changed)
    assert host is None and how == "given (--link-ms)"
    said = demo.same_as_elsewhere(changed)
    assert said.startswith("Configuration: NOT") and "--slots 6" in said and "--host-ratio 0" in said
    assert "--link-ms" in said


def test_demo_settings_without_a_link_has_no_lane_and_refuses_nonsense():
    assert embedded.demo_settings(6, link_ratio=0) == dict(cache_slots=6, link=None, host=None)
    with pytest.raises(ValueError, match="host_ratio must be a finite number >= 0"):
        embedded.demo_settings(host_ratio=-1)
    with pytest.raises(ValueError, match="link_ratio must be a finite number >= 0"):
        embedded.demo_settings(link_ratio=float("inf"))


def test_the_verdict_says_copies_as_the_table_shows():
    rows = [dict(method="ar", copies_per_token=9.0), dict(method="eagle3", copies_per_token=13.3),
            dict(method="specfit", copies_per_token=13.8)]
    assert demo.copies_said(rows).startswith("SpecFit copied 13.80 experts per token, more than EAGLE-3 (13.30")
    rows[2]["copies_per_token"] = 12.0
    assert ", fewer than EAGLE-3" in demo.copies_said(rows)
    rows[2]["copies_per_token"] = 13.3
    assert ", as many as EAGLE-3" in demo.copies_said(rows)
    assert demo.copies_said(rows[:1]) == "copies per token: see the table"


@needs_embedded
def test_the_demo_header_claims_no_more_than_its_table(monkeypatch, capsys):
    """A run where SpecFit copies more than EAGLE-3: nothing the demo prints says it copies fewer."""
    import torch

    from specfit.evaluation import comparison, harness
    from specfit.evaluation.harness import METHODS
    from specfit.stats import Counters

    copies = {"ar": 9.0, "eagle3": 13.3, "specfit": 13.8}
    stats = lambda m: Namespace(specfit=Namespace(stats=Namespace(last_generate=Namespace(  # noqa: E731
        end_to_end_tokens_per_second=10.0 + len(m)))))
    monkeypatch.setattr(harness, "load_instances", lambda *a, **k: ({m: stats(m) for m in demo.METHODS},
                                                                     __import__("transformers").AutoTokenizer
                                                                     .from_pretrained(embedded.TARGET_DIR)))

    def run(instances, tokenizer, prompts, methods, max_new_tokens, on_prompt):
        for i in range(len(prompts)):
            on_prompt(i)
        counters = {m: Counters(new_tokens=10, decode_seconds=1.0, misses=int(copies[m] * 10), cycles=5,
                                tokens_committed=10) for m in methods}
        return comparison.Comparison({m: METHODS[m] for m in methods}, len(prompts), counters,
                                     {m: 1.0 for m in methods}, {m: [torch.tensor([5, 6])] for m in methods},
                                     {m: [10.0] * len(prompts) for m in methods}, len(prompts), "setup")

    monkeypatch.setattr(comparison, "run", run)
    assert cli.main(["demo", "--num-prompts", "2", "--max-new-tokens", "4", "--link-ms", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "fewer experts per token than EAGLE-3" not in out and "copies fewer" not in out
    assert out.count("SpecFit copied 13.80 experts per token, more than EAGLE-3 (13.30; AR 9.00)") == 2


@needs_embedded
def test_a_model_loaded_in_the_demos_configuration_says_so_everywhere():
    model, _ = embedded.load(**embedded.demo_settings(), drafter=False)
    assert "host=specfit.embedded.default_host(2.5)" in model.specfit.load_call  # what a refused cast names
    assert "link=specfit.embedded.default_link()" in model.specfit.load_call
    from specfit.evaluation.comparison import setup

    said = setup(model)
    assert said.startswith("12 slots of 64 per layer, emulated link, structural default, emulated host lane, 2.5x")
    assert said.endswith("CPU (not GPU speed)")
