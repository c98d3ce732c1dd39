"""`specfit serve` under load, on the embedded model (CPU, emulated host link as `specfit serve` defaults to).

1. Server overhead: per prompt, generate(assistant="specfit") called directly and the same greedy request through
   the server with the openai client, interleaved prompt by prompt; tok/s = completion tokens / wall clock of the
   call (the client's wall clock for the server). Goal: client tok/s >= 0.9x generate()'s.
2. 8 concurrent clients x 3 requests each, once per --max-batch value (a server each, same model; the values take
   turns --load-rounds times): p50 / p95 latency, aggregate tok/s, the batch sizes the calls ran at, every answer
   checked against plain greedy generate(), none lost or crossed.

    python benchmarks/serve_load.py [--slots 12] [--max-tokens 32] [--rounds 2] [--max-batch 1 4] [--load-rounds 1]
                                    [--out results.json]
"""

import argparse
import concurrent.futures
import json
import statistics
import time

import openai
import torch

from specfit import embedded
from specfit.serving import Server, build_app

QUESTIONS = ["Tom has 3 boxes with 12 apples in each box. He gives away 10 apples. How many apples does he have left?",
             "A train travels 60 km in one hour. How far does it travel in 3 hours and 30 minutes?",
             "Sara buys 4 notebooks at 3 dollars each and a pen for 2 dollars. How much does she pay?",
             "A class has 28 students. Half of them play football. How many students play football?",
             "Anna reads 12 pages a day. How many pages does she read in two weeks?",
             "A shop sells 5 pens for 10 dollars. How much do 8 pens cost?",
             "A farmer has 40 cows and sells a quarter of them. How many cows are left?",
             "Ben saves 6 dollars a week. How many weeks does he need to save 54 dollars?"]


def percentile(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--slots", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the prompts for the overhead")
    p.add_argument("--max-batch", type=int, nargs="+", default=[1, 4],
                   help="server batch limits compared under load (1: each request alone)")
    p.add_argument("--load-rounds", type=int, default=1, help="turns each --max-batch value takes under load")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = embedded.load(args.slots, link=embedded.default_link())
    server = Server(build_app(model, tokenizer), host="127.0.0.1", port=0).start()
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600)
    messages = {q: [{"role": "user", "content": q}] for q in QUESTIONS}
    prompts = {q: tokenizer.apply_chat_template(messages[q], add_generation_prompt=True, tokenize=False)
               for q in QUESTIONS}
    expected = {}
    for q in QUESTIONS:  # plain greedy: the reference every answer must equal (and a warm-up)
        ids = tokenizer(prompts[q], return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
        expected[q] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()  # a chat reply
    client.chat.completions.create(model="specfit", messages=messages[QUESTIONS[0]], max_tokens=4, temperature=0)

    # 1. overhead, interleaved
    direct_tokens = direct_seconds = served_tokens = served_seconds = 0.0
    mismatches = 0
    for _ in range(args.rounds):
        for q in QUESTIONS:
            ids = tokenizer(prompts[q], return_tensors="pt").input_ids
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
    direct, served = direct_tokens / direct_seconds, served_tokens / served_seconds

    server.stop()

    # 2. 8 clients x 3 requests, per --max-batch value, the values taking turns
    def client_run(url, q):
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        got = []
        for _ in range(3):
            t = time.perf_counter()
            reply = c.chat.completions.create(model="specfit", messages=messages[q], max_tokens=args.max_tokens,
                                              temperature=0)
            got.append((q, reply.choices[0].message.content, reply.id, time.perf_counter() - t,
                        reply.usage.completion_tokens, reply.model_extra["specfit"]["batch"]))
        return got

    loads = {n: [] for n in args.max_batch}
    for _ in range(args.load_rounds):
        for n in args.max_batch:
            server = Server(build_app(model, tokenizer, max_batch=n), host="127.0.0.1", port=0).start()
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                results = [r for rs in pool.map(lambda q: client_run(server.url, q), QUESTIONS) for r in rs]
            loads[n].append((results, time.perf_counter() - t))
            server.stop()
    report = {
        "machine": "2-core CPU; embedded model, emulated host link (default); server and clients in one process",
        "slots": args.slots, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "generate_tok_s": round(direct, 2), "client_tok_s": round(served, 2), "ratio": round(served / direct, 3),
        "overhead_mismatches": mismatches, "load": {},
    }
    for n, runs in loads.items():
        results = [r for rs, _ in runs for r in rs]
        seconds = sum(s for _, s in runs)
        latencies = [r[3] for r in results]
        report["load"][f"max_batch={n}"] = {
            "responses": len(results), "distinct_ids": len({r[2] for r in results}),
            "wrong": sum(r[1] != expected[r[0]] for r in results),
            "latency_p50_s": round(statistics.median(latencies), 2),
            "latency_p95_s": round(percentile(latencies, .95), 2), "wall_s": round(seconds, 2),
            "aggregate_tok_s": round(sum(r[4] for r in results) / seconds, 2),
            "requests_by_batch_size": {str(b): sum(r[5] == b for r in results) for b in sorted({r[5] for r in results})},
        }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
