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
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

import specfit
from ..drafting.drafter import Eagle3Config, Eagle3Drafter
from . import load_checkpoint
from .responses import ResponseConfig, Responses, build_prompts, generate_responses
from .target_loop import lr_at
from .ttt import draft_vocab_from_counts, ttt_loss

EMBEDDED = Path(specfit.__file__).parent / "embedded"
CHECKPOINT = "checkpoint.pt"


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


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / mid / high outputs-of-layer ids, as EAGLE-3 picks them: (1, N//2-1, N-4), e.g. (1, 23, 44) for a
    48-layer target; where that repeats a layer (fewer than 8 layers: (1, 2, 2) for 6) the spread (1, N//2, N-1)."""
    eagle = Eagle3Config.default_aux_layer_ids(num_layers)
    if len(set(eagle)) == 3 and min(eagle) >= 0:
        return eagle
    return (min(1, num_layers - 1), num_layers // 2, num_layers - 1)


def make_drafter(target, d2t: torch.Tensor, t2d: torch.Tensor, intermediate_size: int = 512,
                 aux_layer_ids: tuple[int, int, int] | None = None, init_head: bool = True, seed: int = 0):
    """A one-layer drafter shaped like the target's layers, with the given draft vocabulary.

    ``init_head`` starts ``lm_head`` from the target's output rows of the draft vocabulary and ``norm`` from its final
    norm: the drafter then begins by reading its state the way the target reads its own.
    """
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


# --------------------------------------------------------------------------------------------- end-to-end measures


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


# --------------------------------------------------------------------------------------------- model card


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


# --------------------------------------------------------------------------------------------- CLI


def main(args) -> int:
    from . import default_work_dir

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
    parser.add_argument("--out", default=str(EMBEDDED / "drafter"), help="folder for the drafter, report and card")
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
