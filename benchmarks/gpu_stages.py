"""The GPU check's own measurements on the device (``benchmarks/gpu_check.sh`` runs them): the host link's bandwidth
and what users run. Each makes its CUDA calls through the runtime's seams (``CudaStreams``, ``HostCopies``, the
store's pinning), so on a CPU the CUDA stand-in (``SPECFIT_CUDA_STANDIN=1``: its doubles, its second device) runs
every line of them (tests/test_gpu_check_standin.py).

    python benchmarks/gpu_stages.py bandwidth [--min-gbps G]    # H2D of one real-size expert, three ways; the gate
    python benchmarks/gpu_stages.py users [--tokens 16]          # generate() on 2 left-padded rows, `specfit serve`

``bandwidth``: H2D time of one Qwen3-30B-A3B expert (9,437,184 bytes, bf16) from an arena pinned by ExpertStore
(``cudaHostRegister``), from a pinned buffer (torch's allocator) and from pageable memory, each on a copy stream
timed with events; FAILS unless both pinned rows are page-locked, reach the floor (``MIN_H2D_GBPS``, else 35 GB/s
on a GPU of compute capability 9 or more, an H100/H200 on PCIe 5, whose pinned copies reach 50-55 GB/s; else 20, the
A100 on PCIe 4 figure) and hand the host back before the copy lands. The link's PCIe generation and width are read
from nvidia-smi while copies keep the link trained up (idle, a link trains down). A demand copy's head-of-line wait
behind 30 prefetch copies on another stream is a figure.

``users``: the embedded model and drafter (they ship a tokenizer) loaded by ``specfit.from_pretrained`` on the
device, in fp32: for each assistant, ``generate()`` on 2 left-padded rows and on one row, the ids on the host as a
tokenizer gives them, tokens checked against plain decoding (``assistant=None``, transformers' own loop); then
``specfit serve`` on the same checkpoint answers through the ``openai`` client: each question alone with plain
decoding, then all of them at once (a batch: at least two share a call) and one streamed, each answer equal to the
plain one. FAILS on any difference (a plain top-2 margin under 1e-4 at the first differing token is a near tie:
said, not failed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

E_BYTES = 3 * 768 * 2048 * 2  # one Qwen3-30B-A3B expert in bf16
QUESTIONS = ["What is 7 times 8?", "A class has 28 students. Half of them play football. How many play football?",
             "Sara buys 4 notebooks at 3 dollars each. How much does she pay?", "What is 100 minus 37?"]
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
              "pcie.link.width.max", "--format=csv,noheader")
NEAR_TIE = 1e-4  # plain decoding's top-2 logit margin under which another kernel's rounding may pick the other


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


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_difference(model, mask, got, want, row: int) -> str:
    """Where row ``row`` of ``got`` leaves plain decoding's ``want`` [B, P + N] (``mask`` [B, P] the prompts', or
    None), and plain decoding's own top-2 logit margin there, teacher-forced: a near tie, or a real difference."""
    pos = next(i for i, (a, b) in enumerate(zip(got[row].tolist(), want[row].tolist())) if a != b)
    seen = torch.ones_like(want[row:row + 1])  # [1, P + N]
    if mask is not None:
        seen[:, :mask.shape[1]] = mask[row:row + 1]
    seen = seen[:, :pos]
    with torch.no_grad():
        logits = model(want[row:row + 1, :pos].to(model.device), attention_mask=seen.to(model.device),
                       position_ids=(seen.cumsum(-1) - 1).clamp(min=0).to(model.device)).logits[0, -1].float()
    top = logits.topk(2).values.tolist()
    margin = top[0] - top[1]
    return f"row {row} position {pos}: margin {margin:.2e}" + (" (a near tie)" if margin < NEAR_TIE else "")


def check_rows(model, name: str, ids, mask, tokens: int) -> list[str]:
    """``assistant=name`` against plain decoding on ``ids`` [B, P] (host) and ``mask``: the differences (near ties
    said as such); prints the RESULT line."""
    kw = dict(max_new_tokens=tokens, do_sample=False)
    plain = model.generate(ids, attention_mask=mask, **kw)  # transformers' own loop
    got = model.generate(ids, attention_mask=mask, assistant=name, **kw)
    rows = ids.shape[0]
    where = [] if got.device == ids.device else [f"the output came back on {got.device}, the ids were on {ids.device}"]
    diffs = [first_difference(model, mask, got, plain, b) for b in range(rows) if not torch.equal(got[b], plain[b])]
    real = [d for d in diffs if "near tie" not in d] + where
    what = f"{rows} left-padded rows" if rows > 1 else "one row"
    print(f"RESULT users generate {name} ({what}, host ids): "
          f"{'FAIL: ' + '; '.join(real) if real else 'equal to plain decoding'}"
          f"{' (' + '; '.join(diffs) + ')' if diffs and not real else ''}, "
          f"{model.specfit.stats.last_generate.new_tokens} tokens", flush=True)
    return [f"generate {name} {what}: {d}" for d in real]


def ask(url: str, question: str, tokens: int, assistant, stream: bool = False):
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="specfit", max_tokens=tokens, temperature=0, stream=stream,
                                           messages=[{"role": "user", "content": question}],
                                           extra_body={"assistant": assistant})
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in reply if c.choices).strip(), None
    return reply.choices[0].message.content, reply.model_extra["specfit"]


def fp32_checkpoint(source: Path, folder: Path) -> Path:
    """``source`` as a float32 checkpoint: its files linked into ``folder``, its config saying float32 (the embedded
    checkpoint says bfloat16, where a batch and a row alone may break near ties apart; fp32 greedy is exact)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "config.json" and not (folder / path.name).exists():
            (folder / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def serve_check(checkpoint, drafter, slots: int, tokens: int, max_batch: int, timeout: float, log: Path) -> list[str]:
    """``specfit serve`` on ``checkpoint`` (the command users type), through the openai client: plain answers one
    at a time, then every question at once with SpecFit (batched) and one streamed. The differences."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    cmd = [sys.executable, "-m", "specfit.cli", "serve", "--model", str(checkpoint), "--drafter", str(drafter),
           "--slots", str(slots), "--max-batch", str(max_batch), "--host", "127.0.0.1", "--port", str(port)]
    print("users: " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            if server.poll() is not None or time.perf_counter() - t0 > timeout:
                return [f"serve: the server did not come up in {timeout:g} s (exit {server.poll()}): "
                        + log.read_text()[-600:].replace("\n", " | ")]
            time.sleep(0.5)
        up = time.perf_counter() - t0
        plain = {q: ask(url, q, tokens, None)[0] for q in QUESTIONS}  # one at a time: plain decoding
        with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
            replies = list(pool.map(lambda q: (q, *ask(url, q, tokens, "specfit")), QUESTIONS))
        streamed = ask(url, QUESTIONS[0], tokens, "specfit", stream=True)[0]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
    diffs = [f"serve {q!r}: {text!r} != plain {plain[q]!r}" for q, text, _ in replies if text != plain[q]]
    if streamed != plain[QUESTIONS[0]]:
        diffs.append(f"serve streamed {streamed!r} != plain {plain[QUESTIONS[0]]!r}")
    batches = [stats["batch"] for _, _, stats in replies]
    if max(batches) < 2:
        diffs.append(f"serve: no two of {len(QUESTIONS)} concurrent requests shared a call (batch sizes {batches})")
    print(f"RESULT users serve: up in {up:.1f} s; {len(QUESTIONS)} concurrent requests (batch sizes {batches}, "
          f"--max-batch {max_batch}) and one streamed: "
          f"{'FAIL: ' + '; '.join(diffs) if diffs else 'every answer equal to plain decoding'}", flush=True)
    return diffs


def users(tokens: int = 16, slots: int = 24, max_batch: int = 4, serve_timeout: float = 60.0,
          log: Path | None = None) -> int:
    """The users stage (see the module's docstring): 0 when every answer equals plain decoding's."""
    import specfit
    from specfit.embedded.paths import DRAFTER_DIR, TARGET_DIR
    from specfit.evaluation.batches import left_padded, pad_id
    from transformers import AutoTokenizer

    cuda = torch.cuda.is_available() and os.environ.get("ALLOW_CPU") != "1"
    t0 = time.perf_counter()
    model = specfit.from_pretrained(TARGET_DIR, cache_slots=slots, dtype=torch.float32,
                                    device="cuda" if cuda else "cpu", drafter=str(DRAFTER_DIR))
    model.generation_config.eos_token_id = None  # every call decodes `tokens`: the rows stay comparable
    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR)
    print(f"users: the embedded model on {model.device} in {time.perf_counter() - t0:.1f} s: {model.specfit!r}",
          flush=True)
    prompts = [tokenizer(f"Question: {q}\nAnswer:", return_tensors="pt").input_ids for q in QUESTIONS[:2]]  # host
    (ids, mask), = left_padded(prompts, 2, pad_id(model))  # [2, P] on the host, as a user passes them
    failures = []
    for name in ("eagle3", "specfit"):
        failures += check_rows(model, name, ids, mask, tokens)
        failures += check_rows(model, name, prompts[1], None, tokens)
    with tempfile.TemporaryDirectory(prefix="specfit-users-") as work:
        checkpoint = fp32_checkpoint(TARGET_DIR, Path(work) / "target")
        failures += serve_check(checkpoint, DRAFTER_DIR, slots, tokens, max_batch, serve_timeout,
                                log or Path(work) / "serve.log")
    if failures:
        print("RESULT users: FAIL: " + "; ".join(failures)[:1500])
        return 1
    print("RESULT users: pass (generate() on 2 left-padded rows and one row per assistant, and `specfit serve` "
          "under concurrent requests, equal to plain decoding)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="stage", required=True)
    b = sub.add_parser("bandwidth", help="H2D of one real-size expert: registered / pin_memory / pageable; the gate")
    b.add_argument("--min-gbps", type=float, default=float(os.environ["MIN_H2D_GBPS"])
                   if os.environ.get("MIN_H2D_GBPS") else None, help="the pinned rows' floor (default: by the GPU)")
    b.add_argument("--experts", type=int, default=64, help="experts per source buffer (copies cycle through them)")
    b.add_argument("--hidden", type=int, default=2048)
    b.add_argument("--intermediate", type=int, default=768)
    u = sub.add_parser("users", help="generate() on 2 left-padded rows and `specfit serve`, against plain decoding")
    u.add_argument("--tokens", type=int, default=16)
    u.add_argument("--slots", type=int, default=24)
    u.add_argument("--max-batch", type=int, default=4)
    u.add_argument("--serve-timeout", type=float, default=60.0, help="seconds the server may take to come up")
    u.add_argument("--log", type=Path, default=None, help="the server's output (default: a temporary file)")
    args = p.parse_args(argv)
    if args.stage == "bandwidth":
        return bandwidth(args.min_gbps, args.experts, args.hidden, args.intermediate)
    return users(args.tokens, args.slots, args.max_batch, args.serve_timeout, args.log)


if __name__ == "__main__":
    sys.exit(main())
