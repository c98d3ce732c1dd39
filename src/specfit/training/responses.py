"""The drafter's training data: prompts answered by the TARGET itself (EAGLE / SpecForge's regenerated responses).

Prompts come from GSM8K *train* questions (``GSM8K_PROMPT``) and OpenStax passages: prose to continue, and a share
written like the summarisation benchmark (``CNN_PROMPT``, an OpenStax passage as the article) so that the drafter
sees that format. Never the GSM8K test questions or the CNN/DailyMail test articles: those are the benchmarks.

The target answers in left-padded batches (``generate`` with a real attention mask, eos = 0), some batches greedily
and some sampled at temperature 0.8. A *response* is the generated tokens up to and including the first eos. Each
record keeps prompt + response token ids; the loss mask covers the response tokens only. Every batch is seeded on its
own, and finished batches are cached in the work folder, so a rerun or a resumed run regenerates nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..evaluation.datasets import CNN_PROMPT, GSM8K_PROMPT, gsm8k, openstax
from .configs import ResponseConfig
from .tokenizer import EOS_ID, encode_batch

KINDS = ("gsm8k", "prose", "summary")
CACHE_NAME = "responses.pt"


# --------------------------------------------------------------------------------------------- prompts


def _paragraph_starts(text: str) -> list[int]:
    """Character offsets where a paragraph starts (the section start included)."""
    starts, i = [0], text.find("\n\n")
    while i >= 0:
        starts.append(i + 2)
        i = text.find("\n\n", i + 2)
    return [s for s in starts if s < len(text) - 200] or [0]


def prose_prompt(text: str, rng: random.Random, chars: tuple[int, int]) -> str:
    """A passage of ``chars`` characters from a paragraph start, cut after the last whole word."""
    start = rng.choice(_paragraph_starts(text))
    piece = text[start: start + rng.randint(*chars)]
    cut = piece.rstrip().rfind(" ")
    return piece[:cut] if cut > 0 else piece


def summary_prompt(text: str, rng: random.Random, chars: tuple[int, int]) -> str:
    """``CNN_PROMPT`` with a passage from a paragraph start as the article, cut at ``chars`` characters (mid-word,
    as the benchmark cuts its articles). Shorter than the benchmark's 1500 on average: training cost grows with the
    square of the length."""
    start = rng.choice(_paragraph_starts(text))
    return CNN_PROMPT.format(article=text[start: start + rng.randint(*chars)])


def build_prompts(cfg: ResponseConfig, gsm8k_rows: list[dict] | None = None,
                  openstax_rows: list[dict] | None = None) -> list[dict]:
    """``cfg.num_prompts`` prompts ``{"kind", "text"}`` in a seeded random order, kinds in ``cfg.shares``.

    Args:
        gsm8k_rows, openstax_rows: rows to use instead of the data folder's GSM8K *train* split and OpenStax text.
    """
    rng = random.Random(cfg.seed)
    gsm = list(gsm8k("train") if gsm8k_rows is None else gsm8k_rows)
    books = [r for r in (openstax() if openstax_rows is None else openstax_rows) if len(r["text"]) > 400]
    rng.shuffle(gsm)
    total = sum(cfg.shares.values())
    counts = {k: int(cfg.num_prompts * cfg.shares.get(k, 0) / total) for k in KINDS}
    counts["gsm8k"] += cfg.num_prompts - sum(counts.values())
    if counts["gsm8k"] > len(gsm):
        raise ValueError(f"{counts['gsm8k']} GSM8K prompts asked for, only {len(gsm)} train questions")
    prompts = [{"kind": "gsm8k", "text": GSM8K_PROMPT.format(question=r["question"])} for r in gsm[:counts["gsm8k"]]]
    for kind in ("prose", "summary"):
        for _ in range(counts[kind]):
            text = rng.choice(books)["text"]
            prompt = (prose_prompt(text, rng, cfg.prose_chars) if kind == "prose"
                      else summary_prompt(text, rng, cfg.article_chars))
            prompts.append({"kind": kind, "text": prompt})
    rng.shuffle(prompts)
    return prompts


# --------------------------------------------------------------------------------------------- responses


@dataclass
class Responses:
    """Prompt + response token ids per record; ``loss_mask`` is 1 on response tokens (eos included)."""

    sequences: list[torch.Tensor]  # int64 [len_i]
    prompt_lens: list[int]
    kinds: list[str]
    sampled: list[bool]

    def __len__(self) -> int:
        return len(self.sequences)

    def loss_mask(self, i: int) -> torch.Tensor:
        return (torch.arange(len(self.sequences[i])) >= self.prompt_lens[i]).long()

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded (with eos) ``input_ids`` [B, T] and the plain per-token ``loss_mask`` [B, T] (0 on padding)."""
        t = max(len(self.sequences[i]) for i in indices)
        ids = torch.full((len(indices), t), EOS_ID, dtype=torch.long)
        mask = torch.zeros(len(indices), t, dtype=torch.long)
        for row, i in enumerate(indices):
            n = len(self.sequences[i])
            ids[row, :n] = self.sequences[i]
            mask[row, :n] = self.loss_mask(i)
        return ids, mask

    def response_tokens(self, indices=None) -> torch.Tensor:
        """All loss-masked token ids of the given records, concatenated."""
        indices = range(len(self)) if indices is None else indices
        return torch.cat([self.sequences[i][self.prompt_lens[i]:] for i in indices])

    def summary(self, indices=None) -> dict:
        indices = list(range(len(self)) if indices is None else indices)
        out = {"records": len(indices), "sampled": sum(self.sampled[i] for i in indices),
               "prompt_tokens": sum(self.prompt_lens[i] for i in indices),
               "response_tokens": sum(len(self.sequences[i]) - self.prompt_lens[i] for i in indices),
               "ended_with_eos": sum(int(self.sequences[i][-1]) == EOS_ID for i in indices), "by_kind": {}}
        for kind in KINDS:
            ids = [i for i in indices if self.kinds[i] == kind]
            if ids:
                out["by_kind"][kind] = {
                    "records": len(ids),
                    "mean_prompt_tokens": sum(self.prompt_lens[i] for i in ids) / len(ids),
                    "mean_response_tokens": sum(len(self.sequences[i]) - self.prompt_lens[i] for i in ids) / len(ids)}
        return out


def fingerprint(model, prompts: list[dict], cfg: ResponseConfig) -> str:
    """Identifies what the responses depend on: the target's weights (a sample of them), the prompts and settings."""
    h = hashlib.sha256(json.dumps({"cfg": asdict(cfg), "prompts": prompts}, sort_keys=True).encode())
    for p in list(model.parameters())[::7]:
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _batches(lengths: list[int], cfg: ResponseConfig) -> list[tuple[list[int], bool]]:
    """Prompt indices per generate() call, similar lengths together (little padding); each batch greedy or sampled."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups = [order[i: i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
    rng = random.Random(cfg.seed + 1)
    return [(g, rng.random() < cfg.sample_share) for g in groups]


@torch.no_grad()
def generate_batch(model, prompt_ids: list[list[int]], max_new_tokens: int, sampled: bool, temperature: float,
                   seed: int) -> list[list[int]]:
    """Left-padded batched ``generate``; returns each prompt's response (up to and including the first eos)."""
    p = max(map(len, prompt_ids))
    ids = torch.full((len(prompt_ids), p), EOS_ID, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, prompt in enumerate(prompt_ids):
        ids[row, p - len(prompt):] = torch.tensor(prompt)
        attention[row, p - len(prompt):] = 1
    torch.manual_seed(seed)  # sampling draws from the global generator: seed each batch on its own
    kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
    out = model.generate(ids, attention_mask=attention, max_new_tokens=max_new_tokens, eos_token_id=EOS_ID,
                         pad_token_id=EOS_ID, **kwargs)
    responses = []
    for row in out[:, p:].tolist():
        end = row.index(EOS_ID) + 1 if EOS_ID in row else len(row)
        responses.append(row[:end])
    return responses


def generate_responses(model, tokenizer, prompts: list[dict], cfg: ResponseConfig, work: Path | None = None,
                       progress: bool = True) -> Responses:
    """Answer every prompt with the target; cache finished batches in ``work/responses.pt`` and reuse them.

    The cache is used only when its fingerprint (target weights, prompts, settings) matches.
    """
    from tqdm.auto import tqdm

    prompt_ids = encode_batch(tokenizer, [p["text"] for p in prompts])
    room = model.config.max_position_embeddings - cfg.max_new_tokens
    too_long = [i for i, ids in enumerate(prompt_ids) if len(ids) > room]
    if too_long:
        raise ValueError(f"{len(too_long)} prompts (e.g. #{too_long[0]}, {len(prompt_ids[too_long[0]])} tokens) leave "
                         f"no room for {cfg.max_new_tokens} new tokens within {model.config.max_position_embeddings}")
    key = fingerprint(model, prompts, cfg)
    path = work / CACHE_NAME if work is not None else None
    done: dict[int, list[int]] = {}
    if path is not None:
        work.mkdir(parents=True, exist_ok=True)
    if path is not None and path.is_file():
        saved = torch.load(path, weights_only=False)
        if saved["fingerprint"] == key:
            done = saved["responses"]
    batches = _batches([len(x) for x in prompt_ids], cfg)
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(batches), disable=not progress, desc="responses", mininterval=5.0, dynamic_ncols=True)
    for b, (indices, sampled) in enumerate(batches):
        if not all(i in done for i in indices):
            out = generate_batch(model, [prompt_ids[i] for i in indices], cfg.max_new_tokens, sampled,
                                 cfg.temperature, seed=cfg.seed * 1_000_003 + b)
            done.update(zip(indices, out))
            if path is not None:
                tmp = path.with_suffix(".tmp")
                torch.save({"fingerprint": key, "responses": done}, tmp)
                os.replace(tmp, path)
        bar.update(1)
    bar.close()
    model.train(was_training)
    sampled_of = {i: s for indices, s in batches for i in indices}
    return Responses(
        sequences=[torch.tensor(prompt_ids[i] + done[i], dtype=torch.long) for i in range(len(prompts))],
        prompt_lens=[len(prompt_ids[i]) for i in range(len(prompts))],
        kinds=[p["kind"] for p in prompts],
        sampled=[sampled_of[i] for i in range(len(prompts))])
