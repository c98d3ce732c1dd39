"""Host experts at Qwen3-30B-A3B's expert shape (issue 36, item 8): milliseconds per expert computed on the host CPU
from its pinned arena row, at 1, 8 and 32 tokens, beside the copy of the same expert's stored bytes to the device.

- *host*: the SwiGLU expert (``gate_up [2I, H]``, ``down [H, I]``; the family's own gating and batched math,
  ``seam.experts``) on x [tokens, H], computed with torch's CPU threads (``--threads``; all cores by default) from a
  worker thread of its own, not the Python main thread, as a host lane runs it. bf16 rows are multiplied as stored;
  FP8 rows (block-wise e4m3 + float32 scales) are dequantized per use, as the host would each time. Each timed
  expert is the next of ``--experts`` in the arena (64 x 9.4 MB = 604 MB, far beyond a CPU's caches), so its bytes
  come from memory, as a missed expert's would.
- *copy*: one expert's stored bytes from the pinned arena to the device on a copy stream, timed with CUDA events
  (``specfit.offload.bandwidth.copy_seconds``, the measurement that prices copies): CUDA only.

    python tests/gpu/host_expert_check.py [--threads 16] [--experts 64] [--repeats 3] [--json out.json]
    python tests/gpu/host_expert_check.py --hidden 256 --intermediate 128 --block 32 --experts 4   # a CPU smoke run

Prints a table and one ``RESULT host experts`` line per stored format and thread count: ms per expert at each token
count, the bytes' rate at one token, and each over the copy's time where there is one (below 1: the host computes
the expert before its copy would land).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_check import BLOCK, H, I, _experts_module, stores  # noqa: E402

TOKENS = (1, 8, 32)


def host_ms(store, experts_module, tokens: int, repeats: int) -> float:
    """Median over ``repeats`` passes of the ms per expert, each pass computing every expert of the arena once (in
    arena order) for ``tokens`` rows, from the arena's rows: bf16 as stored, FP8 dequantized per use."""
    from specfit.seam import experts as hf_experts

    arena = store.arenas[0]  # [experts, row]
    x = torch.randn(1, tokens, store.layout.hidden, generator=torch.Generator().manual_seed(tokens)).to(store.compute_dtype)
    passes = []
    for r in range(repeats + 1):  # the first pass warms the threads and the allocator up
        t0 = time.perf_counter()
        for e in range(arena.shape[0]):
            hf_experts.experts_forward_batched(experts_module, x, *store.compute_parts(arena[e:e + 1]))  # [1, T, H]
        if r:
            passes.append((time.perf_counter() - t0) * 1e3 / arena.shape[0])
    return sorted(passes)[len(passes) // 2]


def measure(store, experts_module, threads: int, repeats: int) -> dict:
    """ms per expert at each of ``TOKENS``, computed by ``threads`` torch CPU threads from a worker thread."""

    def run():
        torch.set_num_threads(threads)  # the intra-op pool this worker's ops use
        with torch.no_grad():
            return {t: host_ms(store, experts_module, t, repeats) for t in TOKENS}

    with ThreadPoolExecutor(1, thread_name_prefix="host-experts") as pool:
        return pool.submit(run).result()


def copy_ms(store) -> float | None:
    """ms for one expert's stored bytes from the pinned arena to the device, through the copy engine's streams
    (median; None without CUDA or the CUDA stand-in)."""
    from gpu_stages import device_seams

    from specfit.offload.bandwidth import copy_seconds

    seams = device_seams(required=False)
    if seams is None:
        return None
    return copy_seconds(SimpleNamespace(store=store, device=seams.device,
                                        engine=SimpleNamespace(streams=seams.streams))) * 1e3


def copy_ms_possible() -> bool:
    """Whether there is a device to copy to: CUDA, or the CUDA stand-in (arenas pinned as CUDA pins them)."""
    from specfit.offload import standin

    return standin.enabled() or torch.cuda.is_available()


def result_line(name: str, store, threads: int, ms: dict, copy: float | None) -> str:
    times = ", ".join(f"{t} token{'s' if t > 1 else ''} {ms[t]:.3f} ms" for t in TOKENS)
    line = (f"RESULT host experts {name}: {times} per expert ({threads} CPU threads; {store.expert_bytes:,} bytes read "
            f"at {store.expert_bytes / ms[1] / 1e6:.2f} GB/s at 1 token)")
    if copy is None:
        return line + "; no CUDA: no copy to compare"
    ratios = ", ".join(f"{ms[t] / copy:.2f}" for t in TOKENS)
    return line + (f"; copy {copy:.3f} ms ({store.expert_bytes / copy / 1e6:.1f} GB/s pinned): host / copy "
                   f"{ratios} at {', '.join(map(str, TOKENS))} tokens")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default=str(os.cpu_count() or 1),
                   help="torch CPU threads of the host lane, comma-separated for several (default: all cores)")
    p.add_argument("--experts", type=int, default=64, help="experts in the arena (each pass reads every one once)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (the median is kept)")
    p.add_argument("--hidden", type=int, default=H)
    p.add_argument("--intermediate", type=int, default=I)
    p.add_argument("--block", type=int, default=BLOCK[0], help="FP8 scale block (square)")
    p.add_argument("--formats", default="bf16,fp8", help="comma-separated, from: bf16, fp8")
    p.add_argument("--json", default=None, help="write the figures here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not threads or min(threads) < 1:
        raise SystemExit(f"--threads must be positive ints, got {args.threads!r}")
    if not formats or set(formats) - {"bf16", "fp8"}:
        raise SystemExit(f"--formats must name bf16 and/or fp8, got {args.formats!r}")
    if args.experts < 1 or args.repeats < 1:
        raise SystemExit(f"--experts and --repeats must be >= 1, got {args.experts} and {args.repeats}")
    t0 = time.perf_counter()
    bf16, fp8 = stores(args.experts, pin=copy_ms_possible(), hidden=args.hidden,
                       intermediate=args.intermediate, block=(args.block, args.block))
    experts_module = _experts_module(args.hidden, args.intermediate)
    print(f"host experts: hidden {args.hidden}, moe_intermediate {args.intermediate}, {args.experts} experts per "
          f"arena (pinned: {bf16.is_pinned}), built in {time.perf_counter() - t0:.1f} s; {os.cpu_count()} cores; "
          f"torch {torch.__version__}", flush=True)
    print("| stored | threads | " + " | ".join(f"{t} tok ms" for t in TOKENS) + " | copy ms |")
    print("| --- | --- | " + " | ".join("---" for _ in TOKENS) + " | --- |")
    rows = []
    for name, store in (("bf16", bf16), ("fp8", fp8)):
        if name not in formats:
            continue
        copy = copy_ms(store)
        for n in threads:
            ms = measure(store, experts_module, n, args.repeats)
            rows.append(dict(stored=name, threads=n, expert_bytes=store.expert_bytes, host_ms=ms, copy_ms=copy))
            print(f"| {name} | {n} | " + " | ".join(f"{ms[t]:.3f}" for t in TOKENS)
                  + f" | {'-' if copy is None else f'{copy:.3f}'} |", flush=True)
            print(result_line(name, store, n, ms, copy), flush=True)
    for store in (bf16, fp8):
        store.release()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, cores=os.cpu_count(), hidden=args.hidden,
                                                   intermediate=args.intermediate), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
