"""``specfit train-drafter``: train the embedded EAGLE-3 drafter on the target's own responses, on CPU.

Recipe (notes: eagle3.md §4). The data are prompts answered by the target (``responses``). The draft vocabulary is
the most frequent loss-masked tokens. Each step runs the frozen fp32 target under ``no_grad`` on a right-padded
batch; forward hooks on its decoder layers ``aux_layer_ids`` give the three features (low, mid, high), and its
logits are the soft labels. The loss is the training-time-test unroll of ``ttt_loss`` (``--ttt-steps`` deep,
weights 0.8^j). AdamW with warm-up then cosine over a fixed number of steps; checkpoints (drafter, optimizer, RNG,
step) let ``--resume`` continue exactly. The final folder holds the drafter in the SpecForge layout (no embedding:
it is the target's), ``training_report.json``, a model card and ``acceptance.json``, the acceptance model's starting
tables for this drafter (``evaluation/acceptance_tables.py``). The report's held-out per-depth accuracy is measured
on the saved weights, and the mean acceptance length end to end with ``generate(assistant="eagle3")``.

This module is the command: the draft vocabulary, the drafter's shape and initialisation, and the options. The loop
is ``drafter_loop``; the measures on the saved drafter and its model card are ``drafter_report``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import specfit
from .. import cli_checks
from .configs import DrafterTrainConfig, ResponseConfig

EMBEDDED = Path(specfit.__file__).parent / "embedded"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / mid / high outputs-of-layer ids, as EAGLE-3 picks them: (1, N//2-1, N-4), e.g. (1, 23, 44) for a
    48-layer target; where that repeats a layer (fewer than 8 layers: (1, 2, 2) for 6) the spread (1, N//2, N-1)."""
    from ..drafting.drafter import Eagle3Config

    eagle = Eagle3Config.default_aux_layer_ids(num_layers)
    if len(set(eagle)) == 3 and min(eagle) >= 0:
        return eagle
    return (min(1, num_layers - 1), num_layers // 2, num_layers - 1)


def make_drafter(target, d2t, t2d, intermediate_size: int = 512,
                 aux_layer_ids: tuple[int, int, int] | None = None, init_head: bool = True, seed: int = 0):
    """A one-layer drafter shaped like the target's layers, with the given draft vocabulary.

    ``init_head`` starts ``lm_head`` from the target's output rows of the draft vocabulary and ``norm`` from its final
    norm: the drafter then begins by reading its state the way the target reads its own. ``d2t``, ``t2d``: the
    vocabulary maps (tensors, ``ttt.draft_vocab_from_counts``).
    """
    import torch

    from ..drafting.drafter import Eagle3Config, Eagle3Drafter

    c = target.config
    config = Eagle3Config.from_target(c, draft_vocab_size=len(d2t), intermediate_size=intermediate_size)
    config = replace(config, aux_layer_ids=aux_layer_ids or default_aux_layers(c.num_hidden_layers))  # sorts them
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        if init_head:
            used = torch.arange(len(d2t)) + d2t
            drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[used])
            drafter.norm.weight.copy_(target.model.norm.weight)
    drafter.set_embedding(target.get_input_embeddings())
    return drafter


# --------------------------------------------------------------------------------------------- CLI


def check_arguments(args) -> None:
    """Every option, before anything heavy is imported: the target folder, the counts, the rates."""
    config = cli_checks.moe_folder(args.target, "--target") / "config.json"
    vocab = json.loads(config.read_text()).get("vocab_size")
    cli_checks.at_least(args, 1, "steps", "num_prompts", "max_new_tokens", "draft_vocab", "ttt_steps",
                        "intermediate_size", "batch_size", "eval_every", "ckpt_every", "eval_new_tokens",
                        "acceptance_prompts", "threads")
    cli_checks.at_least(args, 0, "warmup", "stop_at", "eval_gsm8k", "eval_cnn")
    if isinstance(vocab, int) and args.draft_vocab > vocab:
        raise ValueError(f"--draft-vocab must be <= the target's vocabulary ({vocab} in {config}), got "
                         f"{args.draft_vocab}")
    if not args.lr > 0:
        raise ValueError(f"--lr is a learning rate, > 0, got {args.lr}")
    if args.data_dir:
        cli_checks.folder(args.data_dir, "--data-dir")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out!r} is a file; it names the folder for the drafter")
    cli_checks.writable(args.out, "--out")
    if args.work_dir:
        cli_checks.writable(args.work_dir, "--work-dir")


def main(args) -> int:
    import torch

    from . import default_work_dir
    from .drafter_loop import split, train
    from .drafter_report import fit_acceptance, measure, model_card
    from .responses import build_prompts, generate_responses
    from .ttt import draft_vocab_from_counts

    if args.data_dir:
        os.environ["SPECFIT_DATA_DIR"] = str(Path(args.data_dir).resolve())
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from ..drafting.formats import save_drafter
    from .tokenizer import load_tokenizer

    target_dir, out = Path(args.target), Path(args.out)
    work = Path(args.work_dir) if args.work_dir else default_work_dir("train-drafter")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tokenizer = load_tokenizer(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    target.set_experts_implementation("grouped_mm")  # fastest on CPU for batches
    rcfg = ResponseConfig(num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, seed=args.seed)
    prompts = build_prompts(rcfg)
    data = generate_responses(target, tokenizer, prompts, rcfg, work, progress=not args.quiet)
    generation_wall = time.time() - t0
    train_idx, heldout_idx = split(data)
    print(f"responses: {json.dumps(data.summary())} ({generation_wall:.0f} s)")

    vocab = target.config.vocab_size
    counts = torch.bincount(data.response_tokens(train_idx), minlength=vocab)
    d2t, t2d = draft_vocab_from_counts(counts, args.draft_vocab, vocab)
    coverage = float(counts[t2d].sum() / counts.sum())
    print(f"draft vocab {args.draft_vocab} of {vocab} covers {coverage:.1%} of the training response tokens")
    cfg = DrafterTrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup,
                             ttt_steps=args.ttt_steps, eval_every=args.eval_every, ckpt_every=args.ckpt_every,
                             seed=args.seed)
    drafter = make_drafter(target, d2t, t2d, intermediate_size=args.intermediate_size, seed=cfg.seed)
    params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {params / 1e3:.0f} k params, aux layers {drafter.config.aux_layer_ids}")
    state = train(drafter, target, data, train_idx, heldout_idx, cfg, work, resume=args.resume, stop_at=args.stop_at,
                  progress=not args.quiet)
    if state["step"] < cfg.steps:
        print(f"stopped at step {state['step']} of {cfg.steps}; continue with --resume")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    save_drafter(drafter, out, dtype=getattr(torch, args.save_dtype))  # measured below as saved
    for f in ("config.json", "model.safetensors"):
        (out / f).chmod(0o644)
    del target
    final = measure(target_dir, out, data, heldout_idx, cfg, gsm_prompts=args.eval_gsm8k, cnn_prompts=args.eval_cnn,
                    max_new_tokens=args.eval_new_tokens)
    final["acceptance_tables"] = fit_acceptance(target_dir, out, args.acceptance_prompts, args.eval_new_tokens,
                                                seed=args.seed)
    report = {
        "drafter_config": drafter.config.to_dict(), "params": params, "train": asdict(cfg),
        "responses": asdict(rcfg),
        "data": {**data.summary(), "train_records": len(train_idx), "heldout_records": len(heldout_idx)},
        "openstax_books": sorted({r["book"] for r in _openstax_rows()}), "draft_vocab_coverage": coverage,
        "threads": torch.get_num_threads(), "steps": state["step"],
        "weights_dtype": args.save_dtype,  # as saved (training ran in float32)
        "generation_wall_s": round(generation_wall, 1), "train_wall_s": round(state["train_wall_s"], 1),
        "process_wall_s": round(time.time() - t0, 1), "history": state["history"], **final}
    (out / "training_report.json").write_text(json.dumps(report, indent=1))
    (out / "README.md").write_text(model_card(report))
    report["folder_bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    (out / "training_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: final[k] for k in ("heldout", "acceptance", "lossless")}, indent=1))
    print(f"saved to {out} ({report['folder_bytes'] / 1e6:.2f} MB)")
    return 0


def _openstax_rows() -> list[dict]:
    from ..evaluation.datasets import openstax

    try:
        return openstax()
    except Exception:  # the model card then names no books
        return []


def add_arguments(parser) -> None:
    d, r = DrafterTrainConfig(), ResponseConfig()
    parser.add_argument("--target", default=str(EMBEDDED / "target"), help="target model folder (with tokenizer)")
    parser.add_argument("--out", required=True,
                        help=f"folder for the drafter, report and card (to replace the shipped one in a source "
                             f"checkout: {EMBEDDED / 'drafter'}; nothing is written into an installed package "
                             f"unless you name it)")
    parser.add_argument("--work-dir", help="folder for responses and checkpoints "
                                           "(default: the user cache, ~/.cache/specfit/work/train-drafter)")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (the schedule's length)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for prompts, sampling, init and batches")
    parser.add_argument("--resume", action="store_true", help="continue from WORK_DIR/checkpoint.pt if present")
    parser.add_argument("--stop-at", type=int, help="stop after this step (checkpointed); finish later with --resume")
    parser.add_argument("--num-prompts", type=int, default=r.num_prompts, help="prompts answered by the target")
    parser.add_argument("--max-new-tokens", type=int, default=r.max_new_tokens, help="response length limit")
    parser.add_argument("--draft-vocab", type=int, default=2048, help="draft vocabulary size (of the target's)")
    parser.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="training-time-test unroll depth")
    parser.add_argument("--intermediate-size", type=int, default=512, help="drafter MLP width")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=d.warmup_steps, help="warm-up steps")
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between held-out evaluations")
    parser.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="steps between checkpoints")
    parser.add_argument("--eval-new-tokens", type=int, default=96, help="new tokens per acceptance prompt")
    parser.add_argument("--eval-gsm8k", type=int, default=20, help="GSM8K test questions for the acceptance length")
    parser.add_argument("--eval-cnn", type=int, default=10, help="CNN/DailyMail test articles for the acceptance length")
    parser.add_argument("--acceptance-prompts", type=int, default=24,
                        help="calibration prompts for the acceptance model's tables (acceptance.json)")
    parser.add_argument("--save-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="dtype of the saved weights (bfloat16 halves the file; the figures are measured on "
                             "the saved drafter)")
    parser.add_argument("--data-dir", help="local data folder (else SPECFIT_DATA_DIR or ../shared/data)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
