"""Benchmark and training text: read from a local data folder when there is one, else from the Hugging Face hub.

The local folder is found, in order, at ``$SPECFIT_DATA_DIR``, ``./shared/data``, ``../shared/data`` (seen from the
working directory) and ``../shared/data`` seen from the repository root. It holds ``gsm8k/{train,test}.jsonl``,
``cnn_dailymail/test.jsonl`` and ``openstax/train.jsonl`` (see that folder's README for sources and licenses).
The hub is asked through the ``datasets`` library, which keeps its own cache and obeys ``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE`` (offline, a dataset already in its cache still loads).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]

# Prompt formats shared by training, the demo, the benchmark and the regression.
GSM8K_PROMPT = "Question: {question}\nAnswer:"
CNN_PROMPT = "Article: {article}\nSummary:"
EOS_TEXT = "<|endoftext|>"


class DataUnavailable(RuntimeError):
    """Neither the local data folder nor the hub could provide a dataset."""


def data_dir() -> Path | None:
    """The local data folder, or None when there is none."""
    candidates = []
    if os.environ.get("SPECFIT_DATA_DIR"):
        candidates.append(Path(os.environ["SPECFIT_DATA_DIR"]))
    candidates += [Path.cwd() / "shared" / "data", Path.cwd().parent / "shared" / "data", _REPO_ROOT.parent / "shared" / "data"]
    for path in candidates:
        if (path / "gsm8k" / "test.jsonl").is_file():
            return path
    return None


WHERE_TO_GET = ("Get the data one of two ways: (1) a local folder holding gsm8k/test.jsonl and gsm8k/train.jsonl "
                "(one JSON object per line with 'question' and 'answer') and cnn_dailymail/test.jsonl ('article' and "
                "'highlights'), named by SPECFIT_DATA_DIR=/path/to/folder; or (2) the Hugging Face hub, which SpecFit "
                "reads through the `datasets` library (openai/gsm8k 'main', abisee/cnn_dailymail '3.0.0'): needs the "
                "network once, with HF_HUB_OFFLINE and HF_DATASETS_OFFLINE unset; later runs read the datasets cache (set "
                "HF_HUB_OFFLINE=1 to read it without the network).")


def _read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    if not path.is_file():
        raise DataUnavailable(f"the data folder {path.parents[1]} has no {path.parent.name}/{path.name}. "
                              f"{WHERE_TO_GET}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def _from_hub(name: str, config: str | None, split: str, limit: int | None) -> list[dict]:
    """Rows of a hub dataset through ``datasets.load_dataset`` (its cache, the network unless offline). Online, one
    request through huggingface_hub first (its endpoint, proxies and token), so an unreachable hub is reported at
    once instead of after the download retries."""
    try:
        import datasets
        from huggingface_hub import HfApi

        if not datasets.config.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, as datasets reads them
            HfApi().dataset_info(name, timeout=10)
        spec = split if limit is None else f"{split}[:{limit}]"
        return [dict(r) for r in datasets.load_dataset(name, config, split=spec)]
    except Exception as err:  # offline and not cached, no network, hub down: say what was tried and what to do
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise DataUnavailable(f"no local data folder, and the hub dataset {name!r} could not be loaded "
                              f"({type(err).__name__}: {first}). {WHERE_TO_GET}") from err


def gsm8k(split: str = "test", limit: int | None = None) -> list[dict]:
    """GSM8K rows with ``question`` and ``answer``, in file order (the paper's subset is the first 80 of test)."""
    if split not in ("train", "test"):
        raise ValueError(f"GSM8K split must be 'train' or 'test', got {split!r}")
    root = data_dir()
    if root is not None:
        return _read_jsonl(root / "gsm8k" / f"{split}.jsonl", limit)
    return _from_hub("openai/gsm8k", "main", split, limit)


def cnn_dailymail(limit: int | None = None) -> list[dict]:
    """CNN/DailyMail test articles with ``article`` and ``highlights`` (or ``summary``), in file order."""
    root = data_dir()
    if root is not None:
        return _read_jsonl(root / "cnn_dailymail" / "test.jsonl", limit)
    return _from_hub("abisee/cnn_dailymail", "3.0.0", "test", limit)


def local_rows(folder: str, file: str, limit: int | None, what: str) -> list[dict]:
    """Rows read from the local data folder only (no hub copy is read: OpenStax, MT-Bench, HumanEval); a missing
    folder or file names the only remedy, a folder that holds it."""
    root = data_dir()
    if root is None or not (root / folder / file).is_file():
        where = "there is no local data folder" if root is None else f"the data folder {root} has none"
        raise DataUnavailable(f"{what} is only read from the local data folder ({folder}/{file}) and {where}; set "
                              f"SPECFIT_DATA_DIR to a folder that holds {folder}/{file}")
    return _read_jsonl(root / folder / file, limit)


def openstax(limit: int | None = None) -> list[dict]:
    """OpenStax textbook sections (``text``), CC BY 4.0; only available from the local data folder."""
    return local_rows("openstax", "train.jsonl", limit, "the OpenStax training text")


WORKLOADS = ("gsm8k", "cnn", "mtbench", "humaneval")
# the embedded drafter never saw these kinds of prompt: open questions of every kind (MT-Bench's first turns, in the
# question format) and Python function stubs (HumanEval's prompts, as they are)
UNSEEN = ("mtbench", "humaneval")


def prompts(workload: str, limit: int, max_chars: int | None = None) -> list[str]:
    """Prompt strings for a workload: ``"gsm8k"`` (test questions), ``"cnn"`` (test articles), ``"mtbench"``
    (MT-Bench first turns as questions) or ``"humaneval"`` (HumanEval function stubs)."""
    cut = (lambda text: text) if max_chars is None else (lambda text: text[:max_chars])
    if workload == "gsm8k":
        return [GSM8K_PROMPT.format(question=r["question"]) for r in gsm8k("test", limit)]
    if workload == "cnn":
        return [CNN_PROMPT.format(article=cut(r["article"])) for r in cnn_dailymail(limit)]
    if workload == "mtbench":
        rows = local_rows("mt_bench", "question.jsonl", limit, "MT-Bench")
        return [GSM8K_PROMPT.format(question=cut(r["turns"][0])) for r in rows]
    if workload == "humaneval":
        return [cut(r["prompt"]) for r in local_rows("humaneval", "HumanEval.jsonl", limit, "HumanEval")]
    raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")


def calibration_texts(num_prompts: int) -> list[str]:
    """The acceptance tables' calibration prompts (``acceptance_tables``): GSM8K *train* questions and CNN/DailyMail
    articles from the *end* of the test file (the benchmarks read its first rows), cut at 1500 characters,
    alternating."""
    gsm = [GSM8K_PROMPT.format(question=r["question"]) for r in gsm8k("train", num_prompts)]
    cnn = [CNN_PROMPT.format(article=r["article"][:1500]) for r in cnn_dailymail()[::-1][:num_prompts]]
    return ([t for pair in zip(gsm, cnn) for t in pair] + gsm[len(cnn):])[:num_prompts]
