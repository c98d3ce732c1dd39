"""Quality: what SpecFit's outputs are where plain fp32 identity is not the whole story (issue 35; the soak).

    python benchmarks/run.py quality near-ties --slots 6 24 --gsm8k 8 --cnn 8 --tokens 64   # ~40 min on a CPU
    python benchmarks/run.py quality near-ties --smoke                 # 1 GSM8K + 1 CNN prompt, 24 tokens, 6 slots
    python benchmarks/run.py quality seeded --prompts 2 --repeats 10 --tokens 48   # --smoke: 1 prompt, 3 x 12 tokens
    python benchmarks/run.py quality soak --calls 300 --json soak.json

Prompts: GSM8K and CNN/DailyMail test items from --offset on (the soak: the first ones). CPU: not GPU speed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import warnings
from pathlib import Path

import torch

from calibrating import held_out, run_part, slot_count  # this folder's shared helpers
from specfit.cli_checks import at_least
from specfit.evaluation.results_file import write_results

METHODS = (None, "eagle3", "specfit")  # near-ties: AR (the enabled model, no assistant), EAGLE-3, SpecFit
GREEDY = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)
SMOKE = {"near-ties": dict(slots=[6], gsm8k=1, cnn=1, tokens=24), "seeded": dict(prompts=1, repeats=3, tokens=12)}


def plain_references(tokenizer, prompts: list[str], tokens: int) -> tuple[list[dict], list[float]]:
    """Plain transformers' bf16 greedy tokens and logits per prompt, and the shape noise of every position."""
    from transformers import AutoModelForCausalLM

    from specfit.embedded.paths import TARGET_DIR
    from specfit.evaluation import near_ties

    plain = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.bfloat16)
    refs, noise = [], []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids  # [1, T]
        out = plain.generate(ids, max_new_tokens=tokens, **GREEDY)
        logits = near_ties.step_logits(out)  # [n, V]
        refs.append({"ids": ids, "tokens": near_ties.new_tokens(out, ids.shape[1]), "logits": logits})
        noise += near_ties.shape_noise(plain, out.sequences, ids.shape[1], logits)
    return refs, noise


def judged(slots: int, link, refs: list[dict], tokens: int, unit: float, k: float) -> list[dict]:
    """Each method's bf16 greedy output judged against plain's (``near_ties.judge``), taking turns; a row each."""
    from specfit import embedded
    from specfit.evaluation import near_ties

    model, _ = embedded.load(slots, dtype=torch.bfloat16, link=link)
    verdicts = {m: [] for m in METHODS}
    for ref in refs:
        for method in METHODS:
            out = model.generate(ref["ids"], max_new_tokens=tokens, assistant=method, **GREEDY)
            got = near_ties.new_tokens(out, ref["ids"].shape[1])
            verdicts[method].append(near_ties.judge(ref["tokens"], ref["logits"], got, near_ties.step_logits(out),
                                                    unit, k))
    rows = []
    for method, vs in verdicts.items():
        diverged = [v for v in vs if v.divergence is not None]
        compared = sum(v.compared for v in vs)
        rows.append({
            "slots": slots, "method": method or "ar", "prompts": len(vs),
            "first_token_equal": sum(v.first_token_equal for v in vs), "identical": len(vs) - len(diverged),
            "divergences": len(diverged), "tokens_compared": compared,
            "divergences_per_1000_tokens": 1000 * len(diverged) / max(compared, 1),
            "divergence_gaps_units": [round(v.gap_units, 3) for v in diverged],
            "divergence_gaps_logits": [round(v.gap, 4) for v in diverged],
            "divergence_positions": [v.divergence for v in diverged],
            "max_deviation_units": max(v.deviation_units for v in vs),
            "near_ties": sum(v.near_tie for v in diverged), "ok": sum(v.ok for v in vs),
            "verdicts": [v.as_dict() for v in vs]})
    return rows


def near_ties(args) -> int:
    """bf16 greedy of AR, EAGLE-3 and SpecFit against plain transformers' bf16 generate(): first token and text
    identical, the gap at a divergence and the largest logit deviation in noise units (specfit.evaluation.near_ties),
    the near-tie rate. No link by default (a link changes timing, not values)."""
    from specfit import embedded
    from specfit.evaluation import near_ties as nt

    torch.set_num_threads(1)
    k = nt.K if args.k is None else args.k
    link = embedded.default_link(args.link_ratio) if args.link_ratio > 0 else None
    prompts = held_out("gsm8k", args.gsm8k, args.offset) + held_out("cnn", args.cnn, args.offset)
    tokenizer = embedded.load(1, drafter=False)[1]
    t0 = time.perf_counter()
    refs, noise = plain_references(tokenizer, prompts, args.tokens)
    plain_logits = torch.cat([r["logits"] for r in refs])  # [positions, V]
    unit = nt.noise_unit(noise, plain_logits, torch.bfloat16)
    q = torch.tensor(noise).quantile(torch.tensor([0.5, 0.9, 0.99])).tolist()
    thresholds = {"median noise": q[0], "p99 noise": q[2], "1 unit": unit, "2 units": 2 * unit,
                  f"{k:g} units": k * unit}
    result = {"dtype": "bfloat16", "prompts": len(prompts), "tokens": args.tokens, "k": k,
              "link": None if link is None else link.label, "noise_unit": unit, "noise_max": max(noise),
              "noise_quantiles": {"p50": q[0], "p90": q[1], "p99": q[2]}, "noise_positions": len(noise),
              "near_tie_rate": {name: nt.near_tie_rate(plain_logits, t) for name, t in thresholds.items()},
              "rows": []}
    print(f"bf16, {len(prompts)} held-out prompts x {args.tokens} tokens; shape noise over {len(noise)} positions "
          f"(logits): median {q[0]:.4f}, p90 {q[1]:.4f}, p99 {q[2]:.4f}, max {max(noise):.4f}; noise unit "
          f"{unit:.4f}", flush=True)
    print("plain positions whose top-1/top-2 gap is within " + ", ".join(
        f"{name} ({t:.3f}): {result['near_tie_rate'][name]:.1%}" for name, t in thresholds.items()), flush=True)
    print("slots method   first-token identical divergences /1000tok gaps (logits)      max-dev(units) ok")
    for slots in args.slots:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the bf16 embedded model has no calibrated profile: timing only
            rows = judged(slots, link, refs, args.tokens, unit, k)
        for r in rows:
            print(f"{slots:5d} {r['method']:8s} {r['first_token_equal']:3d}/{r['prompts']:<7d} "
                  f"{r['identical']:3d}/{r['prompts']:<5d} {r['divergences']:11d} "
                  f"{r['divergences_per_1000_tokens']:7.1f} {str(r['divergence_gaps_logits']):24s} "
                  f"{r['max_deviation_units']:10.2f} {r['ok']:3d}/{r['prompts']}", flush=True)
        result["rows"] += rows
    result["seconds"] = time.perf_counter() - t0
    print(f"{result['seconds']:.0f} s; wrote {write_results(args.out, result)}")
    return 0


def seeded(args) -> int:
    """torch.manual_seed(seed), then the same sampling generate(assistant="specfit") call --repeats times per prompt
    on one model (fp32, the default emulated link): how many distinct texts (1 is the goal) while the acceptance
    model, backoff and slot cache change between calls; and whether EAGLE-3 under that seed gives the same text."""
    from specfit import embedded

    torch.set_num_threads(1)
    gsm = (args.prompts + 1) // 2
    prompts = held_out("gsm8k", gsm, args.offset) + held_out("cnn", args.prompts - gsm, args.offset)
    model, tokenizer = embedded.load(args.slots, link=embedded.default_link())
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.tokens)
    t0, rows = time.perf_counter(), []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids  # [1, T]
        outs, learned = [], []
        for _ in range(args.repeats):
            torch.manual_seed(args.seed)
            outs.append(model.generate(ids, assistant="specfit", **sampling)[0, ids.shape[1]:].tolist())
            learned.append(model.specfit.acceptance_models["sampling"].labels_seen)
        torch.manual_seed(args.seed)
        eagle = model.generate(ids, assistant="eagle3", **sampling)[0, ids.shape[1]:].tolist()
        rows.append(row := {
            "prompt": text[:60], "repeats": args.repeats, "distinct_texts": len({tuple(o) for o in outs}),
            "same_as_first": sum(o == outs[0] for o in outs), "eagle3_same": eagle == outs[0],
            "labels_seen_after_each_call": learned, "text": tokenizer.decode(outs[0])})
        print(f"{row['same_as_first']}/{args.repeats} calls gave the first call's text ({row['distinct_texts']} "
              f"distinct); EAGLE-3 same text: {row['eagle3_same']}; acceptance labels seen "
              f"{learned[0]} -> {learned[-1]}: {text[:50]!r}", flush=True)
    result = {"slots": args.slots, "link": model.specfit.link_label, "seed": args.seed, "sampling": sampling,
              "rows": rows, "seconds": time.perf_counter() - t0}
    print(f"{result['seconds']:.0f} s; wrote {write_results(args.out, result)}")
    return 0


def rss_mb() -> float:
    """Resident set size of this process, MB (Linux /proc; 0 where it is not available)."""
    try:
        return next(int(line.split()[1]) / 1024 for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0


def soak(args) -> int:
    """Mixed calls on one model as a long-running app makes them (AR, EAGLE-3, SpecFit; greedy and sampled; streamers;
    configure every 25 calls; 4-thread bursts), every greedy one checked against generate() without an assistant:
    RSS after each third, ms per new token of the first and last third (drift: a leak, a slowdown). Exit 1: a miss."""
    import specfit
    from specfit import embedded
    from specfit.evaluation import datasets, demo
    from transformers import TextStreamer

    torch.set_num_threads(1)
    link = embedded.default_link()
    try:
        texts = datasets.prompts("gsm8k", args.gsm8k, max_chars=600) + datasets.prompts("cnn", args.cnn, max_chars=900)
    except datasets.DataUnavailable:  # the demo's built-in prompts
        texts = demo.FALLBACK["gsm8k"][:args.gsm8k] + demo.FALLBACK["cnn"][:args.cnn]
    model, tokenizer = embedded.load(args.slots, link=link)
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]  # each [1, T]
    rng, lock, reference = random.Random(args.seed), threading.Lock(), {}

    def expected(i: int, n: int) -> torch.Tensor:
        with lock:
            if (i, n) not in reference:
                reference[(i, n)] = model.generate(prompts[i], max_new_tokens=n, do_sample=False, assistant=None)
            return reference[(i, n)]

    class Quiet(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            pass

    quiet = Quiet(tokenizer, skip_prompt=True)

    def one_call(k: int) -> tuple[float, int, bool | None]:
        i, n, sample, method = rng.randrange(len(prompts)), rng.choice(args.lengths), k % 7 == 3, METHODS[k % 3]
        kw = dict(max_new_tokens=n, do_sample=sample, assistant=method, streamer=quiet if k % 11 == 5 else None)
        kw.update(dict(temperature=0.8, top_p=0.95) if sample else {})
        t0 = time.perf_counter()
        out = model.generate(prompts[i], **kw)
        seconds = time.perf_counter() - t0
        return seconds, out.shape[1] - prompts[i].shape[1], None if sample else torch.equal(out, expected(i, n))

    for i in range(len(prompts)):  # references first: their calls are not part of the soak
        for n in args.lengths:
            expected(i, n)
    records, thirds, started, k = [], [], time.time(), 0
    while k < args.calls:
        if args.threads_every and k and k % args.threads_every == 0:
            burst = [None] * 4
            ts = [threading.Thread(target=lambda j=j: burst.__setitem__(j, one_call(k + j))) for j in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            records, k = records + burst, k + 4
        else:
            records, k = records + [one_call(k)], k + 1
        if k % 25 == 0:
            specfit.configure(model, max_nodes=rng.choice((5, 7)))
        while len(records) >= (len(thirds) + 1) * args.calls / 3:  # a burst may end two thirds
            thirds.append(rss_mb())
    third = len(records) // 3

    def ms_per_token(rs):
        return 1e3 * sum(s for s, _, _ in rs) / max(1, sum(n for _, n, _ in rs))

    greedy = [same for _, _, same in records if same is not None]
    report = dict(calls=len(records), slots=args.slots, link=model.specfit.link_label,
                  link_ms=embedded.link_seconds_per_expert(link) * 1e3, wall_seconds=time.time() - started,
                  greedy_identical=sum(greedy), greedy_calls=len(greedy), rss_mb_after_each_third=thirds,
                  rss_growth_mb_last_two_thirds=thirds[-1] - thirds[0] if thirds else 0.0,
                  ms_per_token_first_third=ms_per_token(records[:third]),
                  ms_per_token_last_third=ms_per_token(records[-third:]),
                  median_ms_per_token=statistics.median(1e3 * s / max(1, n) for s, n, _ in records))
    print(json.dumps(report, indent=1))
    if args.json:
        print(f"wrote {write_results(Path(args.json).parent, report, Path(args.json).name)}")
    return 0 if report["greedy_identical"] == report["greedy_calls"] else 1


def check(args) -> None:
    """Bad values named before any model loads (ValueError); --smoke's settings in place."""
    vars(args).update(SMOKE[args.part] if getattr(args, "smoke", False) else {})
    at_least(args, 0, *(k for k in ("offset", "threads_every", "gsm8k", "cnn") if hasattr(args, k)))
    if args.part == "near-ties":
        at_least(args, 2, "tokens", why="the shape noise is measured from the second new token on")
    at_least(args, 1, *(k for k in ("calls", "prompts", "repeats", "tokens") if hasattr(args, k)))
    if hasattr(args, "gsm8k") and args.gsm8k + args.cnn < 1:
        raise ValueError(f"--gsm8k {args.gsm8k} --cnn {args.cnn}: at least one prompt is needed")
    if args.part == "near-ties" and (args.link_ratio < 0 or (args.k is not None and args.k <= 0)):
        raise ValueError(f"--link-ratio {args.link_ratio} must be >= 0 (0: no link) and --k {args.k} above 0")
    if args.part == "seeded" and not (args.temperature > 0 and 0 < args.top_p <= 1):
        raise ValueError(f"--temperature {args.temperature} must be above 0 and --top-p {args.top_p} in (0, 1]")
    if args.part == "soak" and min(args.lengths) < 1:
        raise ValueError(f"--lengths {' '.join(map(str, args.lengths))}: every length must be 1 or more")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="run.py quality", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="part", required=True)
    n = sub.add_parser("near-ties", help=near_ties.__doc__)
    n.add_argument("--slots", type=slot_count, nargs="+", default=[6, 24])
    n.add_argument("--gsm8k", type=int, default=8)
    n.add_argument("--cnn", type=int, default=8)
    n.add_argument("--k", type=float, default=None, help="near-tie threshold in noise units (default: near_ties.K)")
    n.add_argument("--link-ratio", type=float, default=0.0, help="x the structural default link; 0: no link")
    s = sub.add_parser("seeded", help=seeded.__doc__)
    s.add_argument("--prompts", type=int, default=2, help="held-out prompts: half GSM8K, half CNN/DailyMail")
    s.add_argument("--repeats", type=int, default=10)
    s.add_argument("--slots", type=slot_count, default=12)
    s.add_argument("--seed", type=int, default=1234)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-p", type=float, default=0.95)
    for q, tokens, out in ((n, 64, "benchmarks/results/bf16_near_ties"), (s, 48, "benchmarks/results/seeded_repeats")):
        q.add_argument("--tokens", type=int, default=tokens, help="new tokens per call")
        q.add_argument("--offset", type=int, default=100, help="first held-out test item")
        q.add_argument("--smoke", action="store_true", help=f"a quick run: {SMOKE[q.prog.split()[-1]]}")
        q.add_argument("--out", default=out, help="the results folder")
    k = sub.add_parser("soak", help=soak.__doc__)
    k.add_argument("--calls", type=int, default=300)
    k.add_argument("--slots", type=slot_count, default=12, help="expert slots per layer (of 64)")
    k.add_argument("--threads-every", type=int, default=50, help="every N calls, 4 calls from 4 threads (0: never)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--gsm8k", type=int, default=6, help="GSM8K test prompts (the first ones)")
    k.add_argument("--cnn", type=int, default=4, help="CNN/DailyMail test prompts (the first ones)")
    k.add_argument("--lengths", type=int, nargs="+", default=[8, 24, 48], help="new tokens per call, drawn from these")
    k.add_argument("--json", default=None, help="write the report to this file too")
    for q, run in ((n, near_ties), (s, seeded), (k, soak)):
        q.set_defaults(run=run, parser=q)
    return run_part(p, argv, check)
