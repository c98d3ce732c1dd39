"""Fitting the acceptance model's starting tables for a drafter (``acceptance.json`` beside it).

The records are labels of drafted children (``decoding/acceptance.py`` ``child_labels``), collected by decoding
calibration prompts with the EAGLE-3 assistant: it drafts the full pool and verifies 7 nodes per cycle, so every
cycle labels many children at every depth and rank, chosen by the drafter's own ranking rather than by the model
being fitted. Greedy runs give the greedy table (every drafted child of the root and of each verified node: 1 when
it is the target's argmax there); sampling runs (``temperature``, seeded) give the sampling table (the children of
the root and of the accepted nodes: the target's probability of the child's token).

Calibration prompts: GSM8K *train* questions and CNN/DailyMail articles from the *end* of the local test file (the
benchmark, the demo and the regression read its first rows), half each. ``specfit calibrate --acceptance-only``
(re)fits the tables of an existing drafter; ``specfit train-drafter`` fits them for the drafter it trains.
"""

from __future__ import annotations

import time

import torch

from ..decoding.acceptance import child_labels
from ..decoding.assistants import Eagle3Generator
from ..selection.acceptance_model import AcceptanceTable, AcceptanceTables

MAX_PROMPT_TOKENS = 450


class LabelRecorder(Eagle3Generator):
    """The EAGLE-3 assistant, recording ``(depth, rank, q, label)`` for every child it gets a label for
    (``per_cycle``: one list of them per cycle)."""

    def __init__(self, model, records: list, per_cycle: bool = False):
        super().__init__(model)
        self.records, self.per_cycle = records, per_cycle

    def learn(self, tree, layout, acc, choices, sampling):
        nodes, labels = child_labels(tree, layout, acc, choices, sampling)
        cycle = [(tree.depths[v], tree.ranks[v], tree.qs[v], y) for v, y in zip(nodes, labels)]
        if self.per_cycle:
            self.records.append(cycle)
        else:
            self.records += cycle


def collect(model, prompts: list[torch.Tensor], sampling: bool = False, max_new_tokens: int = 64,
            temperature: float = 1.0, seed: int = 0, progress=None) -> list[tuple]:
    """Labels from decoding ``prompts`` ([1, P] token ids) on an enabled model with a drafter."""
    records: list[tuple] = []
    kwargs = dict(do_sample=True, temperature=temperature) if sampling else dict(do_sample=False)
    if sampling:
        torch.manual_seed(seed)
    for i, ids in enumerate(prompts):
        model.generate(ids.to(model.specfit.device), max_new_tokens=max_new_tokens,
                       assistant=lambda m: LabelRecorder(m, records), **kwargs)
        if progress is not None:
            progress(i + 1)
    return records


def collect_cycles(model, prompts: list[torch.Tensor], max_new_tokens: int = 64) -> list[list[list[tuple]]]:
    """Greedy labels per prompt ([1, P] token ids) and cycle, in the order an acceptance model would learn them
    (``reliability.replay``)."""
    streams: list[list] = []
    for ids in prompts:
        streams.append([])
        model.generate(ids.to(model.specfit.device), max_new_tokens=max_new_tokens, do_sample=False,
                       assistant=lambda m: LabelRecorder(m, streams[-1], per_cycle=True))
    return streams


def calibration_prompts(tokenizer, num_prompts: int, texts: list[str] | None = None) -> list[torch.Tensor]:
    """``datasets.calibration_texts(num_prompts)`` (or ``texts``, read before) as token ids, the last 450 tokens of
    each."""
    from . import datasets

    texts = datasets.calibration_texts(num_prompts) if texts is None else texts
    return [tokenizer(t, return_tensors="pt").input_ids[:, -MAX_PROMPT_TOKENS:] for t in texts]


def fit_tables(model, prompts: list[torch.Tensor], max_new_tokens: int = 64, temperature: float = 1.0,
               seed: int = 0, progress=None) -> AcceptanceTables:
    """Greedy and sampling tables for the drafter attached to ``model`` (all experts resident is fastest)."""
    t0 = time.perf_counter()
    greedy = collect(model, prompts, False, max_new_tokens, progress=progress)
    sampling = collect(model, prompts, True, max_new_tokens, temperature, seed,
                       progress=None if progress is None else (lambda i: progress(len(prompts) + i)))
    meta = {"source": "specfit.evaluation.acceptance_tables.fit_tables", "assistant": "eagle3",
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "sampling_temperature": temperature,
            "seed": seed, "labels": {"greedy": len(greedy), "sampling": len(sampling)},
            "tree": {name: getattr(model.specfit.options, name) for name in ("topk", "depth", "pool_nodes",
                                                                           "max_nodes")},
            "seconds": round(time.perf_counter() - t0, 1)}
    return AcceptanceTables(AcceptanceTable.fit(greedy), AcceptanceTable.fit(sampling), meta)


def describe(tables: AcceptanceTables) -> str:
    """Acceptance by rank and q-bin per mode, with the mean q: what the tables say, compactly."""
    lines = []
    for mode in ("greedy", "sampling"):
        table = tables[mode]
        lines.append(f"{mode}: {table.labels:.0f} labels; accepted fraction by rank and q-bin (labels)")
        edges = ["0"] + [f"{e:.3f}" for e in table.edges] + ["1"]
        for rank in range(1, table.max_rank + 1):
            cells = []
            for b in range(len(table.edges) + 1):
                s = sum(v[0] for k, v in table.counts.items() if k[1] == rank and k[2] == b)
                n = sum(v[1] for k, v in table.counts.items() if k[1] == rank and k[2] == b)
                if n:
                    cells.append(f"q {edges[b]}-{edges[b + 1]}: {s / n:.2f} ({n:.0f})")
            if cells:
                lines.append(f"  rank {rank}: " + ", ".join(cells))
    return "\n".join(lines)
