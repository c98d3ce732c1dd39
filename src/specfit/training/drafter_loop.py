"""The drafter's training loop: ``DrafterTrainConfig``, the frozen target as a teacher (``TargetTap``: features and
soft labels from the same hooks as at inference), the batches as a pure function of the step (``BatchPlan``), the
held-out TTT metrics per depth (``evaluate``), and ``train``, which checkpoints (drafter, optimizer, RNG, step) so
that ``--resume`` continues exactly.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from . import load_checkpoint
from .configs import DrafterTrainConfig
from .responses import Responses
from .target_loop import lr_at
from .ttt import ttt_loss

CHECKPOINT = "checkpoint.pt"


class TargetTap:
    """The frozen target as a teacher: ``tap(input_ids)`` -> features [B, T, 3Ht] (low, mid, high), logits [B, T, V],
    captured by the same hooks as at inference (``specfit.drafting.capture.AuxCapture``)."""

    def __init__(self, target, layer_ids):
        from ..drafting.capture import AuxCapture

        self.target, self.capture = target, AuxCapture(target, layer_ids)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.target(input_ids=input_ids, use_cache=False).logits  # right padding: no mask needed (causal)
        return self.capture.features(), logits.float()

    def remove(self) -> None:
        self.capture.remove()


class BatchPlan:
    """Training batches as a pure function of the step: epoch e is a permutation seeded by (seed, e), cut into
    groups of 16 batches sorted by length (little padding), batch order shuffled. Resuming needs only the step."""

    def __init__(self, lengths: list[int], indices: list[int], batch_size: int, seed: int, group: int = 16):
        if len(indices) < batch_size:
            raise ValueError(f"{len(indices)} training sequences, fewer than one batch of {batch_size}")
        self.lengths, self.indices, self.batch_size, self.seed, self.group = lengths, indices, batch_size, seed, group
        self.per_epoch = len(indices) // batch_size
        self._epoch: tuple[int, list] = (-1, [])

    def batch(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.per_epoch)
        if self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            order = [self.indices[i] for i in rng.permutation(len(self.indices))][: self.per_epoch * self.batch_size]
            span = self.group * self.batch_size
            batches = []
            for g in range(0, len(order), span):
                chunk = sorted(order[g: g + span], key=lambda i: self.lengths[i])
                batches += [chunk[b: b + self.batch_size] for b in range(0, len(chunk), self.batch_size)]
            self._epoch = (epoch, [batches[i] for i in rng.permutation(len(batches))])
        return self._epoch[1][k]


def fixed_batches(lengths: list[int], indices: list[int], batch_size: int) -> list[list[int]]:
    order = sorted(indices, key=lambda i: (lengths[i], i))
    return [order[b: b + batch_size] for b in range(0, len(order), batch_size)]


@torch.no_grad()
def evaluate(drafter, tap: TargetTap, data: Responses, batches: list[list[int]], steps: int, decay: float) -> dict:
    """Held-out TTT metrics per depth (teacher forced): mean soft CE ``loss`` and top-1 ``acc`` over masked positions."""
    sums = torch.zeros(3, steps)  # loss * count, acc * count, count
    for indices in batches:
        ids, mask = data.batch(indices)
        aux, logits = tap(ids)
        _, m = ttt_loss(drafter, aux, ids, logits, mask, steps=steps, decay=decay)
        sums += torch.stack([m["loss"] * m["count"], m["acc"] * m["count"], m["count"]]).cpu()
    n = sums[2].clamp(min=1)
    return {"loss": (sums[0] / n).tolist(), "acc": (sums[1] / n).tolist(), "positions": sums[2].long().tolist()}


# --------------------------------------------------------------------------------------------- training loop


def save_checkpoint(path: Path, drafter, opt, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(),
                **state}, tmp)
    os.replace(tmp, path)  # atomic: an interrupted save never leaves a half-written checkpoint


def train(drafter, target, data: Responses, train_idx: list[int], heldout_idx: list[int], cfg: DrafterTrainConfig,
          work: Path, resume: bool = False, stop_at: int | None = None, progress: bool = True) -> dict:
    """Run (or continue) training to ``cfg.steps``; stop early after step ``stop_at`` (checkpointed) if given.

    Returns the run state: ``step``, ``train_wall_s`` and ``history`` (one dict per held-out evaluation).
    """
    from tqdm.auto import tqdm

    target.eval().requires_grad_(False)
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    lengths = [len(s) for s in data.sequences]
    plan = BatchPlan(lengths, train_idx, cfg.batch_size, cfg.seed)
    held = fixed_batches(lengths, heldout_idx, cfg.batch_size)
    state = {"step": 0, "train_wall_s": 0.0, "history": [], "config": asdict(cfg), "run": [0.0] * 3 * cfg.ttt_steps}
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / CHECKPOINT
    if resume and ckpt.is_file():
        saved = load_checkpoint(ckpt, asdict(cfg))
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["torch_rng"])
        state = {k: saved[k] for k in state}
    tap = TargetTap(target, drafter.config.aux_layer_ids)
    run = torch.tensor(state["run"]).view(3, cfg.ttt_steps)  # loss * count, acc * count, count since last eval
    bar = tqdm(total=cfg.steps, initial=state["step"], disable=not progress, mininterval=5.0, dynamic_ncols=True)
    try:
        while state["step"] < cfg.steps:
            t0 = time.perf_counter()
            step = state["step"]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            ids, mask = data.batch(plan.batch(step))
            aux, logits = tap(ids)
            loss, m = ttt_loss(drafter, aux, ids, logits, mask, steps=cfg.ttt_steps, decay=cfg.decay)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            state["step"] = step = step + 1
            state["train_wall_s"] += time.perf_counter() - t0
            run += torch.stack([m["loss"] * m["count"], m["acc"] * m["count"], m["count"]])
            state["run"] = run.flatten().tolist()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in m["acc"].tolist()),
                            refresh=False)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                n = run[2].clamp(min=1)
                held_m = evaluate(drafter, tap, data, held, cfg.ttt_steps, cfg.decay)
                record = {"step": step, "train_wall_s": round(state["train_wall_s"], 1), "lr": lr_at(step - 1, cfg),
                          "train_loss": (run[0] / n).tolist(), "train_acc": (run[1] / n).tolist(),
                          "heldout_loss": held_m["loss"], "heldout_acc": held_m["acc"]}
                state["history"].append(record)
                run.zero_()
                state["run"] = run.flatten().tolist()
                bar.write(f"step {step} wall {record['train_wall_s']}s heldout acc "
                          + "/".join(f"{a:.3f}" for a in held_m["acc"]) + " loss "
                          + "/".join(f"{x:.3f}" for x in held_m["loss"]))
            if step % cfg.ckpt_every == 0 or step == cfg.steps or step == stop_at:
                save_checkpoint(ckpt, drafter, opt, state)
            if stop_at is not None and step >= stop_at:
                break
    finally:
        tap.remove()
        bar.close()
    return state


def split(data: Responses, heldout_fraction: float = 0.05, max_heldout: int = 64) -> tuple[list[int], list[int]]:
    """(train, held-out) record indices: the first records (the prompts are in a seeded random order) are held out."""
    n = min(max_heldout, max(1, round(heldout_fraction * len(data))))
    return list(range(n, len(data))), list(range(n))
