"""The GPU check's own code that runs on the device, with torch (``tests/gpu/gpu_check.py`` runs each as a stage's
command): the environment's checks, the host link's bandwidth, the CPU/GPU speed factor of a stand-in run, and the
RESULT lines of a profile and of a decode. The device's CUDA calls go through the runtime's seams (``CudaStreams``,
``HostCopies``, the store's pinning), so on a CPU the CUDA stand-in (``SPECFIT_CUDA_STANDIN=1``: its doubles, its
second device) runs every line of them (tests/test_gpu_check_standin.py).

    python tests/gpu/gpu_stages.py env                          # imports, versions, CUDA; the RESULT env line
    python tests/gpu/gpu_stages.py bandwidth [--min-gbps G]    # H2D of one real-size expert, three ways; the gate
    SPECFIT_CUDA_STANDIN=1 python tests/gpu/gpu_stages.py speed  # this CPU's decode cycle over the device's
    python tests/gpu/gpu_stages.py fit PROFILE.json | decoded DECODE.json   # RESULT lines for the summary
    python tests/gpu/gpu_stages.py wheels      # where PyPI is reachable: the wheels the image lacks, into .whl/

``bandwidth``: H2D time of one Qwen3-30B-A3B expert (9,437,184 bytes, bf16) from an arena pinned by ExpertStore
(``cudaHostRegister``), from a pinned buffer (torch's allocator) and from pageable memory, each on a copy stream
timed with events; FAILS unless both pinned rows are page-locked, reach the floor (``MIN_H2D_GBPS``, else 35 GB/s
on a GPU of compute capability 9 or more, an H100/H200 on PCIe 5, whose pinned copies reach 50-55 GB/s; else 20, the
A100 on PCIe 4 figure) and hand the host back before the copy lands. The link's PCIe generation and width are read
from nvidia-smi while copies keep the link trained up (idle, a link trains down). A demand copy's head-of-line wait
behind 30 prefetch copies on another stream is a figure.

``speed``: a CPU run of part 2 on the stand-in decodes the ``tiny`` preset; the device's limits were sized on its
decode cycle at the real shapes (40-70 ms per cycle by review 5; ``DEVICE_CYCLE_MS`` the midpoint). The factor is
this CPU's median one-token forward of the preset on the stand-in over that; the check scales its limits by
max(1, factor), never more than the measured slowness. The last line printed is the scale alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]

E_BYTES = 3 * 768 * 2048 * 2  # one Qwen3-30B-A3B expert in bf16
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
              "pcie.link.width.max", "--format=csv,noheader")


def device_seams(required: bool = True) -> SimpleNamespace | None:
    """The device and its CUDA calls: CUDA's own, or under ``SPECFIT_CUDA_STANDIN=1`` the stand-in's doubles and its
    second device; ``label`` names it. Neither: None, or (``required``) the stage fails."""
    from specfit.offload import standin, standin_device

    if standin.enabled():
        doubles = standin.for_device(standin_device.register())
        return SimpleNamespace(device=standin_device.register(), streams=doubles.streams, copies=doubles.host_copies,
                               label="the CUDA stand-in (a CPU memcpy: not a GPU's figure)", capability=None)
    if not torch.cuda.is_available():
        if not required:
            return None
        raise SystemExit("RESULT bandwidth expectation: FAIL: no CUDA device here: nothing to measure")
    from specfit.offload.cache import CudaStreams
    from specfit.offload.host_compute import HostCopies

    device = torch.device("cuda")
    return SimpleNamespace(device=device, streams=CudaStreams(device), copies=HostCopies(device),
                           label=torch.cuda.get_device_name(device),
                           capability=torch.cuda.get_device_capability(device))


def floor_gbps(seams, given: float | None) -> tuple[float, str]:
    """The pinned rows' bandwidth floor and why: given, else by the GPU's generation."""
    if given is not None:
        return given, "given (MIN_H2D_GBPS)"
    if seams.capability is None:
        return 1.0, "the stand-in's memcpy (a plumbing run)"
    if seams.capability >= (9, 0):
        return 35.0, "compute capability >= 9.0 (H100/H200, PCIe 5: 50-55 GB/s expected)"
    return 20.0, "compute capability < 9.0 (PCIe 4: the paper's A100 reached 23.1 GB/s)"


class Link:
    """Copies of one expert's bytes into device rows on a copy stream, timed with events."""

    def __init__(self, seams, expert_bytes: int, rows: int = 8):
        self.seams, self.streams = seams, seams.streams
        self.dst = torch.empty(rows, expert_bytes // 2, dtype=torch.bfloat16, device=seams.device)  # [rows, numel]
        self.stream = self.streams.new_stream(priority=0)
        self.streams.tie(self.dst, self.stream)

    def bench(self, src, batch: int, reps: int = 40) -> tuple[float, float, float]:
        """Median ms per expert: event time on the copy stream, host time to issue, wall time until landed."""
        ev, issue, wall, n = [], [], [], src.shape[0]
        for r in range(reps + 5):
            self.streams.synchronize()
            t0 = time.perf_counter()
            with self.streams.on(self.stream):
                a, b = self.streams.event(timing=True), self.streams.event(timing=True)
                a.record(self.stream)
                t_issue = time.perf_counter()
                for j in range(batch):
                    self.streams.copy(self.dst[j], src[(r * batch + j) % n])
                t1 = time.perf_counter()
                b.record(self.stream)
            b.synchronize()
            if r >= 5:
                ev.append(a.elapsed_time(b) / batch)
                issue.append((t1 - t_issue) * 1e3 / batch)
                wall.append((time.perf_counter() - t0) * 1e3 / batch)
        return statistics.median(ev), statistics.median(issue), statistics.median(wall)

    def generation(self, src, query=NVIDIA_SMI, limit: float = 10.0) -> str:
        """The link's PCIe generation and width, read while copies keep it busy (idle, a link trains down)."""
        try:
            proc = subprocess.Popen(list(query), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            return f"not read ({query[0]}: {e.strerror or e})"
        start, r = time.perf_counter(), 0
        while proc.poll() is None and time.perf_counter() - start < limit:
            with self.streams.on(self.stream):
                for j in range(self.dst.shape[0]):
                    self.streams.copy(self.dst[j], src[(r + j) % src.shape[0]])
            self.streams.synchronize()
            r += 1
        if proc.poll() is None:
            proc.kill()
        out = (proc.communicate()[0] or "").strip()
        names = ("gen", "max gen", "width x", "max width x")
        parts = [p.strip() for p in out.splitlines()[0].split(",")] if out else []
        if proc.returncode != 0 or len(parts) != len(names):
            return f"not read ({query[0]} said: {out[:200] or 'nothing'})"
        return ", ".join(f"{n} {p}" for n, p in zip(names, parts)) + f" (under load, {r} copy rounds)"


def sources(seams, experts: int, expert_bytes: int, hidden: int, intermediate: int):
    """(kind, host buffer [experts, numel], page-locked?, note, store) per source: an ExpertStore arena (its pinning
    path), a pinned buffer, pageable memory."""
    from specfit.offload.store import ExpertStore

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = ExpertStore(1, experts, hidden, intermediate, torch.bfloat16, pin=True)  # the real pinning path
    arena = store.arenas[0].fill_(1.0)
    note = f"ExpertStore, pinned_bytes {store.pinned_bytes:,}" + "".join(f"; {w.message}" for w in caught)
    yield "registered", arena, store.is_pinned and seams.copies.is_pinned(arena), note, store
    pageable = torch.empty(experts, expert_bytes // 2, dtype=torch.bfloat16).fill_(1.0)
    pinned = seams.copies.pinned_like(pageable).copy_(pageable)
    yield "pin_memory", pinned, seams.copies.is_pinned(pinned), "", None
    yield "pageable", pageable, False, "", None


def head_of_line(seams, link: Link, src) -> str:
    """A demand copy alone, and behind 30 prefetch copies queued on another stream (a figure, not a gate)."""
    streams, expert = seams.streams, src.shape[1]
    big = torch.empty(30, expert, dtype=src.dtype, device=seams.device)  # [30, numel]
    demand = streams.new_stream(priority=-1)
    streams.tie(big, link.stream)
    streams.tie(link.dst, demand)
    alone, behind = [], []
    for _ in range(6):
        for queued in (0, 30):
            streams.synchronize()
            with streams.on(link.stream):
                for j in range(queued):
                    streams.copy(big[j], src[j % src.shape[0]])
            t0 = time.perf_counter()
            with streams.on(demand):
                streams.copy(link.dst[0], src[-1])
                done = streams.event()
                done.record(demand)
            done.synchronize()
            (behind if queued else alone).append((time.perf_counter() - t0) * 1e3)
    a, b = statistics.median(alone), statistics.median(behind)
    return (f"RESULT h2d head-of-line: one demand copy {a:.3f} ms alone, {b:.3f} ms with 30 prefetch copies queued on "
            f"another stream ({b / a:.1f}x; 30 copies take ~{30 * a:.1f} ms: near 1x means the demand copy does not "
            f"queue behind them)")


def bandwidth(min_gbps: float | None = None, experts: int = 64, hidden: int = 2048, intermediate: int = 768,
              query=NVIDIA_SMI) -> int:
    """The bandwidth stage (see the module's docstring): 0 when the gate passes."""
    seams = device_seams()
    expert_bytes = 3 * hidden * intermediate * 2
    floor, why = floor_gbps(seams, min_gbps)
    link = Link(seams, expert_bytes)
    print(f"{seams.label}: one expert = {expert_bytes:,} bytes; medians of 40 timed copies (after 5 warm-ups), copy "
          f"stream, non_blocking; floor {floor:g} GB/s: {why}", flush=True)
    print("| source | page-locked | 1 copy: ms (GB/s) | 1 copy: host issue ms | 1 copy wall ms | 8 back-to-back: "
          "ms/expert (GB/s) |\n| --- | --- | --- | --- | --- | --- |")
    failures, pinned_src = [], None
    for kind, src, locked, note, store in sources(seams, experts, expert_bytes, hidden, intermediate):
        (e1, i1, w1), (e8, _, _) = link.bench(src, 1), link.bench(src, 8)
        gbps = expert_bytes / e1 / 1e6
        print(f"| {kind} | {locked} | {e1:.3f} ({gbps:.1f}) | {i1:.3f} | {w1:.3f} | {e8:.3f} "
              f"({expert_bytes / e8 / 1e6:.1f}) |", flush=True)
        print(f"RESULT h2d {kind}: {e1:.3f} ms per expert = {gbps:.1f} GB/s (8 back-to-back: "
              f"{expert_bytes / e8 / 1e6:.1f} GB/s; host issue {i1:.3f} ms, wall {w1:.3f} ms)"
              f"{' [' + note + ']' if note else ''}", flush=True)
        if kind == "pin_memory":
            pinned_src = src
            print(f"RESULT pcie link: {link.generation(src, query)}", flush=True)  # right after, still trained up
        if kind != "pageable":
            if not locked:
                failures.append(f"{kind}: not page-locked ({note or 'is_pinned() is False'})")
            if gbps < floor:
                failures.append(f"{kind}: {gbps:.1f} GB/s, below the floor {floor:g} GB/s ({why})")
            if i1 >= 0.5 * e1:
                failures.append(f"{kind}: the host took {i1:.3f} ms to issue a {e1:.3f} ms copy: not asynchronous")
        if store is not None:
            store.release()
    print(head_of_line(seams, link, pinned_src), flush=True)
    print("for scale: the paper's cleared-cache beta, 0.408 ms per expert on an A100 over PCIe 4.0, is 23.1 GB/s")
    if failures:
        print("RESULT bandwidth expectation: FAIL: " + "; ".join(failures))
        return 1
    print(f"RESULT bandwidth expectation: pass (pinned rows page-locked, >= {floor:g} GB/s, asynchronous)")
    return 0


# the wheels the image (Python 3.12, torch 2.11+cu130, transformers 5.17, hub 1.33) lacks for transformers 5.25:
# its own, huggingface-hub >= 2.4 (httpx2 and its stack, hf-xet, a newer click), kernels (tomlkit), regex >=
# 2025.10.22, and platformdirs (SpecFit's cache folder); one version each, no dependency resolution on the device
WHEELS = ("transformers==5.25.0", "huggingface-hub==2.4.0", "kernels==0.19.1", "tomlkit==0.15.3", "httpx2==2.17.0",
          "httpcore2==2.17.0", "truststore==0.10.5", "anyio==4.16.0", "idna==3.20", "h11==0.16.0", "click==8.5.1",
          "hf-xet==1.8.0", "typing-extensions==4.16.0", "regex==2026.12.2", "platformdirs==4.14.9")



def wheels(dest: Path = ROOT / ".whl", python: str = sys.executable, limit_mb: int = 40) -> int:
    """Fetch ``WHEELS`` (one version each, no dependencies, for the device's CPython 3.12 on x86_64) into ``dest``,
    kept out of git; say their size with the working tree's against the 64 MiB a device call carries."""
    exclude = ROOT / ".git" / "info" / "exclude"
    if (ROOT / ".git").is_dir() and "/.whl/" not in (exclude.read_text() if exclude.is_file() else ""):
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as f:
            f.write("/.whl/\n")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                 for a in ("--platform", p)]
    cmd = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *platforms, "-d", str(dest), *WHEELS]
    if subprocess.run(cmd).returncode:
        print(f"gpu_check.py --wheels: pip download failed: {' '.join(cmd)}", file=sys.stderr)
        return 1
    total = sum(p.stat().st_size for p in dest.glob("*.whl"))
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True).stdout.split("\0")
    tree = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file())
    for path in sorted(dest.glob("*.whl")):
        print(f"  {path.stat().st_size / 2**20:6.1f} MiB  {path.name}")
    print(f"wheels: {len(list(dest.glob('*.whl')))} files, {total / 2**20:.1f} MiB; with the working tree that "
          f"travels ({tree / 2**20:.1f} MiB): {(total + tree) / 2**20:.1f} MiB of the 64 MiB a device call carries")
    if total > limit_mb * 2**20:
        print(f"gpu_check.py --wheels: the wheels exceed {limit_mb} MiB", file=sys.stderr)
        return 1
    return 0


DEVICE_CYCLE_MS = 55.0  # the device's decode cycle at the check's real shapes (review 5: 40-70 ms)
# every module the run imports beyond torch (specfit's own needs, the CUDA tests', calibrate's and decode's); the
# installed transformers' own unconditional requirements are added (5.25: kernels, huggingface-hub >= 2.4, ...)
REQUIRED = ("transformers accelerate safetensors huggingface_hub tokenizers numpy scipy regex tqdm platformdirs "
            "packaging pytest")


def transformers_needs() -> list[str]:
    """The modules of the installed transformers' unconditional requirements (its METADATA's Requires-Dist)."""
    from importlib.metadata import requires

    names = [r.split(";")[0] for r in requires("transformers") or () if "extra ==" not in r]
    dists = [re.split(r"[<>=!~ \[]", n.strip(), maxsplit=1)[0].lower() for n in names]
    return [{"pyyaml": "yaml"}.get(d, d.replace("-", "_")) for d in dists if d]


def env(required: str = REQUIRED) -> int:
    """Every required module imports, torch has what SpecFit calls, transformers >= 5.24, CUDA (unless ALLOW_CPU=1),
    specfit; the RESULT env line. FAIL lines name the remedy."""
    import importlib

    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    try:
        import transformers  # its own import-time dependency version checks
    except Exception as e:
        return _fail(f"import transformers: {type(e).__name__}: {e}")
    missing = []
    for name in dict.fromkeys(required.split() + transformers_needs()):
        try:
            mod = importlib.import_module(name)
            print(f"  {name:16s} {str(getattr(mod, '__version__', '?')):12s} {mod.__file__}")
        except Exception as e:
            print(f"  {name:16s} MISSING ({type(e).__name__}: {e})")
            missing.append(name)
    wheels = "Run `python tests/gpu/gpu_check.py --wheels` where PyPI is reachable and carry .whl to this machine."
    if missing:
        return _fail(f"missing on this machine: {', '.join(missing)}. {wheels}")
    from packaging.version import Version

    if Version(torch.__version__.split("+")[0]) < Version("2.8"):
        return _fail(f"torch {torch.__version__} is too old: SpecFit needs >= 2.8 (pyproject.toml)")
    if getattr(torch.nn.functional, "grouped_mm", None) is None and getattr(torch, "_grouped_mm", None) is None:
        return _fail(f"torch {torch.__version__} has neither F.grouped_mm nor torch._grouped_mm")
    if Version(transformers.__version__) < Version("5.24"):
        return _fail(f"transformers {transformers.__version__} is too old: SpecFit needs >= 5.24. {wheels}")
    if not torch.cuda.is_available() and os.environ.get("ALLOW_CPU") != "1":
        return _fail("torch.cuda.is_available() is False")
    import specfit
    import specfit.evaluation.calibrate  # noqa: F401
    import specfit.offload.loader  # noqa: F401

    print(f"specfit {specfit.__version__} from {specfit.__file__}")
    device = "no GPU (ALLOW_CPU=1)"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        device = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}"
    print(f"RESULT env: torch {torch.__version__}, transformers {transformers.__version__}, {device}")
    return 0


def _fail(message: str) -> int:
    print(f"FAIL: {message}")
    return 1


def speed(preset: str = "tiny", dtype: str = "bfloat16", forwards: int = 24) -> int:
    """The speed factor of a stand-in run (see the module's docstring); its scale, alone, on the last line."""
    if os.environ.get("SPECFIT_CUDA_STANDIN") != "1":
        return _fail("the speed factor is for a run on the CUDA stand-in: set SPECFIT_CUDA_STANDIN=1")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import specfit
    import synthetic_checkpoint as sc

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{k: v for k, v in sc.PRESETS[preset].items() if k != "draft_vocab_size"})
    model = specfit.enable(Qwen3MoeForCausalLM(config).to(getattr(torch, dtype)).eval(), cache_slots=12)
    ids = torch.randint(2, config.vocab_size, (1, forwards + 4), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)  # the stand-in's device: a forward takes its inputs there
    times = []
    with torch.no_grad():
        for i in range(ids.shape[1]):
            t0 = time.perf_counter()
            model(ids[:, i:i + 1])  # each a new token: its own routes, so the slots cycle
            times.append(time.perf_counter() - t0)
    cpu_ms = statistics.median(times[4:]) * 1e3
    factor = cpu_ms / DEVICE_CYCLE_MS
    print(f"RESULT speed factor: {factor:.3f} (this CPU's decode cycle on the stand-in, {preset} preset, "
          f"{cpu_ms:.2f} ms, over the device's {DEVICE_CYCLE_MS:g} ms at real shapes); stage limits x "
          f"{max(1.0, factor):.3f}")
    print(f"{max(1.0, factor):.3f}")
    return 0


def fit_lines(d: dict) -> list[str]:
    """A calibrated profile's figures and its verdict (a figure, not the stage's status)."""
    beta, r2, n = d["beta"] * 1e3, d.get("r2") or 0.0, d.get("n_records")
    q = d.get("quality") or {}
    held, verdict, paper = q.get("heldout_r2"), q.get("verdict", "unassessed"), (d.get("paper") or {}).get("beta")
    if verdict == "poor":
        verdict = "POOR (" + "; ".join(q.get("reasons") or []) + ")"
    link = max((d.get("probes") or {}).get("link_seconds") or [0.0])
    copy = (d.get("copy_overhead_s", 0.0) + d.get("link_share", 1.0) * link) * 1e3
    return [f"RESULT profile: compute {beta:.4f} ms per expert, copy {copy:.4f} ms per expert (the link's own "
            f"{link * 1e3:.4f} ms, measured from the pinned bandwidth), R^2 {r2:.3f} (held out "
            f"{'n/a' if held is None else f'{held:.3f}'}) over {n} records (probe configurations x link and lane "
            f"settings); the paper's demand-only beta here {'n/a' if paper is None else f'{paper * 1e3:.4f}'} ms "
            f"(paper, A100 over PCIe 4.0: 0.211 ms)",
            f"RESULT calibration verdict: {verdict}; the profile goes to decode either way"]


def decoded_lines(report: dict) -> list[str]:
    """A decode_check report's modes (the ones done so far: it is rewritten after each) as RESULT lines."""
    names = {"ar": "AR", "eagle3": "EAGLE-3", "specfit": "SpecFit"}
    lines = []
    for mode, x in report["results"].items():
        name = names.get(mode, mode) + (f" ({x['route_source']} routes)" if x.get("route_source") else "")
        lines.append(f"RESULT decode {name}: {x['tokens_per_second']:.2f} tok/s (wall clock), "
                     f"{x['copies_per_token']:.1f} copies/token, {x['nodes_per_cycle']:.2f} nodes/cycle, "
                     f"{x['tokens_per_cycle']:.2f} tokens/cycle, {x['seconds_per_cycle'] * 1e3:.1f} ms/cycle, copies "
                     f"at {x.get('copy_bandwidth', 0) / 1e9:.1f} GB/s, {x.get('pageable_copies', '?')} pageable "
                     f"copies, {x.get('syncs_per_cycle', float('nan')):.1f} host syncs/cycle "
                     f"({x.get('sync_counter', '?')})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="stage", required=True)
    sub.add_parser("env", help="imports, versions, CUDA: the environment's checks")
    b = sub.add_parser("bandwidth", help="H2D of one real-size expert: registered / pin_memory / pageable; the gate")
    b.add_argument("--min-gbps", type=float, default=float(os.environ["MIN_H2D_GBPS"])
                   if os.environ.get("MIN_H2D_GBPS") else None, help="the pinned rows' floor (default: by the GPU)")
    b.add_argument("--experts", type=int, default=64, help="experts per source buffer (copies cycle through them)")
    b.add_argument("--hidden", type=int, default=2048)
    b.add_argument("--intermediate", type=int, default=768)
    sub.add_parser("speed", help="the CPU/GPU speed factor of a run on the CUDA stand-in")
    sub.add_parser("wheels", help="where PyPI is reachable: the wheels the device's image lacks, into .whl/")
    for name in ("fit", "decoded"):
        sub.add_parser(name, help=f"RESULT lines of a {name} JSON").add_argument("json", type=Path)
    args = p.parse_args(argv)
    if args.stage == "env":
        return env(os.environ.get("REQUIRED") or REQUIRED)
    if args.stage == "bandwidth":
        return bandwidth(args.min_gbps, args.experts, args.hidden, args.intermediate)
    if args.stage == "speed":
        return speed()
    if args.stage == "wheels":
        return wheels()
    lines = (fit_lines if args.stage == "fit" else decoded_lines)(json.loads(args.json.read_text()))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # synthetic_checkpoint, beside this file
    sys.exit(main())
