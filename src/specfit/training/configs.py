"""The training commands' settings as plain dataclasses, their defaults the commands' option defaults: pure Python
(no torch), so ``specfit train-target --help`` and ``train-drafter --help`` and their option checks import nothing
heavy. Each is used (and re-exported) by its loop: ``target_loop``, ``drafter_loop``, ``responses``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1400            # optimizer steps; the schedule is defined over these, not over wall time
    batch_size: int = 8          # windows per step
    seq_len: int = 512           # CNN prompts reach ~450 tokens at inference: train on positions that far
    lr: float = 3e-3             # peak learning rate
    min_lr_ratio: float = 0.1    # cosine floor, as a fraction of lr
    warmup_steps: int = 100
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.1    # not on norms, router or embeddings
    grad_clip: float = 1.0
    # a second phase after `steps` (0: none): a warm restart to `continue_lr`, then cosine to min_lr_ratio * lr
    # over `continue_steps`, with windows drawn from GSM8K with probability `continue_gsm8k_share`. A run stopped
    # after phase 1 can be continued with these set (--resume): phase 1 is the same either way
    continue_steps: int = 0
    continue_lr: float = 1.5e-3
    continue_gsm8k_share: float = 0.5
    eval_every: int = 200        # steps between validation passes
    eval_windows: int = 16       # windows per source in a periodic validation pass
    ckpt_every: int = 200        # steps between checkpoints
    seed: int = 0


@dataclass(frozen=True)
class DrafterTrainConfig:
    steps: int = 1000            # optimizer steps; the schedule is defined over these, not over wall time
    batch_size: int = 8          # sequences per step (right-padded)
    lr: float = 2e-3             # peak learning rate
    min_lr_ratio: float = 0.05   # cosine floor, as a fraction of lr
    warmup_steps: int = 50
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0    # as the EAGLE reference
    grad_clip: float = 0.5       # SpecForge's max_grad_norm
    ttt_steps: int = 5           # TTT unroll depth: SpecFit's tree depth (EAGLE uses 7)
    decay: float = 0.8           # weight of TTT step j is decay**j
    eval_every: int = 200        # steps between held-out evaluations
    ckpt_every: int = 100        # steps between checkpoints
    seed: int = 0


@dataclass(frozen=True)
class ResponseConfig:
    num_prompts: int = 3200
    shares: dict = field(default_factory=lambda: {"gsm8k": 0.6, "prose": 0.25, "summary": 0.15})
    max_new_tokens: int = 128
    batch_size: int = 32          # prompts per generate() call
    sample_share: float = 0.5     # fraction of batches sampled (the rest greedy, as the benchmarks decode)
    temperature: float = 0.8
    prose_chars: tuple = (200, 1000)  # length range of a prose prompt, cut at a word boundary
    article_chars: tuple = (600, 1500)  # summary prompts: the passage cut in this range (the CNN prompts: 1500)
    seed: int = 0
