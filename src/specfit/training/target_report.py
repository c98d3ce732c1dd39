"""The trained target's folder and what is said about it: ``save_final`` writes the model (bfloat16 safetensors),
the tokenizer and ``generation_config.json``; ``measure`` takes the validation CE, routing statistics and greedy samples
on the SAVED weights; ``model_card`` writes them up as the folder's README.md (``openstax_books`` credits the books,
for the drafter's card too).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..evaluation.datasets import GSM8K_PROMPT, data_dir, gsm8k
from . import corpus
from .target_loop import evaluate
from .tokenizer import EOS_ID, load_tokenizer


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


def openstax_books(slugs: list[str]) -> tuple[list[str], list[str]]:
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
    titles, authors = openstax_books(corp["books"])
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
