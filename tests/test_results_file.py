"""The benchmarks write their results through one helper: OUT/results.json, the folder made, one-space JSON with a
final newline, values JSON cannot hold written as text."""

import json
from pathlib import Path

import pytest
import torch

from specfit.evaluation.results_file import write_results

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_results_are_written_where_said(tmp_path):
    path = write_results(tmp_path / "new" / "run", {"dtype": torch.bfloat16, "rows": [1, 2]})
    assert path == tmp_path / "new" / "run" / "results.json"
    text = path.read_text()
    assert text.endswith("}\n") and json.loads(text) == {"dtype": "torch.bfloat16", "rows": [1, 2]}


@pytest.mark.parametrize("script", ["run", "cache_policies", "serve_load", "quality", "calibrating", "loading"])
def test_the_benchmarks_use_it(script):
    text = (BENCHMARKS / f"{script}.py").read_text()
    assert "write_results(" in text, script
    assert ".write_text(json.dumps" not in text and "json.dump(" not in text, script  # no second way of writing it
