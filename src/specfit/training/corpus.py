"""Training text for the embedded target: GSM8K train + OpenStax prose, split, encoded and sampled as windows.

Never the GSM8K test questions or the CNN/DailyMail test articles: those are the benchmarks. A GSM8K document is
written exactly as the inference prompt continues, ``"Question: {q}\\nAnswer:" + " " + answer + "<|endoftext|>"``.

Vocabulary: a *source* is ``"gsm8k"`` or ``"openstax"``; a *stream* is one source's documents encoded and
concatenated (``<|endoftext|>`` between them); a *window* is ``seq_len + 1`` consecutive stream tokens, the input
plus its shifted targets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from ..evaluation.datasets import EOS_TEXT, GSM8K_PROMPT, gsm8k, openstax

SOURCES = ("gsm8k", "openstax")
# Half the windows from each source: GSM8K is the main benchmark and would be drowned by the ~5x larger OpenStax.
DEFAULT_MIXTURE = {"gsm8k": 0.5, "openstax": 0.5}


def gsm8k_document(row: dict) -> str:
    """One GSM8K example in the inference prompt format, answer and eos appended."""
    return GSM8K_PROMPT.format(question=row["question"]) + " " + row["answer"] + EOS_TEXT


def openstax_document(row: dict) -> str:
    """One OpenStax section (title, blank line, body) with eos appended."""
    return row["text"] + EOS_TEXT


@dataclass
class Splits:
    """Documents per source: ``train[source]`` and ``val[source]`` are lists of strings."""

    train: dict[str, list[str]] = field(default_factory=dict)
    val: dict[str, list[str]] = field(default_factory=dict)

    def all_train_text(self) -> list[str]:
        return [doc for source in SOURCES for doc in self.train.get(source, [])]

    def sizes(self) -> dict:
        return {split: {s: len(docs) for s, docs in getattr(self, split).items()} for split in ("train", "val")}


def build_splits(seed: int = 0, gsm8k_val: int = 300, openstax_val_frac: float = 0.02,
                 gsm8k_rows: list[dict] | None = None, openstax_rows: list[dict] | None = None) -> Splits:
    """Shuffle each source with ``seed`` and hold out a validation part of each.

    Args:
        seed: shuffles the GSM8K train rows and the OpenStax sections (``random.Random(seed)``).
        gsm8k_val: GSM8K *train* examples held out for validation.
        openstax_val_frac: fraction of OpenStax sections held out (at least one).
        gsm8k_rows, openstax_rows: rows to use instead of reading the data folder (tests build them in code).
    """
    rng = random.Random(seed)
    gsm = list(gsm8k("train") if gsm8k_rows is None else gsm8k_rows)
    book = list(openstax() if openstax_rows is None else openstax_rows)
    if len(gsm) <= gsm8k_val:
        raise ValueError(f"{len(gsm)} GSM8K train rows leave none for training after holding out {gsm8k_val}")
    rng.shuffle(gsm)
    rng.shuffle(book)
    n_book_val = max(1, round(openstax_val_frac * len(book)))
    return Splits(
        train={"gsm8k": [gsm8k_document(r) for r in gsm[gsm8k_val:]],
               "openstax": [openstax_document(r) for r in book[n_book_val:]]},
        val={"gsm8k": [gsm8k_document(r) for r in gsm[:gsm8k_val]],
             "openstax": [openstax_document(r) for r in book[:n_book_val]]},
    )


def encode_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """Encode documents and concatenate them: int16 when the vocabulary fits, else int32. ``[num_tokens]``"""
    from .tokenizer import encode_batch

    dtype = np.int16 if len(tokenizer) <= np.iinfo(np.int16).max else np.int32
    ids = encode_batch(tokenizer, docs)
    return np.fromiter((t for doc in ids for t in doc), dtype=dtype, count=sum(map(len, ids)))


def fixed_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping consecutive windows from the start of a stream, for deterministic evaluation.

    Returns ``[num_windows, seq_len + 1]`` int64 (input ``[:, :-1]``, targets ``[:, 1:]``).
    """
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    return np.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)


class WindowSampler:
    """Random training windows drawn from several streams by a mixture; its state is one picklable dict.

    Each window first picks a source with probability ``mixture[source]``, then a uniform start in that stream.
    """

    def __init__(self, streams: dict[str, np.ndarray], seq_len: int, mixture: dict[str, float] | None = None,
                 seed: int = 0):
        mixture = dict(DEFAULT_MIXTURE if mixture is None else mixture)
        self.sources = [s for s in streams if mixture.get(s, 0) > 0]
        for s in self.sources:
            if len(streams[s]) <= seq_len + 1:
                raise ValueError(f"stream {s!r} has {len(streams[s])} tokens, fewer than a window of {seq_len + 1}")
        weights = np.array([mixture[s] for s in self.sources], dtype=np.float64)
        self.probs = weights / weights.sum()
        self.streams, self.seq_len = streams, seq_len
        self.rng = np.random.default_rng(seed)

    def sample(self, batch_size: int) -> np.ndarray:
        """``[batch_size, seq_len + 1]`` int64 token windows."""
        picks = self.rng.choice(len(self.sources), size=batch_size, p=self.probs)
        out = np.empty((batch_size, self.seq_len + 1), dtype=np.int64)
        for i, src in enumerate(picks):
            stream = self.streams[self.sources[src]]
            start = self.rng.integers(0, len(stream) - self.seq_len - 1)
            out[i] = stream[start: start + self.seq_len + 1]
        return out

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
