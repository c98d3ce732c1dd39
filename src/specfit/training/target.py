"""``specfit train-target``: train the embedded Qwen3-MoE and its tokenizer from scratch, on CPU.

Recipe (see the feasibility note): a 4096-token byte-level BPE; ``Qwen3MoeForCausalLM`` with 64 experts top-4;
AdamW with warm-up then cosine decay over a fixed number of steps (reproducible, unlike a wall-clock budget);
random 512-token windows, half from GSM8K train and half from OpenStax; the router's load-balancing loss included.
Checkpoints (model, optimizer, sampler RNG, step) let ``--resume`` continue bit-exactly. The final folder holds
the model in bfloat16 safetensors, the tokenizer, ``generation_config.json``, a model card and
``training_report.json`` (validation, routing statistics and samples measured on the saved weights).

This module is the command: the model presets, the corpus and tokenizer it prepares, and the options. The loop and
its schedule are ``target_loop``; the saved folder, its measures and its model card are ``target_report``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from .. import cli_checks
from .configs import TrainConfig
from .tokenizer import EOS_ID

# Model presets. "embedded" is the shipped model: Qwen3-30B-A3B's depth (48 MoE layers) and expert fraction
# (top-4 of 64 = 1/16), as wide as lets target, drafter and route predictor ship in 30 MB (13.3 M params, bf16).
# "small" is the earlier 6-layer embedded model (5.59 M params), kept for tests; "tiny" is for smoke runs.
PRESETS = {
    "embedded": dict(vocab_size=4096, hidden_size=80, num_hidden_layers=48, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=20, num_experts=64, num_experts_per_tok=4,
                     moe_intermediate_size=16, intermediate_size=320, max_position_embeddings=1024),
    "small": dict(vocab_size=4096, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, num_experts=64, num_experts_per_tok=4,
                  moe_intermediate_size=32, intermediate_size=512, max_position_embeddings=1024),
    "tiny": dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64,
                 max_position_embeddings=256),
}
COMMON = dict(norm_topk_prob=True, tie_word_embeddings=True, router_aux_loss_coef=0.01,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)


def make_config(preset: str = "embedded", **overrides):
    """A ``Qwen3MoeConfig`` from a preset; ``output_router_logits`` is on (training needs the aux loss)."""
    from transformers import Qwen3MoeConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return Qwen3MoeConfig(**{**PRESETS[preset], **COMMON, "output_router_logits": True, **overrides})


# --------------------------------------------------------------------------------------------- data


def prepare_data(work: Path, vocab_size: int, seed: int, reuse: bool) -> tuple:
    """Tokenizer and encoded streams, cached in ``work`` so that a resumed run uses exactly the same ones.

    Returns (tokenizer, streams ``{"train"|"val": {source: int16 array}}``, corpus info dict).
    """
    import numpy as np

    from . import corpus
    from .tokenizer import load_tokenizer, train_tokenizer

    tok_dir, npz, info_path = work / "tokenizer", work / "streams.npz", work / "corpus.json"
    if reuse and tok_dir.is_dir() and npz.is_file() and info_path.is_file():
        arrays = np.load(npz)
        streams = {split: {s: arrays[f"{split}/{s}"] for s in corpus.SOURCES} for split in ("train", "val")}
        return load_tokenizer(tok_dir), streams, json.loads(info_path.read_text())
    books = corpus.openstax()
    splits = corpus.build_splits(seed=seed, openstax_rows=books)
    tokenizer = train_tokenizer(splits.all_train_text(), vocab_size=vocab_size)
    streams = {split: {s: corpus.encode_stream(tokenizer, docs) for s, docs in getattr(splits, split).items()}
               for split in ("train", "val")}
    info = {"documents": splits.sizes(),
            "tokens": {split: {s: int(len(a)) for s, a in d.items()} for split, d in streams.items()},
            "books": sorted({r["book"] for r in books}), "tokenizer_vocab": len(tokenizer)}
    tokenizer.save_pretrained(tok_dir)
    np.savez(npz, **{f"{split}/{s}": a for split, d in streams.items() for s, a in d.items()})
    info_path.write_text(json.dumps(info, indent=1))
    return tokenizer, streams, info


# --------------------------------------------------------------------------------------------- CLI


def check_arguments(args) -> None:
    """Every option, before anything heavy is imported."""
    cli_checks.at_least(args, 1, "steps", "batch_size", "seq_len", "eval_every", "ckpt_every", "final_eval_windows",
                        "stats_windows", "threads")
    cli_checks.at_least(args, 0, "warmup", "continue_steps", "stop_at")
    for name in ("lr", "continue_lr"):
        if not getattr(args, name) > 0:
            raise ValueError(f"{cli_checks.flag(name)} is a learning rate, > 0, got {getattr(args, name)}")
    cli_checks.fraction(args, "continue_gsm8k_share")
    if args.data_dir:
        cli_checks.folder(args.data_dir, "--data-dir")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r} is a file; it names the folder for the final model")
    cli_checks.writable(args.out, "--out")
    if args.work_dir:
        cli_checks.writable(args.work_dir, "--work-dir")


def main(args) -> int:
    import torch

    from . import default_work_dir
    from .target_loop import total_steps, train
    from .target_report import measure, model_card, save_final

    if args.data_dir:
        os.environ["SPECFIT_DATA_DIR"] = str(Path(args.data_dir).resolve())
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3MoeForCausalLM

    from .routing_stats import format_tables

    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else default_work_dir("train-target")
    work.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=args.warmup, eval_every=args.eval_every, ckpt_every=args.ckpt_every, seed=args.seed,
                      continue_steps=args.continue_steps, continue_lr=args.continue_lr,
                      continue_gsm8k_share=args.continue_gsm8k_share)
    t0 = time.time()
    tokenizer, streams, info = prepare_data(work, PRESETS[args.preset]["vocab_size"], cfg.seed, reuse=args.resume)
    print(f"corpus: {json.dumps(info['tokens'])}, tokenizer vocab {len(tokenizer)} ({time.time() - t0:.0f} s)")
    torch.manual_seed(cfg.seed)
    model = Qwen3MoeForCausalLM(make_config(args.preset))
    print(f"model: preset {args.preset}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params")
    state = train(model, streams, cfg, work, resume=args.resume, stop_at=args.stop_at, progress=not args.quiet)
    if state["step"] < total_steps(cfg):
        print(f"stopped at step {state['step']} of {total_steps(cfg)}; continue with --resume")
        return 0
    save_final(model, tokenizer, out)
    final = measure(out, streams, cfg.seq_len, args.final_eval_windows, args.stats_windows)
    report = {"preset": args.preset, "model_config": {**PRESETS[args.preset], **COMMON},
              "params": sum(p.numel() for p in model.parameters()), "train": asdict(cfg), "corpus": info,
              "threads": torch.get_num_threads(), "command": command_line(args),
              "steps": state["step"], "tokens_seen": state["step"] * cfg.batch_size * cfg.seq_len,
              "train_wall_s": round(state["train_wall_s"], 1), "process_wall_s": round(time.time() - t0, 1),
              "history": state["history"], **final}
    (out / "training_report.json").write_text(json.dumps(report, indent=1))
    (out / "README.md").write_text(model_card(report))
    report["folder_bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    (out / "training_report.json").write_text(json.dumps(report, indent=1))
    print(format_tables(final["routing"]))
    print(json.dumps(final["val"], indent=1))
    print(f"saved to {out} ({report['folder_bytes'] / 1e6:.1f} MB)")
    return 0


def command_line(args) -> str:
    """The command that reproduces this run: the options that shape the model and its training, folders left out."""
    import argparse

    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    base = vars(defaults.parse_args(["--out", "x"]))
    keep = ("preset", "steps", "seed", "batch_size", "seq_len", "lr", "warmup", "continue_steps", "continue_lr",
            "continue_gsm8k_share", "threads")
    extra = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in keep if getattr(args, k) != base[k]]
    return " ".join(["specfit train-target --out FOLDER", *extra])


def add_arguments(parser) -> None:
    d = TrainConfig()
    parser.add_argument("--out", required=True, help="folder for the final model, tokenizer, model card and report")
    parser.add_argument("--work-dir", help="folder for checkpoints and the encoded corpus "
                                           "(default: the user cache, ~/.cache/specfit/work/train-target)")
    parser.add_argument("--preset", default="embedded", choices=sorted(PRESETS), help="model size")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (the schedule's length)")
    parser.add_argument("--continue-steps", type=int, default=d.continue_steps,
                        help="a second phase of this many steps after --steps: a warm restart to --continue-lr, then "
                             "cosine down (a finished run can be extended with --resume)")
    parser.add_argument("--continue-lr", type=float, default=d.continue_lr,
                        help="the second phase's peak learning rate")
    parser.add_argument("--continue-gsm8k-share", type=float, default=d.continue_gsm8k_share,
                        help="share of the second phase's windows drawn from GSM8K (the rest from OpenStax)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for splits, init and window sampling")
    parser.add_argument("--data-dir", help="local data folder (else SPECFIT_DATA_DIR or ../shared/data)")
    parser.add_argument("--resume", action="store_true", help="continue from WORK_DIR/checkpoint.pt if present")
    parser.add_argument("--stop-at", type=int, help="stop after this step (checkpointed); finish later with --resume")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=d.warmup_steps, help="warm-up steps")
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validation passes")
    parser.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="steps between checkpoints")
    parser.add_argument("--final-eval-windows", type=int, default=128, help="validation windows per source at the end")
    parser.add_argument("--stats-windows", type=int, default=64, help="256-token GSM8K test windows for routing stats")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
