"""What is said about a trained drafter, all of it measured on the SAVED weights: held-out TTT accuracy per depth,
the mean acceptance length with ``generate(assistant="eagle3")`` on GSM8K and CNN/DailyMail test prompts and a
lossless check against plain ``generate()`` (``measure``), the acceptance model's starting tables
(``fit_acceptance``, written as ``acceptance.json``), and the model card (``model_card``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

import specfit
from .drafter_loop import DrafterTrainConfig, TargetTap, evaluate, fixed_batches
from .responses import Responses


@torch.no_grad()
def acceptance(target, tokenizer, prompts: list[str], assistant: str = "eagle3", max_new_tokens: int = 96) -> dict:
    """Greedy ``generate(assistant=...)`` over prompts on an enabled target; totals of the decode-phase counters."""
    cycles = committed = verified = new = 0
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, assistant=assistant)
        g = target.specfit.stats.last_generate
        cycles, committed, verified, new = (cycles + g.cycles, committed + g.tokens_committed,
                                            verified + g.nodes_verified, new + g.new_tokens)
    return {"prompts": len(prompts), "cycles": cycles, "tokens_committed": committed, "new_tokens": new,
            "acceptance_length": committed / max(1, cycles), "nodes_per_cycle": verified / max(1, cycles)}


def measure(target_dir: Path, out: Path, data: Responses, heldout_idx: list[int], cfg: DrafterTrainConfig,
            gsm_prompts: int = 20, cnn_prompts: int = 10, cnn_chars: int = 1500, max_new_tokens: int = 96,
            lossless_prompts: int = 3) -> dict:
    """Held-out TTT accuracy, acceptance on the GSM8K / CNN test prompts and a lossless check, all on the SAVED drafter."""
    from transformers import AutoModelForCausalLM

    from ..evaluation.datasets import prompts as benchmark_prompts
    from ..drafting.formats import load_drafter
    from .tokenizer import load_tokenizer

    def fresh_target():
        return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    tokenizer = load_tokenizer(target_dir)
    target = fresh_target()
    drafter = load_drafter(out, target=target, dtype=torch.float32)
    tap = TargetTap(target, drafter.config.aux_layer_ids)
    held = evaluate(drafter, tap, data, fixed_batches([len(s) for s in data.sequences], heldout_idx, cfg.batch_size),
                    cfg.ttt_steps, cfg.decay)
    tap.remove()

    workloads = {"gsm8k": benchmark_prompts("gsm8k", gsm_prompts),
                 "cnn": benchmark_prompts("cnn", cnn_prompts, max_chars=cnn_chars)}
    plain = {}
    for name, texts in workloads.items():  # the reference outputs, before SpecFit patches the model
        for text in texts[:lossless_prompts]:
            ids = tokenizer(text, return_tensors="pt").input_ids
            plain[text] = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    specfit.enable(target, cache_slots=target.config.num_experts, drafter=str(out))  # all experts resident
    results = {name: acceptance(target, tokenizer, texts, "eagle3", max_new_tokens) for name, texts in
               workloads.items()}
    lossless = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "specfit" without a calibrated cost profile: outputs only
        for text, expected in plain.items():
            ids = tokenizer(text, return_tensors="pt").input_ids
            for assistant in ("eagle3", "specfit"):
                out_ids = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, assistant=assistant)
                lossless &= bool(torch.equal(out_ids, expected))
    specfit.disable(target)
    return {"heldout": held, "acceptance": results, "acceptance_settings": {
        "assistant": "eagle3", "greedy": True, "max_new_tokens": max_new_tokens, "cache_slots": "all experts",
        "tree": "top-2, depth 5, 18-node pool, 7 nodes verified", "gsm8k": f"first {gsm_prompts} GSM8K test questions",
        "cnn": f"first {cnn_prompts} CNN/DailyMail test articles, cut at {cnn_chars} characters"},
        "lossless": {"prompts": len(plain), "assistants": ["eagle3", "specfit"], "equal_to_plain_generate": lossless}}


def fit_acceptance(target_dir: Path, out: Path, num_prompts: int = 24, max_new_tokens: int = 64,
                   seed: int = 0) -> dict:
    """The acceptance model's tables for the SAVED drafter, written beside it (``acceptance.json``); their meta."""
    from transformers import AutoModelForCausalLM

    from ..evaluation.acceptance_tables import calibration_prompts, fit_tables
    from ..selection.acceptance_model import FILENAME
    from .tokenizer import load_tokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    specfit.enable(target, cache_slots=target.config.num_experts, drafter=str(out))  # all experts resident
    try:
        tables = fit_tables(target, calibration_prompts(load_tokenizer(target_dir), num_prompts), max_new_tokens,
                            seed=seed)
    finally:
        specfit.disable(target)
    tables.save(out / FILENAME)
    (out / FILENAME).chmod(0o644)
    return tables.meta


def model_card(report: dict) -> str:
    from .target_report import openstax_books

    dc, tc, d = report["drafter_config"], report["train"], report["data"]
    titles, authors = openstax_books(report["openstax_books"])
    held = report["heldout"]
    depth_head = " | ".join(f"depth {j + 1}" for j in range(len(held["acc"])))
    lines = [
        "---", "license: apache-2.0", "tags: [eagle3, speculative-decoding, specfit]", "---", "",
        "# SpecFit embedded EAGLE-3 drafter", "",
        f"An EAGLE-3 drafter ({report['params'] / 1e3:.0f} k trainable parameters) for the SpecFit embedded target, "
        "the tiny Qwen3-MoE in `../target/`. One Llama-style decoder layer reads the fused outputs of target layers "
        f"{', '.join(map(str, dc['aux_layer_ids']))} (0-based, outputs of the layers: low, mid, high) and the "
        f"target's embedding of the next token, and scores a draft vocabulary of {dc['draft_vocab_size']} of the "
        f"target's {dc['vocab_size']} tokens. The token embedding is the target's and is not stored here.", "",
        "SpecForge layout (`config.json`, `model.safetensors` with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, "
        f"`t2d`; {report['weights_dtype']} weights, cast to the target's dtype at load); "
        "`eagle_config.eagle_aux_hidden_state_layer_ids` holds output-of-layer ids. Released under Apache-2.0, like the "
        "SpecFit package.", "",
        "```python", "import torch, specfit", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32)",
        "specfit.enable(target, cache_slots=64, drafter=drafter_folder)",
        'ids = AutoTokenizer.from_pretrained(target_folder)("Question: ...\\nAnswer:", return_tensors="pt").input_ids',
        'out = target.generate(ids, assistant="eagle3", max_new_tokens=96)', "```", "",
        "## Configuration", "", "```json", json.dumps(dc, indent=1), "```", "",
        "## Training data and licenses", "",
        "The drafter learns the target, so it was trained on text the **target generated** (as EAGLE and SpecForge "
        f"recommend): {d['records']} prompts answered by the target with up to {report['responses']['max_new_tokens']} "
        f"new tokens ({d['sampled']} sampled at temperature {report['responses']['temperature']}, the rest greedy), "
        f"{d['response_tokens']:,} response tokens in all; the loss covers the response tokens only. "
        "The prompts:", ""]
    kinds = d["by_kind"]
    describe = {"gsm8k": "**GSM8K train** questions (openai/grade-school-math, MIT license), as "
                         "`Question: {question}\\nAnswer:`. No GSM8K test question was used for training.",
                "prose": "**OpenStax** textbook passages to continue (a passage from a paragraph start, cut after a "
                         "whole word).",
                "summary": "**OpenStax** passages in the summarisation prompt format `Article: {passage}\\nSummary:` "
                           f"(cut at {report['responses']['article_chars'][0]}-{report['responses']['article_chars'][1]} "
                           "characters; the CNN/DailyMail benchmark prompts cut at 1500). No CNN/DailyMail text was used for training."}
    for kind, k in kinds.items():
        lines.append(f"* {k['records']} x {describe[kind]} Mean {k['mean_prompt_tokens']:.0f} prompt and "
                     f"{k['mean_response_tokens']:.0f} response tokens.")
    lines += ["", "The OpenStax textbooks are by OpenStax, Rice University, https://openstax.org, licensed under CC BY "
              "4.0 (https://creativecommons.org/licenses/by/4.0/). Changes made: text extracted, used as prompts. "
              "Books:", ""]
    lines += [f"* {t}" for t in titles] + ([""] + [f"  {a}" for a in authors] if authors else []) + [""]
    lines += [
        f"The draft vocabulary is the {dc['draft_vocab_size']} most frequent loss-masked tokens of the training "
        f"responses; they cover {report['draft_vocab_coverage']:.1%} of those tokens. {d['train_records']} records "
        f"were trained on; {d['heldout_records']} (their prompts) were held out for the metrics below.", "",
        "## Training", "",
        f"{report['steps']} AdamW steps of {tc['batch_size']} right-padded sequences, lr {tc['lr']} "
        f"(betas {tuple(tc['betas'])}, weight decay {tc['weight_decay']}), {tc['warmup_steps']} warm-up steps then "
        f"cosine to {tc['min_lr_ratio']:g} x lr, grad clip {tc['grad_clip']}, training-time test unrolled "
        f"{tc['ttt_steps']} steps with weights {tc['decay']}^j (the loss is a soft cross-entropy against the "
        "target's distribution restricted to the draft vocabulary). The target was frozen (fp32, under no_grad) and "
        "run on every batch for the features and the soft labels. `lm_head` started from the target's output rows of "
        f"the draft vocabulary, `norm` from its final norm. Seed {tc['seed']}. Response generation took "
        f"{report['generation_wall_s'] / 60:.1f} min and training {report['train_wall_s'] / 60:.1f} min on a shared "
        f"2-core CPU with {report['threads']} torch thread(s) (`specfit train-drafter`).", "",
        "## Results", "",
        "Held-out top-1 accuracy per depth (teacher-forced training-time test on held-out target responses: the "
        "drafter's argmax against the target's, depth j fed with the drafter's own states of depths < j):", "",
        f"| | {depth_head} |", "|---|" + "---|" * len(held["acc"]),
        "| top-1 accuracy | " + " | ".join(f"{a:.3f}" for a in held["acc"]) + " |",
        "| soft CE (nats) | " + " | ".join(f"{x:.3f}" for x in held["loss"]) + " |", "",
        "Mean acceptance length (tokens committed per cycle, the bonus token included) with "
        "`generate(assistant=\"eagle3\")`, greedy, "
        f"{report['acceptance_settings']['max_new_tokens']} new tokens, EAGLE-3 tree "
        f"({report['acceptance_settings']['tree']}), all experts resident:", "",
        "| workload | prompts | cycles | acceptance length | nodes verified per cycle |", "|---|---|---|---|---|"]
    for name, label in (("gsm8k", report["acceptance_settings"]["gsm8k"]), ("cnn", report["acceptance_settings"]["cnn"])):
        a = report["acceptance"][name]
        lines.append(f"| {label} | {a['prompts']} | {a['cycles']} | {a['acceptance_length']:.2f} | "
                     f"{a['nodes_per_cycle']:.2f} |")
    ll = report["lossless"]
    lines += ["", f"Greedy output with both assistants equals plain `generate()` on {ll['prompts']} of these prompts: "
              f"{ll['equal_to_plain_generate']}.", ""]
    tables = report.get("acceptance_tables")
    if tables:
        lines += ["`acceptance.json` holds SpecFit's acceptance model's starting tables for this drafter (greedy and "
                  "sampling acceptance by depth, sibling rank and draft probability), fitted on labels from the "
                  f"EAGLE-3 assistant on {tables['prompts']} calibration prompts (GSM8K train questions, CNN/DailyMail "
                  f"articles from the end of the test file; {tables['labels']['greedy']} greedy and "
                  f"{tables['labels']['sampling']} sampling labels). Refit with "
                  "`specfit calibrate --acceptance-only --drafter FOLDER`.", ""]
    lines += ["Held-out metrics during training:", "",
              "| step | train wall (s) | lr | held-out acc per depth | held-out loss per depth |", "|---|---|---|---|---|"]
    lines += [f"| {h['step']} | {h['train_wall_s']} | {h['lr']:.2e} | " + " / ".join(f"{a:.3f}" for a in h["heldout_acc"])
              + " | " + " / ".join(f"{x:.3f}" for x in h["heldout_loss"]) + " |" for h in report["history"]]
    return "\n".join(lines) + "\n"
