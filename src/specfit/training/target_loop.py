"""The target's training loop: ``TrainConfig``, the learning-rate schedule (``lr_at``, also the drafter's), AdamW
with its decay groups, one step (CE + the router's load-balancing loss), validation CE, and ``train``, which
checkpoints (model, optimizer, sampler RNG, step) so that ``--resume`` continues bit-exactly, and runs the optional
second phase (a warm restart on another data mixture) after ``steps``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import corpus, load_checkpoint
from .configs import TrainConfig

CHECKPOINT = "checkpoint.pt"


CONTINUATION = {"continue_steps": 0, "continue_lr": 1.5e-3, "continue_gsm8k_share": 0.5}


def total_steps(cfg: TrainConfig) -> int:
    return cfg.steps + cfg.continue_steps


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine to ``min_lr_ratio * lr``; in
    the second phase (steps ``cfg.steps``..), a linear warm restart to ``continue_lr`` over ``warmup_steps // 2``,
    then cosine to ``min_lr_ratio * lr``."""
    if step >= cfg.steps:
        k, warm = step - cfg.steps, max(1, cfg.warmup_steps // 2)
        if k < warm:
            return cfg.continue_lr * (k + 1) / warm
        progress = min(1.0, (k - warm) / max(1, cfg.continue_steps - warm))
        floor = cfg.min_lr_ratio * cfg.lr
        return floor + (cfg.continue_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the 2-D+ weights except the router (``mlp.gate``) and the (tied) embedding."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        exempt = p.ndim < 2 or "embed_tokens" in name or name.endswith("mlp.gate.weight")
        (no_decay if exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def train_step(model, windows: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """Forward and backward one batch ``[B, T + 1]``. Returns (loss, cross-entropy, aux load-balancing loss).

    The objective is HF's own with ``labels`` and ``output_router_logits``: CE + ``router_aux_loss_coef`` * aux;
    the CE is computed here so that every window's last token is a target too.
    """
    out = model(input_ids=windows[:, :-1], output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), windows[:, 1:].flatten())
    loss = ce + model.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return loss, ce.item(), out.aux_loss.item()


@torch.no_grad()
def evaluate(model, windows: np.ndarray, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over fixed windows ``[N, T + 1]``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = torch.from_numpy(windows[i: i + batch_size])
        logits = model(input_ids=w[:, :-1], use_cache=False).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def save_checkpoint(path: Path, model, opt, sampler, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "sampler": sampler.state_dict(),
                "torch_rng": torch.get_rng_state(), **state}, tmp)
    os.replace(tmp, path)  # atomic: an interrupted save never leaves a half-written checkpoint


def _phase2(cfg: TrainConfig) -> dict:
    return {k: getattr(cfg, k) for k in CONTINUATION}


def train(model, streams: dict, cfg: TrainConfig, work: Path, resume: bool = False, stop_at: int | None = None,
          progress: bool = True) -> dict:
    """Run (or continue) training to ``cfg.steps`` (+ ``cfg.continue_steps``); stop early after step ``stop_at``
    (checkpointed) if given.

    Returns the run state: ``step``, ``train_wall_s`` and ``history`` (one dict per validation pass).
    """
    from tqdm.auto import tqdm

    model.set_experts_implementation("grouped_mm")  # fastest on CPU; never batched_mm (30x slower)
    model.train()
    opt = make_optimizer(model, cfg)
    sampler = corpus.WindowSampler(streams["train"], cfg.seq_len, seed=cfg.seed)
    val = {s: corpus.fixed_windows(a, cfg.seq_len, cfg.eval_windows) for s, a in streams["val"].items()}
    state = {"step": 0, "train_wall_s": 0.0, "history": [], "config": asdict(cfg)}
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / CHECKPOINT
    if resume and ckpt.is_file():
        saved = load_checkpoint(ckpt, asdict(cfg), extensions=CONTINUATION)
        if saved["step"] > cfg.steps and saved.get("phase2") != _phase2(cfg):
            raise ValueError(f"{ckpt} is past step {cfg.steps} under another second phase ({saved.get('phase2')}); "
                             f"resume it with those settings")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sampler.load_state_dict(saved["sampler"])
        torch.set_rng_state(saved["torch_rng"])
        state = {k: saved[k] for k in state}
    state["phase2"] = _phase2(cfg)
    run_ce, run_aux, run_n = 0.0, 0.0, 0
    last = total_steps(cfg)
    bar = tqdm(total=last, initial=state["step"], disable=not progress, mininterval=5.0, dynamic_ncols=True)
    while state["step"] < last:
        t0 = time.perf_counter()
        step = state["step"]
        if step >= cfg.steps:  # the second phase's mixture (the sampler's random stream goes on unchanged)
            share = cfg.continue_gsm8k_share
            sampler.probs = np.array([share if src == "gsm8k" else 1.0 - share for src in sampler.sources])
            sampler.probs = sampler.probs / sampler.probs.sum()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        _, ce, aux = train_step(model, torch.from_numpy(sampler.sample(cfg.batch_size)))
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] = step = step + 1
        state["train_wall_s"] += time.perf_counter() - t0
        run_ce, run_aux, run_n = run_ce + ce, run_aux + aux, run_n + 1
        bar.update(1)
        bar.set_postfix(ce=f"{ce:.3f}", aux=f"{aux:.2f}", lr=f"{lr_at(step - 1, cfg):.1e}", refresh=False)
        if step % cfg.eval_every == 0 or step in (cfg.steps, last):
            record = {"step": step, "tokens": step * cfg.batch_size * cfg.seq_len,
                      "train_wall_s": round(state["train_wall_s"], 1), "lr": lr_at(step - 1, cfg),
                      "train_ce": run_ce / run_n, "aux": run_aux / run_n,
                      **{f"val_ce_{s}": evaluate(model, w) for s, w in val.items()}}
            state["history"].append(record)
            run_ce, run_aux, run_n = 0.0, 0.0, 0
            bar.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))
        if step % cfg.ckpt_every == 0 or step in (cfg.steps, last) or step == stop_at:
            save_checkpoint(ckpt, model, opt, sampler, state)
        if stop_at is not None and step >= stop_at:
            break
    bar.close()
    return state
