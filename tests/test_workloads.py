"""The benchmark workloads: GSM8K and CNN/DailyMail, and the two kinds of prompt the drafter never saw (MT-Bench's
first turns as questions, HumanEval's function stubs), read from the local data folder; a missing folder or an
unknown name is refused with what would be right."""

import pytest

from specfit.evaluation import datasets

DATA = datasets.data_dir()
needs_data = pytest.mark.skipif(DATA is None or not (DATA / "mt_bench").is_dir(),
                                reason="no local data folder with mt_bench/ and humaneval/ (../shared/data or "
                                       "SPECFIT_DATA_DIR)")


@needs_data
def test_unseen_workloads_read_their_rows_in_the_prompt_formats(monkeypatch):
    monkeypatch.setenv("SPECFIT_DATA_DIR", str(DATA))  # the folder found at collection, whatever ran before
    mt = datasets.prompts("mtbench", 3, max_chars=50)
    assert len(mt) == 3 and all(p.startswith("Question: ") and p.endswith("\nAnswer:") for p in mt)
    assert "travel blog" in mt[0]  # MT-Bench's first question, its first turn
    code = datasets.prompts("humaneval", 2)
    assert len(code) == 2 and code[0].startswith("from typing import List") and "def has_close_elements" in code[0]
    assert set(datasets.UNSEEN) <= set(datasets.WORKLOADS)


def test_unknown_workload_and_missing_folder_are_refused(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown workload 'mmlu'; choose one of gsm8k, cnn, mtbench, humaneval"):
        datasets.prompts("mmlu", 1)
    monkeypatch.setattr(datasets, "data_dir", lambda: None)
    with pytest.raises(datasets.DataUnavailable, match="mt_bench/question.jsonl.*SPECFIT_DATA_DIR"):
        datasets.prompts("mtbench", 1)
    (tmp_path / "gsm8k").mkdir()  # a data folder without HumanEval: the remedy is that folder, not the hub
    monkeypatch.setattr(datasets, "data_dir", lambda: tmp_path)
    with pytest.raises(datasets.DataUnavailable, match=f"the data folder {tmp_path} has none.*humaneval/HumanEval") \
            as refused:
        datasets.prompts("humaneval", 1)
    assert "hub" not in str(refused.value)
