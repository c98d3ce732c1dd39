"""Issue 37's figures: the slot cache's policies on the embedded model's real routes, replayed against Belady's MIN,
and the wall clock of AR, EAGLE-3 and SpecFit with each policy.

    python benchmarks/cache_policies.py --gsm8k 8 --cnn 6 --tokens 64 --slots 6 12 24 \
        --clock-methods ar eagle3 specfit specfit-prefetch --out DIR       # about 25 min on a quiet 2-core CPU
    python benchmarks/cache_policies.py --smoke     # 1 prompt per workload, 12 tokens, 12 slots, LRU and forecast

Held out: GSM8K test questions and CNN/DailyMail test articles from index 100 on (the bench and the demo read the
first ones). CPU, emulated link (the embedded model's structural default): not GPU speed.

1. Replay. Each method's greedy ``generate()`` calls are recorded forward by forward (``evaluation/cache_replay``:
   routes, and SpecFit's drafted-pool forecast), with ``--record-policy`` (LRU): AR's and EAGLE-3's routes do not
   depend on the cache (recorded once), SpecFit's trees do (recorded at each slot count, so another policy's replay
   of them is an estimate; part 3 measures SpecFit live). Every policy then replays each tape through the runtime's
   own slot bookkeeping, and MIN (Belady with bypass, offline) the same forwards: misses per token of the decode
   forwards, as the stats count them, and the ratio to MIN. The recording policy's replay must equal the live
   counters (checked). ``forecast, no fcst`` is the forecast policy with the recorded forecasts withheld.
2. AR with the drafter's forecast, offline (``--no-ar-forecast`` skips it): plain decoding runs no drafter, so a
   forecast costs the drafter's step per token; this records AR with that forecast, replays it, and holds the
   copies it saves (x the link's time per copy) against the drafter's time per token.
3. Clock (``--clock-slots``, ``--clock-methods``): one model per method and policy, taking turns prompt by prompt,
   each whole ``generate()`` call timed (wall clock); tok/s = new tokens over those seconds; greedy outputs checked
   identical to the first model's (AR's). Copies per token (misses and prefetches) and hit rate from the live
   counters.

Writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from specfit.evaluation.results_file import write_results

METHODS = ("ar", "eagle3", "specfit")
# clock methods: name -> (assistant, decoding options)
CLOCKED = {"ar": (None, {}), "eagle3": ("eagle3", {}), "specfit": ("specfit", {}),
           "specfit-prefetch": ("specfit", {"prefetch": True})}


def held_out(workload: str, n: int, offset: int) -> list[str]:
    from specfit.evaluation import datasets

    return datasets.prompts(workload, offset + n, max_chars=1500)[offset:]


def record(model, tokenizer, method: str, prompts: list[str], tokens: int):
    """(tape, live misses of the decode forwards) of ``method`` on ``prompts`` in order, from empty slots."""
    from specfit.evaluation.cache_replay import RouteTape

    model.specfit.clear_cache()
    recorder, misses = RouteTape(model), 0
    with recorder.recording() as tape:
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            kw = {} if method == "ar" else {"assistant": method}
            model.generate(ids, max_new_tokens=tokens, do_sample=False, **kw)
            c = model.specfit.stats.last_generate
            misses += c.misses
            tape.new_tokens += c.new_tokens
    return tape, misses


def ar_forecast(workloads, tokens: int, all_slots) -> list[dict]:
    """Plain decoding with a forecast from the drafter, offline: a greedy loop of target forwards, each followed by
    what that forecast would cost a deployment (the drafter's step on the new token, its first drafted level, the
    route predictor on that level's nodes, weighted by draft probability: the likely routes of the token after the
    next), kept on the tape as the forecast for the next forward. Replays frequency against forecast, and times the
    drafter's work against the target forwards' (interleaved, every slot resident, no link)."""
    import numpy as np

    from specfit import embedded
    from specfit.drafting.levels import TreeDrafter
    from specfit.evaluation.cache_replay import Tape, replay
    from specfit.offload.policies import tree_forecast
    from transformers import DynamicCache

    model, tokenizer = embedded.load(64, link=None)
    rt = model.specfit
    drafter = TreeDrafter(rt.drafter, topk=2, depth=1, max_pool=2)
    drafter.route_head = rt.route_predictor.routes
    copy_seconds = embedded.default_link_seconds()
    rows = []
    for workload, prompts in workloads:
        tape = Tape(len(rt.layers), rt.num_experts)
        target_s = drafter_s = 0.0
        with torch.no_grad():
            for prompt in prompts:
                ids = tokenizer(prompt, return_tensors="pt").input_ids
                cache = DynamicCache(config=model.config)
                out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
                tape.add(rt.routes.last.numpy(), counted=False)
                token = int(out.logits[0, -1].argmax())
                drafter.reset()
                drafter.extend(rt.aux_capture.features(), torch.cat([ids[:, 1:], torch.tensor([[token]])], 1))
                for _ in range(tokens - 1):
                    t0 = time.perf_counter()
                    for tree in drafter.levels():
                        pass
                    node_routes, _ = drafter.routes()
                    forecast = tree_forecast(np.asarray(tree.qs) / sum(tree.qs), node_routes)
                    t1 = time.perf_counter()
                    out = model(torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1)
                    token = int(out.logits[0, -1].argmax())
                    t2 = time.perf_counter()
                    drafter.extend(rt.aux_capture.features(), torch.tensor([[token]]))
                    drafter_s += time.perf_counter() - t2 + t1 - t0
                    target_s += t2 - t1
                    tape.add(rt.routes.last.numpy(), counted=True, forecast=forecast)
                tape.new_tokens += tokens
        steps = tape.counted.count(True)
        for slots in all_slots:
            freq, fcst = (replay(tape, slots, p) / tape.new_tokens for p in ("frequency", "forecast"))
            rows.append({"workload": workload, "slots": slots, "frequency": freq, "forecast": fcst,
                         "drafter_ms": drafter_s / steps * 1e3, "target_ms": target_s / steps * 1e3,
                         "copy_ms": copy_seconds * 1e3, "saved_copy_ms": (freq - fcst) * copy_seconds * 1e3})
    return rows


def replay_table(tape, slots: int, policies) -> dict:
    from specfit.evaluation.cache_replay import belady, replay

    n = tape.new_tokens
    row = {"MIN": belady(tape, slots) / n}
    for p in policies:
        row[p] = replay(tape, slots, p) / n
    if any(f is not None for f in tape.forecasts) and "forecast" in policies:
        row["forecast, no fcst"] = replay(tape, slots, "forecast", forecasts=False) / n
    return row


def clock(slots: int, link, methods, policies, workloads, tokens: int) -> list[dict]:
    """Per workload and (method, policy): tok/s of whole calls, copies per token, hit rate; methods and policies
    interleaved prompt by prompt (one model each, kept across workloads), every output checked against the first's."""
    from specfit import embedded

    import specfit

    models, tokenizer = {}, None
    for m in methods:
        for p in policies:
            models[m, p], tokenizer = embedded.load(slots, link=link, cache_policy=p)
            if CLOCKED[m][1]:
                specfit.configure(models[m, p], **CLOCKED[m][1])
    rows = []
    for workload, prompts in workloads:
        seconds, new, copies, misses, demand, cycles, nodes = ({k: 0 for k in models} for _ in range(7))
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            reference = None
            for (m, p), model in models.items():
                kw = {} if CLOCKED[m][0] is None else {"assistant": CLOCKED[m][0]}
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=tokens, do_sample=False, **kw)
                seconds[m, p] += time.perf_counter() - t0
                c = model.specfit.stats.last_generate
                new[m, p] += c.new_tokens
                copies[m, p] += c.copies  # misses and prefetches
                misses[m, p] += c.misses
                demand[m, p] += c.demand
                cycles[m, p] += c.cycles
                nodes[m, p] += c.nodes_verified
                if reference is None:
                    reference = out
                elif not torch.equal(out, reference):
                    raise AssertionError(f"{m} with cache_policy={p!r} changed the greedy output")
        rows += [{"workload": workload, "slots": slots, "method": m, "policy": p, "prompts": len(prompts),
                  "tok_s": new[m, p] / seconds[m, p], "seconds": seconds[m, p],
                  "copies_per_token": copies[m, p] / new[m, p], "misses_per_token": misses[m, p] / new[m, p],
                  "hit_rate": 1 - misses[m, p] / max(demand[m, p], 1), "tokens_per_cycle": new[m, p] / cycles[m, p],
                  "nodes_per_cycle": nodes[m, p] / cycles[m, p]}
                 for m, p in models]
    return rows


def main(argv=None) -> None:
    from specfit.offload.policies import POLICIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gsm8k", type=int, default=8)
    ap.add_argument("--cnn", type=int, default=6)
    ap.add_argument("--offset", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, nargs="+", default=[6, 12, 24])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--record-policy", default="lru")
    ap.add_argument("--clock-slots", type=int, nargs="*", default=[12])
    ap.add_argument("--clock-policies", nargs="+", default=["lru", "frequency", "forecast"])
    ap.add_argument("--clock-methods", nargs="+", default=list(METHODS), choices=list(CLOCKED),
                    help="methods timed (specfit-prefetch: SpecFit with prefetch=True)")
    ap.add_argument("--no-replay", dest="replay", action="store_false", help="the clock alone")
    ap.add_argument("--no-ar-forecast", dest="ar_forecast", action="store_false",
                    help="skip the offline measure of AR with the drafter's forecast")
    ap.add_argument("--link-ratio", type=float, default=1.0, help="x the structural default link; 0: no link")
    ap.add_argument("--smoke", action="store_true", help="1 prompt per workload, 12 tokens, 12 slots")
    ap.add_argument("--out", default="benchmarks/results/cache_policies")
    args = ap.parse_args(argv)
    if args.smoke:
        args.gsm8k, args.cnn, args.tokens, args.slots, args.clock_slots = 1, 1, 12, [12], [12]
        args.clock_policies = ["lru", "forecast"]
    torch.set_num_threads(1)
    from specfit import embedded
    from specfit.evaluation.cache_replay import replay

    link = embedded.default_link(args.link_ratio) if args.link_ratio > 0 else None
    shown = "none" if link is None else \
        f"{link.label}, {embedded.link_seconds_per_expert(link) * 1e3:.3f} ms per bf16 expert copy"
    print(f"link: {shown}; load average {os.getloadavg()[0]:.2f}", flush=True)
    results = {"args": vars(args), "replay": [], "clock": []}
    t_start = time.perf_counter()
    workloads = [(w, held_out(w, n, args.offset)) for w, n in (("gsm8k", args.gsm8k), ("cnn", args.cnn)) if n > 0]
    for method in args.methods if args.replay else ():
        once = method != "specfit"  # AR's and EAGLE-3's routes do not depend on the slots: recorded once
        loaded = {}  # slots -> (model, tokenizer), kept across workloads (each tape starts from empty slots)
        for workload, prompts in workloads:
            tape = None
            for slots in args.slots:
                if tape is None or not once:
                    record_slots = args.slots[0] if once else slots
                    if record_slots not in loaded:
                        loaded[record_slots] = embedded.load(record_slots, link=link, cache_policy=args.record_policy)
                    tape, live = record(*loaded[record_slots], method, prompts, args.tokens)
                    replayed = replay(tape, record_slots, args.record_policy)
                    if replayed != live:
                        raise AssertionError(f"{method}: the replay of {args.record_policy} gives {replayed} misses, "
                                             f"the live counters {live}")
                row = replay_table(tape, slots, args.policies)
                results["replay"].append({"workload": workload, "method": method, "slots": slots,
                                          "prompts": len(prompts), "new_tokens": tape.new_tokens, **row})
                cells = "  ".join(f"{k} {v:6.1f} ({v / row['MIN']:.2f})" for k, v in row.items() if k != "MIN")
                print(f"{workload:5s} {method:7s} {slots:2d} slots  MIN {row['MIN']:6.1f}  {cells}  "
                      f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
    if args.replay and args.ar_forecast and "ar" in args.methods:
        rows = ar_forecast(workloads, args.tokens, args.slots)
        print("\nAR with the drafter's forecast (offline; every slot resident while timing, no link): misses per "
              "token, and what it would cost per token against what it would save")
        for r in rows:
            print(f"  {r['workload']:5s} {r['slots']:2d} slots: frequency {r['frequency']:6.1f}, forecast "
                  f"{r['forecast']:6.1f}; drafter {r['drafter_ms']:.2f} ms per token (target forward "
                  f"{r['target_ms']:.2f} ms) against copies saved x {r['copy_ms']:.3f} ms = "
                  f"{r['saved_copy_ms']:.2f} ms ({'pays' if r['saved_copy_ms'] > r['drafter_ms'] else 'does not pay'})",
                  flush=True)
        results["ar_forecast"] = rows
    for slots in args.clock_slots:
        rows = clock(slots, link, args.clock_methods, args.clock_policies, workloads, args.tokens)
        for workload, prompts in workloads:
            mine = [r for r in rows if r["workload"] == workload]
            first = {r["method"]: r for r in mine if r["policy"] == args.clock_policies[0]}
            print(f"\n== clock: {workload}, {slots} slots, {len(prompts)} prompts x {args.tokens} tokens, whole "
                  f"generate() calls, interleaved (emulated link, CPU; load average {os.getloadavg()[0]:.2f})")
            for r in mine:
                base = first[r["method"]]
                r.update(speed_vs_first=r["tok_s"] / base["tok_s"],
                         copies_vs_first=r["copies_per_token"] / base["copies_per_token"])
                print(f"  {r['method']:7s} {r['policy']:14s} tok/s {r['tok_s']:6.2f} (x{r['speed_vs_first']:.2f})  "
                      f"copies/token {r['copies_per_token']:6.1f} (x{r['copies_vs_first']:.2f})  "
                      f"hit {r['hit_rate']:.2f}  nodes/cycle {r['nodes_per_cycle']:.2f}  tokens/cycle "
                      f"{r['tokens_per_cycle']:.2f}", flush=True)
        results["clock"] += rows
    print(f"\n{time.perf_counter() - t_start:.0f} s in all; results in {write_results(args.out, results)}")


if __name__ == "__main__":
    main()
