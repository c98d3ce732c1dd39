"""The loading suite: what loading and offloading cost, on synthetic checkpoints in the hub's layout (random weights
from tests/gpu/synthetic_checkpoint.py, reused while the folder's ``synthetic.json`` matches: real costs, no text).

- ``loader``: peak host memory and time of ``specfit.from_pretrained`` against ``AutoModelForCausalLM.from_pretrained``
  then ``specfit.enable``, each load in a fresh subprocess, the page cache warm: peak RSS growth is ``VmHWM`` after
  the load minus ``VmRSS`` before it (mapped shards count). The streaming loader's peak is about the checkpoint plus
  one shard (bound 1.2x, else exit status 1); default shards ~1/16 of it, like Qwen3-30B-A3B's (61 GB in 16).
- ``offload``: tok/s and expert copies per token of plain greedy ``generate`` at slots = all / 37.5% / 9.4% of the
  experts, "CPU, memcpy" without a link and "CPU, emulated link" with one priced from this machine's compute (a copy:
  ``1.4 * t_token / (layers * top_k)``, a token missing every expert spends 1.4x its compute on copies as on the
  paper's A100 over PCIe 4.0). Every configuration side by side per repeat, after a warm-up generate; medians.

    python benchmarks/run.py load loader --dir runs/medium-ckpt --preset medium --shard-size 160MB --repeats 3
    python benchmarks/run.py load offload --models tiny,medium --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from specfit.cli_checks import at_least
from specfit.evaluation.results_file import write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import synthetic_checkpoint  # noqa: E402
from run import run_part  # noqa: E402  (this folder's entry: one way to run a part)

CHILD = textwrap.dedent("""
    import json, sys, time, torch
    torch.set_num_threads(int(sys.argv[3]))
    import accelerate, safetensors, transformers, transformers.models.qwen3_moe.modeling_qwen3_moe
    from transformers import AutoModelForCausalLM
    import specfit, specfit.offload.loader, specfit.patch
    status = lambda field: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))
    path, mode = sys.argv[1], sys.argv[2]
    base = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    t0 = time.perf_counter()
    if mode == "specfit":
        model = specfit.from_pretrained(path, cache_slots=12, dtype=torch.bfloat16, device="cpu")
        t_load, t_enable = time.perf_counter() - t0, 0.0
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        t_load = time.perf_counter() - t0
        specfit.enable(model, cache_slots=12)
        t_enable = time.perf_counter() - t0 - t_load
    print(json.dumps(dict(mode=mode, peak=status("VmHWM:") - base, after=status("VmRSS:") - base,
                          load_s=t_load, enable_s=t_enable, expert_bytes=model.specfit.store.weight_bytes)))
""")
MODES = {"specfit": "specfit.from_pretrained", "naive": "AutoModelForCausalLM.from_pretrained + enable"}
BOUND = 1.2  # the streaming loader's peak RSS growth / checkpoint bytes
MODELS = {"tiny": ("tiny", "runs/bench-offload-tiny", "2MB", 96),  # (preset, folder, shard size, new tokens)
          "medium": ("medium", "runs/bench-loader-ckpt", "160MB", 16)}  # the loader's default checkpoint
LINK_RATIO = 1.4  # full-miss copy time / compute time per token, as on the paper's A100 over PCIe 4.0
PROMPT_LEN, WARM_PROMPT_LEN = 16, 64  # the warm-up prompt's prefill touches nearly every expert, as a real one does


def ensure_checkpoint(folder: Path, preset: str, shard_size: str, layers: int | None, rewrite: bool = False) -> None:
    """Write the synthetic checkpoint into ``folder`` unless the one there was written with these settings."""
    stamp = folder / "synthetic.json"
    want = dict(preset=preset, shard_size=shard_size, layers=layers, weights=synthetic_checkpoint.WEIGHTS)
    if not rewrite and stamp.is_file() and json.loads(stamp.read_text()) == want:
        print(f"reusing {folder}")
        return
    s = synthetic_checkpoint.write_checkpoint(folder, preset, layers, shard_size)
    write_results(folder, want, stamp.name)  # the settings it was written with, read back above
    print(f"wrote {folder}: {s['shards']} shards, {s['file_bytes'] / 1e9:.2f} GB in {s['seconds']:.1f} s", flush=True)


def check_folder(folder: Path, option: str) -> None:
    """A checkpoint folder the suite may (re)write: new, empty, or one it wrote (never a real checkpoint's shards)."""
    if folder.exists() and not (folder / "synthetic.json").is_file() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{option} {folder} holds files but no synthetic.json (not a checkpoint this suite wrote, "
                         f"which it would overwrite): name a new or empty folder")


def measure(folder: Path, mode: str, threads: int) -> dict:
    """One load in a fresh interpreter: its peak RSS growth, RSS after, load and enable seconds."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), mode, str(threads)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} load failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def loader(args) -> int:
    folder = Path(args.dir)
    ensure_checkpoint(folder, args.preset, args.shard_size, args.layers, args.rewrite)
    sizes = [p.stat().st_size for p in folder.glob("*.safetensors")]
    total, largest = sum(sizes), max(sizes)
    for shard in sorted(folder.glob("*.safetensors")):  # warm the page cache: both paths read from memory
        with open(shard, "rb") as f:
            while f.read(1 << 26):
                pass
    runs = {m: [] for m in args.modes}
    for _ in range(args.repeats):  # interleaved, so drift hits both paths alike
        for mode in args.modes:
            runs[mode].append(measure(folder, mode, args.threads))
    print(f"\ncheckpoint: {total:,} bytes ({total / 1e9:.2f} GB) in {len(sizes)} shards, largest {largest / 1e6:.0f} "
          f"MB; medians of {args.repeats} fresh processes, page cache warm")
    print("| path | peak RSS growth | / checkpoint | peak - checkpoint | RSS after | load s | enable s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for mode in args.modes:
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in ("peak", "after", "load_s", "enable_s")}
        summary[mode] = dict(med, ratio=med["peak"] / total, runs=runs[mode])
        print(f"| {MODES[mode]} | {med['peak'] / 1e9:.2f} GB | {med['peak'] / total:.2f}x | "
              f"{(med['peak'] - total) / 1e6:+.0f} MB | {med['after'] / 1e9:.2f} GB | {med['load_s']:.1f} | "
              f"{med['enable_s']:.1f} |")
    ok = summary.get("specfit", {}).get("ratio", 0) <= BOUND
    if "specfit" in summary:
        print(f"\nspecfit.from_pretrained peak / checkpoint = {summary['specfit']['ratio']:.3f} (bound {BOUND}): "
              f"{'PASS' if ok else 'FAIL'}")
    if args.json:
        path = write_results(Path(args.json).parent, dict(checkpoint_bytes=total, largest_shard=largest,
                                                          shards=len(sizes), results=summary), Path(args.json).name)
        print(f"wrote {path}")
    return 0 if ok else 1


def decode(model, prompt, new_tokens: int):
    """One greedy generate of exactly ``new_tokens`` tokens (eos suppressed); returns its decode-phase counters."""
    gc.collect()  # the garbage of a reconfiguration must not be collected inside a timed run
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   temperature=None, top_p=None, top_k=None)
    return model.specfit.stats.last_generate


def offload_model(name: str, args) -> dict:
    import torch

    import specfit

    torch.set_num_threads(args.threads)
    preset, folder, shard_size, new_tokens = MODELS[name]
    folder, new_tokens = Path(args.dir.get(name, folder)), args.new_tokens or new_tokens
    ensure_checkpoint(folder, preset, shard_size, args.layers)
    model = specfit.from_pretrained(folder, cache_slots=1, dtype=getattr(torch, args.dtype), device="cpu")
    reconfigure = lambda slots, link: specfit.enable(specfit.disable(model), cache_slots=slots, link=link)  # noqa
    E, k, L = model.config.num_experts, model.config.num_experts_per_tok, len(model.specfit.layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (1, PROMPT_LEN), generator=g) for _ in range(args.repeats)]
    warm = torch.randint(3, model.config.vocab_size, (1, WARM_PROMPT_LEN), generator=g)  # [1, 64]
    # 1. compute per token, every expert resident: the fastest run, the one least disturbed by other jobs
    reconfigure(E, None)
    decode(model, warm, new_tokens)
    t_token = min(1 / decode(model, prompts[r], new_tokens).tokens_per_second for r in range(args.repeats))
    link = LINK_RATIO * t_token / (L * k)
    print(f"\n[{name}] {L} MoE layers x {E} experts, top-{k}, {args.dtype}; compute {t_token * 1e3:.2f} ms/token "
          f"with every expert resident -> emulated link {link * 1e3:.3f} ms per expert copy "
          f"({L * k} experts/token x {link * 1e3:.3f} ms = {LINK_RATIO}x compute)", flush=True)
    # 2. every configuration side by side, per repeat, each from an empty cache filled by a warm-up generate
    slot_counts = [("all", E), ("37.5%", round(0.375 * E)), ("9.4%", max(1, round(0.094 * E)))]
    samples = {(label, slots, lk): [] for lk in (None, link) for label, slots in slot_counts}
    for r in range(args.repeats):
        for label, slots, lk in samples:
            reconfigure(slots, lk)
            decode(model, warm, new_tokens)
            samples[label, slots, lk].append(decode(model, prompts[r], new_tokens))
    rows = []
    for (label, slots, lk), runs in samples.items():
        median = lambda field: statistics.median(getattr(c, field) for c in runs)  # noqa: E731
        rows.append(dict(model=name, slots=slots, slots_label=label, link_ms=lk * 1e3 if lk else None,
                         regime=f"CPU, emulated link ({lk * 1e3:.3f} ms/expert)" if lk else "CPU, memcpy (no link)",
                         tokens_per_second=median("tokens_per_second"),
                         tokens_per_second_runs=[c.tokens_per_second for c in runs],
                         copies_per_token=median("copies_per_token"), hit_rate=median("hit_rate"),
                         copy_wait_share=statistics.median(c.copy_wait_seconds / c.decode_seconds for c in runs)))
    t_all = 1 / rows[0]["tokens_per_second"]  # all slots, no link: this run's own compute per token
    return dict(model=name, preset=preset, layers=L, experts=E, top_k=k, dtype=args.dtype, new_tokens=new_tokens,
                repeats=args.repeats, compute_ms_per_token=t_token * 1e3, link_ms=link * 1e3,
                effective_ratio=L * k * link / t_all, rows=rows)


def offload(args) -> int:
    t0 = time.perf_counter()
    results = [offload_model(name, args) for name in args.models]
    for r in results:
        print(f"\n{r['model']}: {r['layers']} layers x {r['experts']} experts, top-{r['top_k']}, {r['dtype']}, "
              f"{r['new_tokens']} new tokens, median of {r['repeats']}; link {r['link_ms']:.3f} ms/expert: a full-"
              f"miss token's copies take {r['effective_ratio']:.2f}x the compute of the all-slots row")
        print("| regime | slots | tok/s | copies / token | hit rate | time waiting for copies |")
        print("| --- | --- | --- | --- | --- | --- |")
        for row in r["rows"]:
            print(f"| {row['regime']} | {row['slots']} ({row['slots_label']}) | {row['tokens_per_second']:.1f} | "
                  f"{row['copies_per_token']:.1f} | {row['hit_rate']:.2f} | {row['copy_wait_share']:.0%} |")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        print(f"wrote {write_results(Path(args.json).parent, dict(models=results), Path(args.json).name)}")
    return 0


def listed(text: str, allowed, option: str) -> list[str]:
    """A comma-separated list of names, each one of ``allowed``."""
    names = text.split(",")
    if bad := [n for n in names if n not in allowed]:
        raise ValueError(f"{option}: unknown {bad[0]!r}; choose from {', '.join(allowed)} (comma-separated)")
    return names


def check_loader(args) -> None:
    at_least(args, 1, "repeats", "threads", "layers")
    args.modes = listed(args.modes, list(MODES), "--modes")
    try:
        synthetic_checkpoint.parse_size(args.shard_size)
    except ValueError as err:
        raise ValueError(f"--shard-size: {err}") from None
    check_folder(Path(args.dir), "--dir")


def check_offload(args) -> None:
    at_least(args, 1, "repeats", "new_tokens", "threads", "layers")
    args.models = listed(args.models, list(MODELS), "--models")
    if bad := [d for d in args.dir if "=" not in d or d.split("=", 1)[0] not in args.models]:
        raise ValueError(f"--dir {bad[0]}: expected MODEL=FOLDER, MODEL one of --models ({', '.join(args.models)})")
    args.dir = dict(d.split("=", 1) for d in args.dir)
    for name in args.models:
        check_folder(Path(args.dir.get(name, MODELS[name][1])), f"--dir {name}=")


PARTS = {"loader": (loader, check_loader), "offload": (offload, check_offload)}  # (run, check the options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="run.py load", description=__doc__.splitlines()[0])
    parts = parser.add_subparsers(dest="part", required=True, metavar="PART")
    p = parts.add_parser("loader", help="peak memory and time of specfit.from_pretrained against the naive path")
    p.add_argument("--dir", default="runs/bench-loader-ckpt", help="checkpoint folder (written unless it matches)")
    p.add_argument("--preset", default="medium", choices=sorted(synthetic_checkpoint.PRESETS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--shard-size", default="160MB", help="default: ~1/16 of the medium checkpoint, like the hub's")
    p.add_argument("--rewrite", action="store_true", help="write the checkpoint even if one is there")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="specfit,naive", help="comma-separated: specfit, naive")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the loading process")
    p.add_argument("--json", default=None, help="write the results here")
    o = parts.add_parser("offload", help="decode tok/s of plain greedy generate against slots and an emulated link")
    o.add_argument("--models", default="tiny,medium", help=f"comma-separated, from {sorted(MODELS)}")
    o.add_argument("--repeats", type=int, default=5)
    o.add_argument("--new-tokens", type=int, default=None, help="per timed generate (default: per model)")
    o.add_argument("--layers", type=int, default=None, help="MoE layers of the checkpoints (default: the preset's)")
    o.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    o.add_argument("--threads", type=int, default=1)
    o.add_argument("--dir", action="append", default=[], metavar="MODEL=FOLDER", help="checkpoint folder of a model")
    o.add_argument("--json", default=None, help="write the results here")
    return run_part(parser, parts, PARTS, argv)
