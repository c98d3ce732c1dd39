"""``specfit calibrate``: fit the cycle-time model ``intercepts[n] + beta * demand`` on this machine.

A probe is one real decoding cycle in which the verified subtree is a random ancestor-closed subset of the full
draft pool (``calibration/probes.json`` defines the probe and its defaults). Each probe yields a record
(nodes verified, expert demand of the verify forward, timed seconds, with the drafting part replaced by its mean over all probes); ``CostModel.fit`` solves the NNLS problem and
the profile is written to the user cache, where ``specfit.enable`` finds it.
"""

from __future__ import annotations

import json
import random
import time
from importlib.resources import files

import torch

from ..decoding.assistants import Eagle3Generator
from ..selection.cost_model import CostModel, Record, profile_path
from ..selection.profiles import device_name, model_id

PROBES = json.loads(files("specfit.calibration").joinpath("probes.json").read_text())


class ProbeGenerator(Eagle3Generator):
    """Drafts the full pool, then verifies a random ancestor-closed subtree of uniform random size."""

    def __init__(self, model, rng: random.Random):
        super().__init__(model)
        self.rng = rng

    def select(self, tree, cycle):
        want = self.rng.randint(0, min(self.max_nodes, len(tree)))
        chosen: list[int] = []
        frontier = [v for v in range(len(tree)) if tree.parents[v] < 0]
        while len(chosen) < want and frontier:
            v = frontier.pop(self.rng.randrange(len(frontier)))
            chosen.append(v)
            frontier += [c for c in range(len(tree)) if tree.parents[c] == v]
        return tuple(sorted(chosen))


def calibrate(model, prompts: list[torch.Tensor], probes: int = PROBES["probes"], seed: int = PROBES["seed"],
              warmup: int = PROBES["warmup_cycles"], max_new_tokens: int = PROBES["max_new_tokens"],
              progress=None) -> tuple[CostModel, list[Record]]:
    """Run probes on an enabled model (with a drafter) over ``prompts`` ([1, P] token ids) until ``probes`` records
    are collected after ``warmup`` cycles per prompt; return the fitted model and the records."""
    runtime = model.specfit
    rng = random.Random(seed)
    records: list[Record] = []
    cycles = []
    runtime.stats.trace = []
    try:
        while len(records) < probes:
            for ids in prompts:
                runtime.stats.trace = []
                model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                               assistant=lambda m: ProbeGenerator(m, rng))
                before = len(records)
                cycles += runtime.stats.trace[warmup:]
                del cycles[probes:]
                records = _records(cycles)
                if progress is not None:
                    progress.update(len(records) - before)
                if len(records) >= probes:
                    break
            if not records:
                raise RuntimeError("calibration produced no records: prompts ended before the warm-up cycles")
    finally:
        runtime.stats.trace = None
    meta = dict(device=device_name(runtime), model_id=model_id(model), slots=runtime.config.cache_slots,
                cache_mode=runtime.config.cache_mode, link=runtime.link_label, probe="specfit.calibrate/probes.json")
    # the same probes fitted on expert *misses*: the cache-aware cost option (resident experts are free)
    try:
        on_misses = CostModel.fit(_records(cycles, use_misses=True), max_nodes=runtime.options.max_nodes)
        meta["cache_aware"] = dict(intercepts=list(on_misses.intercepts), beta=on_misses.beta,
                                   r2=on_misses.meta["r2"])
    except ValueError as err:  # e.g. every expert resident: misses never vary
        meta["cache_aware"] = None
        meta["cache_aware_error"] = str(err)
    return CostModel.fit(records, max_nodes=runtime.options.max_nodes, **meta), records


def _records(cycles, use_misses: bool = False) -> list[Record]:
    """Probes always draft the full pool, so drafting time does not depend on the verified subtree: each record
    carries the MEAN drafting time plus its own post-drafting time. Same expectation, far less noise for beta."""
    draft = sum(c.draft_seconds for c in cycles) / len(cycles) if cycles else 0.0
    return [Record(c.n_nodes, c.misses if use_misses else c.demand, draft + c.seconds - c.draft_seconds)
            for c in cycles]


# --- the command ------------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the embedded model)")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the embedded drafter)")
    p.add_argument("--slots", type=int, required=True, help="expert slots per MoE layer on the device")
    p.add_argument("--cache-mode", choices=("cached", "cleared"), default="cached")
    p.add_argument("--prompts", default=PROBES["prompts"],
                   help="gsm8k (default, as in the paper), cnn, random (token ids; for checkpoints without a "
                        "tokenizer), or a local .jsonl with a 'question' or 'text' field")
    p.add_argument("--num-prompts", type=int, default=PROBES["num_prompts"])
    p.add_argument("--probes", type=int, default=PROBES["probes"], help="timed cycles to record")
    p.add_argument("--max-new-tokens", type=int, default=PROBES["max_new_tokens"])
    p.add_argument("--link-ms", type=float, default=None, help="emulated host link: milliseconds per expert copy")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--seed", type=int, default=PROBES["seed"])
    p.add_argument("--out", default=None, help="profile path (default: the user cache, where enable() looks)")
    p.add_argument("--plot", default=None,
                   help="PNG of predicted vs measured cycle time (default: beside the profile; needs matplotlib)")


def main(args) -> int:
    from tqdm.auto import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = _load(args)
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {model.specfit!r}", flush=True)  # before the probes' minutes
    prompts = _prompt_ids(args, tokenizer, model)
    with tqdm(total=args.probes, desc="calibration probes", unit="cycle") as bar:
        cost, records = calibrate(model, prompts, probes=args.probes, seed=args.seed,
                                  max_new_tokens=args.max_new_tokens, progress=bar)
    path = args.out or profile_path(cost.meta["device"], cost.meta["model_id"], cost.meta["slots"],
                                    cost.meta["cache_mode"])
    cost.save(path)
    print(describe(cost))
    print(f"profile written to {path}")
    plot_fit(cost, records, args.plot or str(path).removesuffix(".json") + ".png")
    return 0


def describe(cost: CostModel) -> str:
    m = cost.meta
    lines = [f"device      {m.get('device')}", f"model       {m.get('model_id')}",
             f"slots       {m.get('slots')} ({m.get('cache_mode')})", f"link        {m.get('link')}",
             f"beta        {cost.beta * 1e3:.4f} ms per expert of demand",
             "intercepts  " + " ".join(f"{a * 1e3:.2f}" for a in cost.intercepts) + " ms (n = 0..)",
             f"fit         R^2 {m.get('r2', float('nan')):.3f}, rms residual "
             f"{m.get('rms_residual_s', float('nan')) * 1e3:.2f} ms over {m.get('n_records')} probes"]
    return "\n".join(lines)


def plot_fit(cost: CostModel, records, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'specfit[plot]'): no plot written")
        return
    measured = [r.seconds * 1e3 for r in records]
    predicted = [cost.predict(r.n_nodes, r.demand) * 1e3 for r in records]
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.scatter(predicted, measured, s=8, c=[r.n_nodes for r in records], cmap="viridis")
    top = max(measured + predicted)
    ax.plot([0, top], [0, top], "k--", lw=1)
    ax.set_xlabel("predicted cycle time (ms)")
    ax.set_ylabel("measured cycle time (ms)")
    ax.set_title(f"beta = {cost.beta * 1e3:.3f} ms/expert, R² = {cost.meta.get('r2', 0):.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def _load(args):
    from ..offload.link import LinkConfig

    link = LinkConfig(seconds_per_expert=args.link_ms / 1e3) if args.link_ms else None
    kw = dict(cache_mode=args.cache_mode, link=link)
    if args.model is None:
        from .. import embedded

        model, tokenizer = embedded.load(args.slots, **kw)
        if args.drafter:
            from ..patch import set_drafter

            set_drafter(model, args.drafter)
        return model, tokenizer
    from ..patch import from_pretrained

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = from_pretrained(args.model, cache_slots=args.slots, dtype=dtype, device=args.device,
                            drafter=args.drafter, **kw)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception:  # synthetic checkpoints ship no tokenizer
        tokenizer = None
    return model, tokenizer


def _prompt_ids(args, tokenizer, model) -> list[torch.Tensor]:
    from . import datasets

    device = model.specfit.device
    if args.prompts == "random":
        g = torch.Generator().manual_seed(args.seed)
        vocab = model.config.vocab_size
        return [torch.randint(1, vocab, (1, 32), generator=g).to(device) for _ in range(args.num_prompts)]
    if tokenizer is None:
        raise ValueError(f"--prompts {args.prompts} needs a tokenizer, and none was found with the model; "
                         f"use --prompts random")
    if args.prompts in ("gsm8k", "cnn"):
        texts = datasets.prompts(args.prompts, args.num_prompts, max_chars=1500)
    elif args.prompts.endswith(".jsonl"):
        rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()]
        texts = [datasets.GSM8K_PROMPT.format(question=r["question"]) if "question" in r else r["text"]
                 for r in rows[: args.num_prompts]]
    else:
        raise ValueError(f"--prompts must be gsm8k, cnn, random or a .jsonl file, got {args.prompts!r}")
    return [tokenizer(t, return_tensors="pt").input_ids.to(device) for t in texts]
