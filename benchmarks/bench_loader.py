"""Loader benchmark: peak host memory and time of ``specfit.from_pretrained`` on a synthetic checkpoint of a few GB,
against the naive path (``AutoModelForCausalLM.from_pretrained`` then ``specfit.enable``).

Each load runs in a fresh subprocess. Peak RSS growth is ``VmHWM`` after the load minus ``VmRSS`` before it, with the
peak reset through ``/proc/self/clear_refs`` after the imports (as tests/test_loader.py does); mapped checkpoint pages
count, since they are resident while a shard is open. The page cache is warmed first, so both paths read from memory.

    python benchmarks/bench_loader.py --dir runs/medium-ckpt --preset medium --shard-size 160MB --repeats 3

The streaming loader's peak is about the checkpoint plus one shard. The hub's Qwen3-30B-A3B is 61 GB in 16 shards of
<= 4 GB, so by default the synthetic checkpoint is cut into shards of the same relative size (~1/16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_checkpoint import WEIGHTS, write_checkpoint  # noqa: E402

CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    torch.set_num_threads(int(sys.argv[3]))
    import accelerate, safetensors, transformers
    from transformers import AutoModelForCausalLM
    import transformers.models.qwen3_moe.modeling_qwen3_moe
    import specfit, specfit.offload.loader, specfit.patch

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

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


def checkpoint_bytes(folder: Path) -> tuple[int, int]:
    """(bytes of all shards, bytes of the largest shard)."""
    sizes = [p.stat().st_size for p in folder.glob("*.safetensors")]
    return sum(sizes), max(sizes)


def warm_page_cache(folder: Path) -> None:
    for shard in sorted(folder.glob("*.safetensors")):
        with open(shard, "rb") as f:
            while f.read(1 << 26):
                pass


def measure(folder: Path, mode: str, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), mode, str(threads)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} load failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure_checkpoint(folder: Path, preset: str, shard_size: str, layers: int | None, rewrite: bool) -> None:
    stamp = folder / "synthetic.json"
    want = dict(preset=preset, shard_size=shard_size, layers=layers, weights=WEIGHTS)
    if not rewrite and stamp.is_file() and json.loads(stamp.read_text()) == want:
        print(f"reusing {folder}")
        return
    s = write_checkpoint(folder, preset, layers, shard_size)
    stamp.write_text(json.dumps(want) + "\n")
    print(f"wrote {folder}: {s['shards']} shards, {s['file_bytes'] / 1e9:.2f} GB in {s['seconds']:.1f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/bench-loader-ckpt", help="checkpoint folder (written unless it matches)")
    p.add_argument("--preset", default="medium")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--shard-size", default="160MB", help="default: ~1/16 of the medium checkpoint, like the hub's")
    p.add_argument("--rewrite", action="store_true", help="write the checkpoint even if one is there")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="specfit,naive", help="comma-separated: specfit, naive")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the loading process")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    folder = Path(args.dir)
    ensure_checkpoint(folder, args.preset, args.shard_size, args.layers, args.rewrite)
    total, largest = checkpoint_bytes(folder)
    shards = len(list(folder.glob("*.safetensors")))
    warm_page_cache(folder)
    modes = args.modes.split(",")
    runs = {m: [] for m in modes}
    for _ in range(args.repeats):  # interleaved, so drift hits both paths alike
        for mode in modes:
            runs[mode].append(measure(folder, mode, args.threads))

    print(f"\ncheckpoint: {total:,} bytes ({total / 1e9:.2f} GB) in {shards} shards, largest {largest / 1e6:.0f} MB; "
          f"medians of {args.repeats} fresh processes, page cache warm")
    print("| path | peak RSS growth | / checkpoint | peak - checkpoint | RSS after | load s | enable s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for mode in modes:
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in ("peak", "after", "load_s", "enable_s")}
        ratio = med["peak"] / total
        summary[mode] = dict(med, ratio=ratio, runs=runs[mode])
        label = "specfit.from_pretrained" if mode == "specfit" else "AutoModelForCausalLM.from_pretrained + enable"
        print(f"| {label} | {med['peak'] / 1e9:.2f} GB | {ratio:.2f}x | {(med['peak'] - total) / 1e6:+.0f} MB | "
              f"{med['after'] / 1e9:.2f} GB | {med['load_s']:.1f} | {med['enable_s']:.1f} |")
    if "specfit" in summary:
        verdict = "PASS" if summary["specfit"]["ratio"] <= 1.2 else "FAIL"
        print(f"\nspecfit.from_pretrained peak / checkpoint = {summary['specfit']['ratio']:.3f} (bound 1.2): {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(checkpoint_bytes=total, largest_shard=largest, shards=shards,
                                                   results=summary), indent=2) + "\n")
    return 0 if summary.get("specfit", {}).get("ratio", 0) <= 1.2 else 1


if __name__ == "__main__":
    sys.exit(main())
