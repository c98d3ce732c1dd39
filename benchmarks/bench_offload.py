"""Offload benchmark: decode tokens/s and expert copies per output token of plain autoregressive greedy
``model.generate`` on an enabled model, at slots = all / 37.5% / 9.4% of the experts (the paper's 128, 48 and 12 of
128), with and without an emulated host link, on synthetic checkpoints (random weights: the costs are real, the text
is not).

The emulated link is set from this machine's own compute: one expert copy costs ``1.4 * t_token / (layers * top_k)``,
so a token whose whole expert demand misses spends 1.4x its compute time on copies, the ratio of the paper's A100
(PCIe 4.0). ``t_token`` is measured first, with every expert resident (the fastest of ``--repeats`` runs); the table
states the ratio against its own all-slots row, since other jobs on a shared machine move compute times. Then all
configurations are measured side by side in each repeat (interleaved; each starts from an empty slot cache and runs one
warm-up generate on a 64-token prompt before the timed one on a 16-token prompt), and the medians are reported.

    python benchmarks/bench_offload.py --models tiny,medium --repeats 5

Figures from a CPU "device" are labelled so: "CPU, memcpy" without the link, "CPU, emulated link" with it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_checkpoint import WEIGHTS, write_checkpoint  # noqa: E402

# model name -> (preset, default folder, shard size, new tokens per timed generate)
MODELS = {
    "tiny": ("tiny", "runs/bench-offload-tiny", "2MB", 96),
    "medium": ("medium", "runs/bench-loader-ckpt", "160MB", 16),  # shared with bench_loader.py
}
LINK_RATIO = 1.4  # full-miss copy time / compute time per token, as on the paper's A100 over PCIe 4.0
PROMPT_LEN = 16
WARM_PROMPT_LEN = 64  # the warm-up prompt's prefill touches nearly every expert, like a real prompt would


def ensure_checkpoint(folder: Path, preset: str, shard_size: str) -> None:
    stamp = folder / "synthetic.json"
    want = dict(preset=preset, shard_size=shard_size, layers=None, weights=WEIGHTS)
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return
    s = write_checkpoint(folder, preset, None, shard_size)
    stamp.write_text(json.dumps(want) + "\n")
    print(f"wrote {folder}: {s['file_bytes'] / 1e9:.2f} GB in {s['seconds']:.1f} s", flush=True)


def reconfigure(model, slots: int, link: float | None):
    import specfit

    if getattr(model, "specfit", None) is not None:
        specfit.disable(model)
    return specfit.enable(model, cache_slots=slots, link=link)


def decode(model, prompt: torch.Tensor, new_tokens: int):
    """One greedy generate of exactly ``new_tokens`` tokens (eos suppressed); returns its decode-phase counters."""
    gc.collect()  # the garbage of a reconfiguration must not be collected inside a timed run
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   temperature=None, top_p=None, top_k=None)
    return model.specfit.stats.last_generate


def run_model(name: str, args) -> dict:
    import specfit

    preset, folder, shard_size, new_tokens = MODELS[name]
    folder = Path(args.dir.get(name, folder))
    new_tokens = args.new_tokens or new_tokens
    ensure_checkpoint(folder, preset, shard_size)
    model = specfit.from_pretrained(folder, cache_slots=1, dtype=getattr(torch, args.dtype), device="cpu")
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    L = len(model.specfit.layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (1, PROMPT_LEN), generator=g) for _ in range(args.repeats)]
    warm = torch.randint(3, cfg.vocab_size, (1, WARM_PROMPT_LEN), generator=g)

    # 1. compute per token, every expert resident: the fastest run, the one least disturbed by other jobs
    reconfigure(model, E, None)
    decode(model, warm, new_tokens)
    t_token = min(1 / decode(model, prompts[r], new_tokens).tokens_per_second for r in range(args.repeats))
    link = LINK_RATIO * t_token / (L * k)
    print(f"\n[{name}] {L} MoE layers x {E} experts, top-{k}, {args.dtype}; compute {t_token * 1e3:.2f} ms/token "
          f"with every expert resident -> emulated link {link * 1e3:.3f} ms per expert copy "
          f"({L * k} experts/token x {link * 1e3:.3f} ms = {LINK_RATIO}x compute)", flush=True)

    # 2. every configuration side by side, per repeat
    slot_counts = [("all", E), ("37.5%", round(0.375 * E)), ("9.4%", max(1, round(0.094 * E)))]
    configs = [(label, slots, lk) for lk in (None, link) for label, slots in slot_counts]
    samples = {c: [] for c in configs}
    for r in range(args.repeats):
        for c in configs:
            reconfigure(model, c[1], c[2])
            decode(model, warm, new_tokens)  # fills the slot cache with a realistic LRU state
            samples[c].append(decode(model, prompts[r], new_tokens))

    rows = []
    for (label, slots, lk), runs in samples.items():
        tps = statistics.median(c.tokens_per_second for c in runs)
        rows.append(dict(model=name, slots=slots, slots_label=label, link_ms=lk * 1e3 if lk else None,
                         regime=f"CPU, emulated link ({lk * 1e3:.3f} ms/expert)" if lk else "CPU, memcpy (no link)",
                         tokens_per_second=tps, tokens_per_second_runs=[c.tokens_per_second for c in runs],
                         copies_per_token=statistics.median(c.copies_per_token for c in runs),
                         hit_rate=statistics.median(c.hit_rate for c in runs),
                         copy_wait_share=statistics.median(c.copy_wait_seconds / c.decode_seconds for c in runs)))
    t_all = 1 / rows[0]["tokens_per_second"]  # all slots, no link: this run's own compute per token
    return dict(model=name, preset=preset, layers=L, experts=E, top_k=k, dtype=args.dtype, new_tokens=new_tokens,
                repeats=args.repeats, compute_ms_per_token=t_token * 1e3, link_ms=link * 1e3,
                effective_ratio=L * k * link / t_all, rows=rows)


def print_table(result: dict) -> None:
    r = result
    print(f"\n{r['model']}: {r['layers']} layers x {r['experts']} experts, top-{r['top_k']}, {r['dtype']}, "
          f"{r['new_tokens']} new tokens, median of {r['repeats']}; link {r['link_ms']:.3f} ms/expert: a full-miss "
          f"token's copies take {r['effective_ratio']:.2f}x the compute of the all-slots row")
    print("| regime | slots | tok/s | copies / token | hit rate | time waiting for copies |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in r["rows"]:
        print(f"| {row['regime']} | {row['slots']} ({row['slots_label']}) | {row['tokens_per_second']:.1f} | "
              f"{row['copies_per_token']:.1f} | {row['hit_rate']:.2f} | {row['copy_wait_share']:.0%} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,medium", help=f"comma-separated, from {sorted(MODELS)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=None, help="per timed generate (default: per model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dir", action="append", default=[], metavar="MODEL=FOLDER", help="checkpoint folder of a model")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.dir = dict(d.split("=", 1) for d in args.dir)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    results = [run_model(name, args) for name in args.models.split(",")]
    for result in results:
        print_table(result)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
