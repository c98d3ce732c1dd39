"""What users run, on the device: the GPU check's part 3 (``tests/gpu/gpu_check.py`` runs it as the ``users`` stage).

    python tests/gpu/gpu_users.py [--tokens 16] [--slots 24] [--max-batch 4] [--log serve.log]

The embedded model and drafter (they ship a tokenizer) loaded by ``specfit.from_pretrained`` on the device, in fp32:
for each assistant, ``generate()`` on 2 left-padded rows and on one row, the ids on the host as a tokenizer gives
them, tokens checked against plain decoding (``assistant=None``, transformers' own loop); then ``specfit serve`` on
the same checkpoint (as float32: the checkpoint says bfloat16, where a batch and a row alone may break near ties
apart) answers through the ``openai`` client: each question alone with plain decoding, then all of them at once (a
batch: at least two share a call) and one streamed, each answer equal to the plain one. FAILS on any difference (a
plain top-2 margin under ``NEAR_TIE`` at the first differing token is a near tie: said, not failed). On a CPU
(``ALLOW_CPU=1``) the model runs there, on the CUDA stand-in's device with ``SPECFIT_CUDA_STANDIN=1``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QUESTIONS = ["What is 7 times 8?", "A class has 28 students. Half of them play football. How many play football?",
             "Sara buys 4 notebooks at 3 dollars each. How much does she pay?", "What is 100 minus 37?"]
NEAR_TIE = 1e-4  # plain decoding's top-2 logit margin under which another kernel's rounding may pick the other


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
    diffs = serve_differences(plain, replies, streamed)
    print(f"RESULT users serve: up in {up:.1f} s; {len(QUESTIONS)} concurrent requests (batch sizes "
          f"{[stats['batch'] for _, _, stats in replies]}, --max-batch {max_batch}) and one streamed: "
          f"{'FAIL: ' + '; '.join(diffs) if diffs else 'every answer equal to plain decoding'}", flush=True)
    return diffs


def serve_differences(plain: dict, replies: list, streamed: str) -> list[str]:
    """What the server got wrong: ``replies`` [(question, text, its specfit counters)] against ``plain`` (question
    -> the plain answer), the streamed answer to the first question, and whether any two shared a call."""
    first = next(iter(plain))
    diffs = [f"serve {q!r}: {text!r} != plain {plain[q]!r}" for q, text, _ in replies if text != plain[q]]
    if streamed != plain[first]:
        diffs.append(f"serve streamed {streamed!r} != plain {plain[first]!r}")
    batches = [stats["batch"] for _, _, stats in replies]
    if max(batches) < 2:
        diffs.append(f"serve: no two of {len(replies)} concurrent requests shared a call (batch sizes {batches})")
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
    p.add_argument("--tokens", type=int, default=16, help="new tokens per call and per request")
    p.add_argument("--slots", type=int, default=24, help="expert slots per MoE layer (of 64)")
    p.add_argument("--max-batch", type=int, default=4, help="the server's --max-batch")
    p.add_argument("--serve-timeout", type=float, default=60.0, help="seconds the server may take to come up")
    p.add_argument("--log", type=Path, default=None, help="the server's output (default: a temporary file)")
    args = p.parse_args(argv)
    return users(args.tokens, args.slots, args.max_batch, args.serve_timeout, args.log)


if __name__ == "__main__":
    sys.exit(main())
