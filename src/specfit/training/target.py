"""``specfit train-target``: train the embedded Qwen3-MoE and its tokenizer from scratch, on CPU.

Recipe (see the feasibility note): a 4096-token byte-level BPE; ``Qwen3MoeForCausalLM`` with 64 experts top-4;
AdamW with warm-up then cosine decay over a fixed number of steps (reproducible, unlike a wall-clock budget);
random 512-token windows, half from GSM8K train and half from OpenStax; the router's load-balancing loss included.
Checkpoints (model, optimizer, sampler RNG, step) let ``--resume`` continue bit-exactly. The final folder holds
the model in bfloat16 safetensors, the tokenizer, ``generation_config.json``, a model card and
``training_report.json`` (validation, routing statistics and samples measured on the saved weights).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..evaluation.datasets import GSM8K_PROMPT, data_dir, gsm8k
from . import corpus, load_checkpoint
from .tokenizer import EOS_ID, load_tokenizer, train_tokenizer

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
CHECKPOINT = "checkpoint.pt"


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


def make_config(preset: str = "embedded", **overrides):
    """A ``Qwen3MoeConfig`` from a preset; ``output_router_logits`` is on (training needs the aux loss)."""
    from transformers import Qwen3MoeConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return Qwen3MoeConfig(**{**PRESETS[preset], **COMMON, "output_router_logits": True, **overrides})


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


# --------------------------------------------------------------------------------------------- data


def prepare_data(work: Path, vocab_size: int, seed: int, reuse: bool) -> tuple:
    """Tokenizer and encoded streams, cached in ``work`` so that a resumed run uses exactly the same ones.

    Returns (tokenizer, streams ``{"train"|"val": {source: int16 array}}``, corpus info dict).
    """
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


# --------------------------------------------------------------------------------------------- training loop


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


# --------------------------------------------------------------------------------------------- final artefacts


def save_final(model, tokenizer, out: Path) -> None:
    """Model in bfloat16 safetensors (router logits off, default experts implementation), tokenizer, generation config."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    model.to(torch.bfloat16).save_pretrained(out)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(out)
    for f in out.iterdir():
        f.chmod(0o644)  # the weights are written 0600; they ship in the package


@torch.no_grad()
def greedy_samples(model, tokenizer, questions: list[dict], max_new_tokens: int = 100) -> list[dict]:
    """Greedy continuations of GSM8K prompts (stops at eos)."""
    samples = []
    for row in questions:
        ids = tokenizer(GSM8K_PROMPT.format(question=row["question"]), return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        samples.append({"question": row["question"], "gold": row["answer"].split("####")[-1].strip(),
                        "completion": tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)})
    return samples


def measure(out: Path, streams: dict, seq_len: int, final_eval_windows: int, stats_windows: int) -> dict:
    """Validation CE, routing statistics and samples of the *saved* weights (bf16, loaded in fp32)."""
    from transformers import AutoModelForCausalLM

    from .routing_stats import gsm8k_test_windows, routing_stats

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = load_tokenizer(out)
    val = {}
    for s, a in streams["val"].items():
        w = corpus.fixed_windows(a, seq_len, final_eval_windows)
        ce = evaluate(model, w)
        val[s] = {"ce": ce, "ppl": math.exp(ce), "windows": len(w), "tokens": int(w[:, 1:].size)}
    stats_len = min(256, model.config.max_position_embeddings)
    stats = routing_stats(model, gsm8k_test_windows(tokenizer, stats_windows, stats_len))
    return {"val": val, "routing": stats, "samples": greedy_samples(model, tokenizer, gsm8k("test", 3))}


def _openstax_books(slugs: list[str]) -> tuple[list[str], list[str]]:
    """(book titles, author lines) from the data folder's ``openstax/NOTICE``; the slugs when there is none."""
    root = data_dir()
    notice = root / "openstax" / "NOTICE" if root is not None else None
    if notice is None or not notice.is_file():
        return slugs, []
    lines = notice.read_text(encoding="utf-8").splitlines()
    titles, authors, in_table = [], [], False
    for line in lines:
        if line.startswith("book (row field"):
            in_table = True
        elif in_table and not line.strip():
            in_table = False
        elif in_table:
            cells = [c for c in line.split("  ") if c.strip()]
            if len(cells) >= 3 and cells[0].strip() in slugs:
                titles.append(f"{cells[1].strip()} ({cells[2].strip()})")
        elif " is by " in line:
            authors.append(line.strip())
    return titles or slugs, authors


def model_card(report: dict) -> str:
    """The README.md of the saved model: what it is, its data and licenses, training, validation and routing."""
    from .routing_stats import format_tables, summary

    cfg, tr, val, corp = report["model_config"], report["train"], report["val"], report["corpus"]
    titles, authors = _openstax_books(corp["books"])
    tok = corp["tokens"]["train"]
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation", "license: apache-2.0", "---", "",
        "# SpecFit embedded target: a tiny Qwen3-MoE", "",
        f"A `Qwen3MoeForCausalLM` with {report['params'] / 1e6:.2f} M parameters ({cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}), trained from "
        "scratch on CPU as the demo and test target of SpecFit. It writes GSM8K-style worked answers and textbook "
        "prose; its arithmetic is mostly wrong. Its use is that its routing is learned and uneven, so expert "
        "reuse and draft acceptance measured on it are not noise.", "",
        "Weights are bfloat16 safetensors; load them in float32 on CPU:", "",
        "```python", "import torch", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)",
        "tokenizer = AutoTokenizer.from_pretrained(folder)",
        'ids = tokenizer("Question: ...\\nAnswer:", return_tensors="pt").input_ids',
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=100)[0]))", "```", "",
        "## Training data and licenses", "",
        "The weights are released under Apache-2.0, like the SpecFit package. They were trained on:", "",
        f"* **GSM8K train** (openai/grade-school-math, MIT license): {corp['documents']['train']['gsm8k']} examples "
        f"for training, {corp['documents']['val']['gsm8k']} held out for validation, written as "
        "`Question: {question}\\nAnswer: {answer}<|endoftext|>`. The GSM8K test split was not trained on.",
        f"* **OpenStax textbooks** (CC BY 4.0): {corp['documents']['train']['openstax']} book sections for "
        f"training, {corp['documents']['val']['openstax']} held out. The textbooks are by OpenStax, Rice University, "
        "https://openstax.org, licensed under CC BY 4.0 (https://creativecommons.org/licenses/by/4.0/). "
        "Changes made: text extracted, used to train this model. Books:", ""]
    lines += [f"  * {t}" for t in titles] + ([""] + [f"  {a}" for a in authors] if authors else []) + [""]
    lines += [
        "No CNN/DailyMail text was used. Training windows are drawn half from each source "
        f"({tok['gsm8k'] / 1e6:.2f} M GSM8K and {tok['openstax'] / 1e6:.2f} M OpenStax training tokens). The tokenizer "
        f"is a byte-level BPE with {corp['tokenizer_vocab']} tokens trained on the training text only; "
        "`<|endoftext|>` (id 0) is bos, eos and pad.", "",
        "## Configuration and training", "", "```json", json.dumps(cfg, indent=1), "```", "",
        (f"{report['steps']} AdamW steps in all ({tr['steps']} in phase 1): " if tr.get("continue_steps") else
         f"{report['steps']} AdamW steps: ")
        + f"{tr['batch_size']} x {tr['seq_len']} tokens per step "
        f"({report['tokens_seen'] / 1e6:.1f} M tokens), lr {tr['lr']} (betas {tuple(tr['betas'])}, weight decay "
        f"{tr['weight_decay']} except norms, router and embeddings), {tr['warmup_steps']} warm-up steps then cosine "
        f"to {tr['min_lr_ratio']:g} x lr, grad clip {tr['grad_clip']}, router aux loss coefficient "
        f"{cfg['router_aux_loss_coef']}, seed {tr['seed']}."
        + (f" Then a second phase of {tr['continue_steps']} steps: a warm restart to lr {tr['continue_lr']} over "
           f"{max(1, tr['warmup_steps'] // 2)} steps, cosine to {tr['min_lr_ratio'] * tr['lr']:g}, windows drawn from "
           f"GSM8K with probability {tr['continue_gsm8k_share']:g}." if tr.get("continue_steps") else "")
        + f" Training took {report['train_wall_s'] / 60:.1f} min on a shared 2-core CPU with {report['threads']} torch "
        f"thread(s). Command: `{report.get('command', 'specfit train-target')}`.", "",
        "## Validation (saved bf16 weights, evaluated in fp32)", "",
        "| held-out text | windows x tokens | cross-entropy (nats/token) | perplexity |", "|---|---|---|---|"]
    n_val = corp["documents"]["val"]
    lines += [f"| {name} | {v['windows']} x {tr['seq_len']} | {v['ce']:.3f} | {v['ppl']:.1f} |" for name, v in
              ((f"GSM8K val ({n_val['gsm8k']} held-out train examples)", val["gsm8k"]),
               (f"OpenStax val ({n_val['openstax']} held-out sections)", val["openstax"]))]
    lines += ["", f"Validation during training ({tr['eval_windows']} windows per source):", "",
              "| step | tokens | train CE | aux | val CE GSM8K | val CE OpenStax |", "|---|---|---|---|---|---|"]
    lines += [f"| {h['step']} | {h['tokens'] / 1e6:.2f} M | {h['train_ce']:.3f} | {h['aux']:.2f} | "
              f"{h['val_ce_gsm8k']:.3f} | {h['val_ce_openstax']:.3f} |" for h in report["history"]]
    lines += ["", "## Routing statistics (GSM8K test text, statistics only)", "", summary(report["routing"]), "",
              format_tables(report["routing"]), "## Greedy samples (GSM8K test questions)", ""]
    for i, s in enumerate(report["samples"], 1):
        lines += [f"{i}. {s['question']} (gold answer {s['gold']})", "", "   ```",
                  *[f"   {line}" for line in s["completion"].splitlines()], "   ```", ""]
    return "\n".join(lines)


def main(args) -> int:
    from . import default_work_dir

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
