"""Where one decoding cycle's time goes, part by part (embedded model, CPU; an emulated host link by default).

Every part is a set of functions wrapped with a timer that keeps *exclusive* time (a part's own time, its wrapped
callees' time taken out), counted only during the decode phase of ``generate()`` (after the prefill). Methods take
turns prompt by prompt on their own model instances; every method's tokens are checked equal to AR's. Figures are ms
per decoding cycle (AR: per token) and per committed token; the instrumented runs are a few percent slower than plain
ones, so read shares and differences, not absolute speed. CPU with an emulated link: not GPU speed.

    python benchmarks/cycle_profile.py --slots 12 --link-ms 0.28 --workload gsm8k --prompts 10 --out runs/profile

Writes ``profile.json`` and ``profile.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

import specfit
from specfit import embedded
from specfit.decoding import acceptance, assistants, loop, specfit_generator
from specfit.drafting import drafter as drafter_module
from specfit.drafting import levels, tree
from specfit.evaluation import datasets
from specfit.evaluation.harness import METHODS, link_seconds, load_instances
from specfit.offload import experts, link
from specfit.seam import kv_cache
from specfit.selection import route_predictor, route_sources, selector
from specfit.stats import GenerateScope

# part -> [(owner, attribute)]: the functions whose exclusive time makes up the part
PARTS = {
    "drafter forward, committed tokens (extend)": [],  # the drafter forward inside TreeDrafter.extend (filled below)
    "drafter forwards, drafted levels": [(drafter_module.Eagle3Drafter, "forward")],
    "tree building, drafter bookkeeping": [(levels.TreeDrafter, "levels"), (levels.TreeDrafter, "_process"),
                                           (levels.TreeDrafter, "_forward"),
                                           (levels.TreeDrafter, "_add_children"), (levels.TreeDrafter, "extend"),
                                           (levels.TreeDrafter, "states"), (assistants.SpecFitGenerator, "draft"),
                                           (assistants.SpecFitGenerator, "observe"),
                                           (assistants.Eagle3Generator, "draft"),
                                           (assistants.Eagle3Generator, "select")],
    "route source": [(route_sources.PredictedRoutes, "__call__"), (route_sources, "oracle_routes"),
                     (route_predictor.RoutePredictor, "routes")],  # the head runs inside each drafted level
    "selector": [(specfit_generator, "select_subtree")],
    "verify layout": [(loop, "verify_layout")],
    "verify forward: attention and other dense": [],  # the target forward's own time (filled in below)
    "verify forward: experts function": [(experts.LayerRuntime, "forward")],
    "verify forward: emulated link wait": [(link.EmulatedLink, "wait")],
    "acceptance": [(loop, "walk"), (loop, "walk_greedy")],
    "KV compaction": [(kv_cache, "keep_kv"), (kv_cache, "crop_kv")],
    "commit, stopping criteria": [(loop._Run, "commit")],
}
TARGET_FORWARD = "verify forward: attention and other dense"
LEVELS = levels.TreeDrafter.levels  # the generator whose yields are the drafted levels
EXTEND_FORWARD = "drafter forward, committed tokens (extend)"
# drafting per level: all a cycle does before its verify forward except the forward over the committed tokens (one
# per drafted cycle whatever the levels), divided by the levels drafted
LEVEL_PARTS = ("drafter forwards, drafted levels", "tree building, drafter bookkeeping", "route source", "selector")


class Profiler:
    def __init__(self):
        self.on = False
        self.stack: list[list] = []  # [part, start, child_time]
        self.totals: dict[str, float] = defaultdict(float)
        self.levels = 0  # drafted levels yielded by TreeDrafter.levels while on

    def timed_call(self, part: str, call):
        """call() with its exclusive time added to ``part`` (its wrapped callees' time taken out)."""
        if not self.on:
            return call()
        frame = [part, time.perf_counter(), 0.0]
        self.stack.append(frame)
        try:
            return call()
        finally:
            self.stack.pop()
            spent = time.perf_counter() - frame[1]
            self.totals[part] += spent - frame[2]
            if self.stack:
                self.stack[-1][2] += spent

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            return self.timed_call(part, lambda: fn(*args, **kwargs))

        return timed

    def install(self):
        undo = []
        for part, targets in PARTS.items():
            for owner, name in targets:
                original = getattr(owner, name)
                if getattr(original, "__wrapped_by_profile__", False):
                    continue
                if inspect.isgeneratorfunction(original):
                    wrapped = self.wrap_generator(part, original)
                else:
                    wrapped = self.wrap(part, original)
                wrapped.__wrapped_by_profile__ = True
                setattr(owner, name, wrapped)
                undo.append((owner, name, original))
        return undo

    def wrap_generator(self, part, fn):
        """Generators: the time spent inside each ``next()`` counts, not the time the consumer holds them."""
        done = object()

        @functools.wraps(fn)
        def gen(*args, **kwargs):
            it = fn(*args, **kwargs)
            while True:
                value = self.timed_call(part, lambda: next(it, done))
                if value is done:
                    return
                if self.on and fn is LEVELS:
                    self.levels += 1
                yield value

        return gen


def same_levels_method(depth: int) -> str:
    """EAGLE-3 drafting ``depth`` levels, a method of this run: SpecFit's drafting per level compares with EAGLE-3's
    at the same number of levels (the per-cycle work of drafting, the extend and the first level, spread alike)."""
    name = f"eagle3-depth{depth}"
    METHODS[name] = replace(METHODS["eagle3"], label=f"EAGLE-3 + cache, depth {depth}", options=(("depth", depth),))
    return name


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    methods = list(args.methods)
    if args.eagle3_depth:
        methods.insert(1 if methods[0] == "eagle3" else 0, same_levels_method(args.eagle3_depth))
    link = link_seconds(args.link_ms if args.link_ms != 0 else None)[0] if args.link_ms != 0 else None
    args.link_ms = embedded.link_seconds_per_expert(link) * 1e3 if link is not None else 0
    instances, tokenizer = load_instances(methods, args.slots, link)
    prompts = [tokenizer(t, return_tensors="pt").input_ids[:, -450:]
               for t in datasets.prompts(args.workload, args.prompts, max_chars=1800)]
    prof = Profiler()
    undo = prof.install()
    # the drafter's forward over committed tokens counts apart from the drafted levels' forwards
    orig_extend_forward = levels.TreeDrafter.extend

    def extend(self, *a, **k):
        forward = self.drafter.forward
        self.drafter.forward = prof.wrap(EXTEND_FORWARD, forward.__wrapped__.__get__(self.drafter))
        try:
            return orig_extend_forward(self, *a, **k)
        finally:
            del self.drafter.forward

    levels.TreeDrafter.extend = extend
    undo.append((levels.TreeDrafter, "extend", orig_extend_forward))
    # the target forward: each model's own forward, wrapped per instance (time outside the experts function)
    for model in instances.values():
        model.forward = prof.wrap(TARGET_FORWARD, model.forward)
    # decode phase only: on after the prefill, off at the end of the call
    orig_prefill, orig_end = GenerateScope.prefill_done, GenerateScope.end

    def prefill_done(scope):
        first = scope.after_prefill is None  # end() calls it again: only the real end of the prefill turns it on
        orig_prefill(scope)
        prof.on = prof.on or first

    def end(scope, *a, **k):
        prof.on = False
        return orig_end(scope, *a, **k)

    GenerateScope.prefill_done, GenerateScope.end = prefill_done, end
    result = {}
    try:
        parts = {m: defaultdict(float) for m in methods}
        counters = {m: specfit.Counters() for m in methods}
        drafted = {m: 0 for m in methods}
        reference = None
        for i, ids in enumerate(prompts):
            for method, model in instances.items():
                prof.totals = defaultdict(float)
                prof.levels = 0
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     assistant=METHODS[method].assistant)
                if method == methods[0]:
                    reference = out
                elif not torch.equal(out, reference):
                    raise AssertionError(f"{method} differs from {methods[0]} on prompt {i}: lossless is broken")
                if i >= 1:  # the first prompt warms up
                    counters[method] += model.specfit.stats.last_generate
                    drafted[method] += prof.levels
                    for k, v in prof.totals.items():
                        parts[method][k] += v
        for method in methods:
            c = counters[method]
            cycles = c.cycles or 1
            per_cycle = {k: 1e3 * parts[method].get(k, 0.0) / cycles for k in PARTS}
            total = 1e3 * c.decode_seconds / cycles
            per_cycle["other (loop, stats, generate() around the cycles)"] = total - sum(per_cycle.values())
            overhead = total - sum(v for k, v in per_cycle.items() if k.startswith("verify forward"))
            levels_per_cycle = drafted[method] / cycles
            per_level = sum(per_cycle[k] for k in LEVEL_PARTS) / levels_per_cycle if levels_per_cycle else 0.0
            result[method] = dict(cycle_ms=total, tokens_per_cycle=c.tokens_per_cycle,
                                  nodes_per_cycle=c.nodes_per_cycle, copies_per_token=c.copies_per_token,
                                  tok_s=c.tokens_per_second, parts_ms=per_cycle,
                                  overhead_share=overhead / total if total else 0.0,
                                  levels_per_cycle=levels_per_cycle, drafting_per_level_ms=per_level,
                                  parts_per_level_ms={k: per_cycle[k] / levels_per_cycle if levels_per_cycle else 0.0
                                                      for k in LEVEL_PARTS})
    finally:
        GenerateScope.prefill_done, GenerateScope.end = orig_prefill, orig_end
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
    return result


def table(result: dict, args) -> str:
    methods = list(result)
    lines = [f"Cycle profile: {args.workload}, {args.prompts} prompts (first one warm-up), {args.max_new_tokens} new "
             f"tokens, {args.slots} slots, " + (f"emulated link {args.link_ms} ms/copy" if args.link_ms else "no link")
             + " (CPU, instrumented; ms per cycle, AR: per token)", "",
             "| part | " + " | ".join(METHODS[m].label for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    for part in next(iter(result.values()))["parts_ms"]:
        lines.append(f"| {part} | " + " | ".join(f"{result[m]['parts_ms'][part]:.2f}" for m in methods) + " |")
    for name, key, fmt in (("**cycle (ms)**", "cycle_ms", "{:.2f}"), ("tokens per cycle", "tokens_per_cycle", "{:.2f}"),
                           ("nodes verified per cycle", "nodes_per_cycle", "{:.2f}"),
                           ("expert copies per token", "copies_per_token", "{:.2f}"),
                           ("ms per token", None, None), ("overhead share (all but the verify forward)",
                                                          "overhead_share", "{:.0%}"),
                           ("tok/s (decode, wall clock, instrumented)", "tok_s", "{:.1f}"),
                           ("levels drafted per cycle", "levels_per_cycle", "{:.2f}"),
                           ("**drafting per level drafted (ms)**", "drafting_per_level_ms", "{:.3f}")):
        if key is None:
            cells = [f"{result[m]['cycle_ms'] / (result[m]['tokens_per_cycle'] or 1):.2f}" for m in methods]
        else:
            cells = [fmt.format(result[m][key]) for m in methods]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for part in LEVEL_PARTS:
        cells = [f"{result[m]['parts_per_level_ms'][part]:.3f}" for m in methods]
        lines.append(f"| per level: {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="gsm8k", choices=["gsm8k", "cnn"])
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=12)
    p.add_argument("--link-ms", type=float, default=None,
                   help="emulated ms per expert copy; 0: no link (default: the embedded model's structural default)")
    p.add_argument("--methods", nargs="+", default=["ar", "eagle3", "specfit"], choices=list(METHODS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eagle3-depth", type=int, default=None,
                   help="also run EAGLE-3 drafting this many levels (SpecFit's levels per cycle, rounded): drafting "
                        "per level compared at the same number of levels")
    p.add_argument("--out", default=None, help="folder for profile.json and profile.md")
    args = p.parse_args(argv)
    result = run(args)
    text = table(result, args)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.json").write_text(json.dumps(dict(args=vars(args), result=result), indent=2))
        (out / "profile.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
