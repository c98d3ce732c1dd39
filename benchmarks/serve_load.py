"""`specfit serve` under load, on the embedded model (CPU, emulated host link as `specfit serve` defaults to; every
figure is labelled so: not GPU speed).

1. Server overhead: per prompt, generate(assistant="specfit") called directly and the same greedy request through
   the server with the openai client, interleaved prompt by prompt; tok/s = completion tokens / wall clock of the
   call (the client's wall clock for the server). Goal: client tok/s >= 0.9x generate()'s.
2. CLIENTS concurrent clients x REQUESTS requests each (default 8 x 3, greedy), against a server per --max-batch
   value and --assistant, in a process per --python interpreter (e.g. a transformers 5.25 venv and a 5.24 one,
   every server started and warmed up first); each load is one turn, the interpreters taking turns load by load
   (their order rotating), --load-rounds times: p50 / p95 latency, aggregate tok/s (completion tokens / wall clock
   of the loads; per turn too), tokens per CPU second of the server's process (less noisy than the clock on a
   shared machine), the batch sizes the calls ran at, every answer checked against plain greedy generate(), none
   lost or crossed.

    python benchmarks/serve_load.py [--slots 12] [--max-tokens 32] [--link-ms MS] [--rounds 2] [--max-batch 1 4]
        [--assistant specfit none] [--python PY ...] [--load-rounds 1] [--clients 8] [--requests 3] [--out FILE]
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

QUESTIONS = ["Tom has 3 boxes with 12 apples in each box. He gives away 10 apples. How many apples does he have left?",
             "A train travels 60 km in one hour. How far does it travel in 3 hours and 30 minutes?",
             "Sara buys 4 notebooks at 3 dollars each and a pen for 2 dollars. How much does she pay?",
             "A class has 28 students. Half of them play football. How many students play football?",
             "Anna reads 12 pages a day. How many pages does she read in two weeks?",
             "A shop sells 5 pens for 10 dollars. How much do 8 pens cost?",
             "A farmer has 40 cows and sells a quarter of them. How many cows are left?",
             "Ben saves 6 dollars a week. How many weeks does he need to save 54 dollars?"]
SRC = Path(__file__).resolve().parents[1] / "src"


def percentile(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def setup(args):
    import torch

    from specfit import embedded
    torch.set_num_threads(1)
    link = embedded.default_link() if args.link_ms is None else args.link_ms / 1e3
    return embedded.load(args.slots, link=link)


def references(model, tokenizer, questions, max_tokens):
    """Plain greedy generate() per question: the chat reply every served answer must equal (and a warm-up)."""
    expected = {}
    for q in questions:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        expected[q] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return expected


def ask_all(url, questions, expected, args) -> dict:
    """CLIENTS concurrent clients x REQUESTS greedy requests each against ``url``; every answer checked."""
    import openai

    def client_run(q):
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        got = []
        for _ in range(args.requests):
            t = time.perf_counter()
            reply = c.chat.completions.create(model="specfit", messages=[{"role": "user", "content": q}],
                                              max_tokens=args.max_tokens, temperature=0)
            got.append([q, reply.choices[0].message.content == expected[q], reply.id, time.perf_counter() - t,
                        reply.usage.completion_tokens, reply.model_extra["specfit"]["batch"]])
        return got

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        results = [r for rs in pool.map(client_run, questions) for r in rs]
    return {"results": results, "seconds": time.perf_counter() - t}


def overhead(args, model, tokenizer, expected):
    """Part 1, in this interpreter: generate() against the same request served, interleaved."""
    import openai
    import transformers

    from specfit.serving import Server, build_app

    server = Server(build_app(model, tokenizer), host="127.0.0.1", port=0).start()
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600)
    messages = {q: [{"role": "user", "content": q}] for q in QUESTIONS}
    client.chat.completions.create(model="specfit", messages=messages[QUESTIONS[0]], max_tokens=4, temperature=0)
    direct_tokens = direct_seconds = served_tokens = served_seconds = 0.0
    mismatches = 0
    for _ in range(args.rounds):
        for q in QUESTIONS:
            ids = tokenizer.apply_chat_template(messages[q], add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False, assistant="specfit")
            direct_seconds += time.perf_counter() - t
            direct_tokens += out.shape[1] - ids.shape[1]
            t = time.perf_counter()
            reply = client.chat.completions.create(model="specfit", messages=messages[q],
                                                   max_tokens=args.max_tokens, temperature=0)
            served_seconds += time.perf_counter() - t
            served_tokens += reply.usage.completion_tokens
            mismatches += reply.choices[0].message.content != expected[q]
    server.stop()
    direct, served = direct_tokens / direct_seconds, served_tokens / served_seconds
    return {"transformers": transformers.__version__, "generate_tok_s": round(direct, 2),
            "client_tok_s": round(served, 2), "ratio": round(served / direct, 3), "mismatches": mismatches}


def run_name(max_batch: int, assistant) -> str:
    return f"max_batch={max_batch} assistant={assistant or 'none'}"


def serve_child(args) -> None:
    """In a child interpreter (one per transformers release): a server per (max_batch, assistant) over one model,
    warmed up; prints their URLs as one JSON line and serves until its stdin closes."""
    import openai
    import transformers

    from specfit.serving import Server, build_app

    model, tokenizer = setup(args)
    servers = {run_name(n, a): Server(build_app(model, tokenizer, max_batch=n, assistant=a), host="127.0.0.1",
                                      port=0).start() for n in args.max_batch for a in args.assistant}
    for server in servers.values():
        openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600).chat.completions.create(
            model="specfit", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=4, temperature=0)
    print(json.dumps({"transformers": transformers.__version__, "pid": os.getpid(),
                      "urls": {name: server.url for name, server in servers.items()}}), flush=True)
    sys.stdin.read()
    for server in servers.values():
        server.stop()


def start_child(python: str, args) -> tuple[subprocess.Popen, dict]:
    argv = [python, __file__, "--child", "--slots", str(args.slots), "--max-tokens", str(args.max_tokens),
            *([] if args.link_ms is None else ["--link-ms", str(args.link_ms)]), "--max-batch",
            *map(str, args.max_batch), "--assistant", *[a or "none" for a in args.assistant]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"{python}: the server child failed:\n{process.stderr.read()[-3000:]}")
    return process, json.loads(line)


def cpu_seconds(pid: int) -> float | None:
    """A process's CPU time (user + system, all its threads), from /proc (None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(runs: list[dict]) -> dict:
    results = [r for run in runs for r in run["results"]]
    seconds = sum(run["seconds"] for run in runs)
    cpu = None if any(run["cpu_seconds"] is None for run in runs) else sum(run["cpu_seconds"] for run in runs)
    tokens = sum(r[4] for r in results)
    latencies = [r[3] for r in results]
    return {"responses": len(results), "distinct_ids": len({r[2] for r in results}),
            "wrong": sum(not r[1] for r in results), "latency_p50_s": round(statistics.median(latencies), 2),
            "latency_p95_s": round(percentile(latencies, .95), 2), "wall_s": round(seconds, 2),
            "aggregate_tok_s": round(tokens / seconds, 2),
            # the server process's CPU time (handlers and engine): on a shared machine less noisy than the clock
            "server_cpu_s": cpu and round(cpu, 2), "tokens_per_server_cpu_second": cpu and round(tokens / cpu, 2),
            "per_turn_tok_s": [round(sum(r[4] for r in run["results"]) / run["seconds"], 2) for run in runs],
            "requests_by_batch_size": {str(b): sum(r[5] == b for r in results)
                                       for b in sorted({r[5] for r in results})}}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--slots", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--link-ms", type=float, default=None,
                   help="emulated ms per expert copy (default: the structural default link, as specfit serve)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the prompts for the overhead "
                                                          "(0: skip part 1)")
    p.add_argument("--max-batch", type=int, nargs="+", default=[1, 4],
                   help="server batch limits compared under load (1: each request alone)")
    p.add_argument("--assistant", nargs="+", default=["specfit"], help="assistants served under load ('none')")
    p.add_argument("--python", nargs="+", default=[sys.executable],
                   help="interpreters whose transformers serve the load, taking turns (default: this one)")
    p.add_argument("--load-rounds", type=int, default=1, help="turns each server takes under load")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=3, help="requests per client")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.assistant = [None if a == "none" else a for a in args.assistant]
    if args.child:
        return serve_child(args)
    link = "the default link" if args.link_ms is None else f"{args.link_ms:g} ms per copy"
    report = {"machine": f"CPU (os.cpu_count()={os.cpu_count()}); embedded model, EMULATED host link ({link}); "
                         f"clients in this process, each release's servers in a process of its own; not GPU speed",
              "slots": args.slots, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "clients": args.clients, "requests_per_client": args.requests}
    from specfit.serving.templates import install_plain_template

    model, tokenizer = setup(args)
    install_plain_template(tokenizer)
    expected = references(model, tokenizer, QUESTIONS, args.max_tokens)  # plain greedy: equal on every release
    if args.rounds:
        report["overhead"] = overhead(args, model, tokenizer, expected)
    children = [start_child(python, args) for python in args.python]
    turns: dict[str, dict[str, list]] = {}
    try:
        for r in range(args.load_rounds):
            for name in (run_name(n, a) for n in args.max_batch for a in args.assistant):
                order = children[r % len(children):] + children[:r % len(children)]  # rotating
                for process, info in order:
                    cpu = cpu_seconds(info["pid"])
                    run = ask_all(info["urls"][name], QUESTIONS[:args.clients], expected, args)
                    after = cpu_seconds(info["pid"])
                    run["cpu_seconds"] = None if cpu is None or after is None else after - cpu
                    turns.setdefault(f"transformers {info['transformers']}", {}).setdefault(name, []).append(run)
    finally:
        for process, _ in children:
            process.stdin.close()
            process.wait(timeout=60)
    report["interpreters"] = {python: info["transformers"] for python, (_, info) in zip(args.python, children)}
    report["load"] = {release: {name: summary(runs) for name, runs in by_run.items()}
                      for release, by_run in turns.items()}
    print(json.dumps(report, indent=1))
    if args.out:  # a file's path: the one results helper writes it
        from specfit.evaluation.results_file import write_results

        write_results(Path(args.out).parent, report, Path(args.out).name)


if __name__ == "__main__":
    main()
