"""The rules suite: what SpecFit's pure decision rules cost per call, and how near the batch rule gets to its optimum.

- ``selector``: ``select_subtree``'s wall and thread CPU time on pools shaped like the paper's (top-2 EAGLE expansion
  to depth 5, 18 nodes; 48 layers x 128 experts top-8, a child keeping each parent expert with p=0.5).
- ``slot-plan``: one layer's slot plan (``SlotBook.plan`` + ``confirm``, 48 per forward of the embedded model) per
  policy on traces like the embedded model's (64 experts top-4, Zipf popularity): decode steps, verify forwards of 8
  tokens, an untimed 128-token prompt every 64. Thread CPU us per plan in the best round / wall us in the median
  round (misses per forward). ``--reference FILE``: another ``LRUSlots`` beside them (e.g. the one before the policy
  seam, ``git show 1118733:src/specfit/offload/lru.py``).
- ``rule-gap``: the batch rule's coordinate ascent against the exhaustive optimum on the pools it priced while the
  embedded model (12 slots, default link and lane) decoded held-out GSM8K prompts in one batch with SpecFit, over
  every pair of rows at the real budget and over all rows at <= ``--cap`` nodes each. Mean and worst gap.

    python benchmarks/run.py rules selector --calls 2000 --seed 0
    python benchmarks/run.py rules slot-plan --rounds 30 --reference /tmp/lru_before.py
    python benchmarks/run.py rules rule-gap --prompts 4 --tokens 16
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import sys
import time
from collections import Counter
from dataclasses import replace

import numpy as np

from specfit.cli_checks import at_least
from specfit.offload.policies import POLICIES, make_policy
from specfit.offload.slots import SlotBook
from specfit.selection.batch_rule import gap_to_exact
from specfit.selection.cost_model import CostModel
from specfit.selection.selector import select_subtree

from run import run_part  # this folder's entry: one way to run a part

LAYERS, EXPERTS, TOP_K = 48, 128, 8  # the selector's pools: Qwen3-30B-A3B's routes
SLOT_EXPERTS, SLOT_TOP_K = 64, 4  # the slot plan's traces: the embedded model's layers
PROMPT_EVERY = 64  # forwards per prompt in a slot-plan trace


def timed(fn, *args, **kwargs):
    """(``fn``'s result, wall ns, thread CPU ns) of one call."""
    start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
    out = fn(*args, **kwargs)
    cpu = time.thread_time_ns() - start_cpu
    return out, time.perf_counter_ns() - start, cpu


def child_routes(rng, parent):
    """[layers, experts] bool: keep each parent expert with p=0.5, fill up to top-8 with random others."""
    score = rng.random(parent.shape)
    score[parent & (rng.random(parent.shape) < 0.5)] = 2.0  # kept experts outrank every random draw
    top = np.argpartition(-score, TOP_K - 1, axis=1)[:, :TOP_K]
    routes = np.zeros(parent.shape, dtype=bool)
    np.put_along_axis(routes, top, True, axis=1)
    return routes


def eagle_pool(rng, depth=5, top=2):
    """(parents, path_probs, routes [N, 48, 128], root_routes [48, 128]) for one top-2 EAGLE-style pool."""
    root = child_routes(rng, np.zeros((LAYERS, EXPERTS), dtype=bool))
    parents, probs, routes = [], [], []
    frontier = [(-1, 1.0, root)]
    for _ in range(depth):
        level = []
        for parent, prob, parent_routes in frontier:
            conditional = np.sort(rng.dirichlet(np.full(8, 0.3)))[::-1][:top]  # the drafter's top-2 probabilities
            for q in conditional:
                parents.append(parent)
                probs.append(prob * float(q))
                routes.append(child_routes(rng, parent_routes))
                level.append((len(parents) - 1, probs[-1], routes[-1]))
        frontier = sorted(level, key=lambda node: -node[1])[:top]
    return parents, probs, np.stack(routes), root


def selector(args) -> int:
    rng = np.random.default_rng(args.seed)
    pools = [eagle_pool(rng) for _ in range(min(args.calls, 500))]
    cost = CostModel.default(args.max_nodes)
    for pool in pools[:20]:  # warm-up
        select_subtree(*pool, cost, max_nodes=args.max_nodes)
    calls = [timed(select_subtree, *pools[i % len(pools)], cost, max_nodes=args.max_nodes) for i in range(args.calls)]
    subtrees = [sel.subtrees for sel, _, _ in calls]
    print(f"pools: {len(pools)} x {len(pools[0][0])} nodes, routes {LAYERS}x{EXPERTS} top-{TOP_K}, "
          f"max_nodes={args.max_nodes}, calls={args.calls}, seed={args.seed}, load average {os.getloadavg()[0]:.2f}")
    for name, column in (("wall time", 1), ("thread CPU time", 2)):
        ms = np.array([call[column] for call in calls]) / 1e6
        print(f"{name} per call: median {np.median(ms):.4f} ms, p90 {np.percentile(ms, 90):.4f} ms, "
              f"min {ms.min():.4f} ms")
    print(f"subtrees scored per call: mean {np.mean(subtrees):.1f} (min {min(subtrees)}, max {max(subtrees)})")
    print(f"selected draft nodes (default cost model): mean {np.mean([len(sel.nodes) for sel, _, _ in calls]):.2f}")
    return 0


def token_routes(rng, popularity, previous):
    """The experts of one token (top-4): each of ``previous``'s kept with p=0.5, the rest drawn by popularity."""
    kept = [e for e in previous if rng.random() < 0.5]
    rest = rng.choice(SLOT_EXPERTS, size=SLOT_TOP_K * 3, p=popularity)
    out = list(dict.fromkeys(kept + [int(e) for e in rest]))[:SLOT_TOP_K]
    return out + [e for e in range(SLOT_EXPERTS) if e not in out][: SLOT_TOP_K - len(out)]


def trace(rng, forwards: int, tokens_per_forward: int) -> list[tuple[list[int], list[int] | None]]:
    """(needed, uses) per forward: distinct experts, ascending, and the tokens routed to each (None for one token),
    as the experts function passes them; every ``PROMPT_EVERY``-th forward is a 128-token prompt."""
    popularity = 1.0 / np.arange(1, SLOT_EXPERTS + 1) ** 1.1
    popularity = popularity[rng.permutation(SLOT_EXPERTS)] / popularity.sum()
    out, previous = [], token_routes(rng, popularity, [])
    for i in range(forwards):
        count, tokens = Counter(), 128 if i % PROMPT_EVERY == 0 else tokens_per_forward
        for _ in range(tokens):
            previous = token_routes(rng, popularity, previous)
            count.update(previous)
        needed = sorted(count)
        out.append((needed, [count[e] for e in needed] if tokens > 1 else None))
    return out


def replay(book, forwards) -> np.ndarray:
    """[3] wall ns, thread CPU ns and misses of planning every forward as the slot cache does; the prompts' plans run
    untimed (once per call, not per token)."""
    def plan_all(chunk) -> int:  # misses
        misses = 0
        for needed, uses in chunk:
            plan = book.plan(needed, confirmed=False, uses=uses)
            book.confirm(e for e, _ in plan.loads)
            misses += len(plan.loads) + len(plan.streamed)
        return misses

    total = np.zeros(3)
    for i in range(0, len(forwards), PROMPT_EVERY):
        book.plan(forwards[i][0], confirmed=True, uses=forwards[i][1])
        misses, wall, cpu = timed(plan_all, forwards[i + 1: i + PROMPT_EVERY])
        total += (wall, cpu, misses)
    return total


def reference_book(path: str):
    """The ``LRUSlots`` class of the file ``path``, taking (and ignoring) the ``uses`` the policy seam passes."""
    spec = importlib.util.spec_from_file_location("reference_lru", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    if not isinstance(getattr(module, "LRUSlots", None), type):
        raise ValueError(f"--reference {path} defines no LRUSlots class (the slot cache to time beside the policies)")

    class Reference(module.LRUSlots):  # the slot cache before the seam passed no uses
        def plan(self, needed, confirmed=True, uses=None):
            return super().plan(needed, confirmed)

    return Reference


def slot_plan(args) -> int:
    makers = {name: (lambda slots, name=name: SlotBook(slots, SLOT_EXPERTS, make_policy(name, SLOT_EXPERTS)))
              for name in POLICIES}
    if args.reference:
        makers["reference lru"] = lambda slots: args.reference_class(slots, SLOT_EXPERTS)
    rng = np.random.default_rng(args.seed)
    print(f"{args.rounds} rounds x {args.forwards} plans per trace, {SLOT_EXPERTS} experts top-{SLOT_TOP_K}, "
          f"load average {os.getloadavg()[0]:.2f}; us per plan + confirm (thread CPU time, the best round / wall "
          f"time, the median round), misses per forward")
    for kind, tokens in (("decode", 1), ("verify", 8)):
        forwards = trace(rng, args.forwards, tokens)
        plans = len(forwards) - len(forwards[::PROMPT_EVERY])  # the timed ones
        for slots in args.slots:  # per policy [rounds, 3]: wall us, CPU us, misses per plan; every policy each round
            runs = {name: [] for name in makers}
            for _ in range(args.rounds):
                for name, make in makers.items():
                    runs[name].append(replay(make(slots), forwards) / plans / (1e3, 1e3, 1))
            cells = "  ".join(f"{name} {np.min(np.array(r)[:, 1]):.2f}/{np.median(np.array(r)[:, 0]):.2f} us "
                              f"({r[-1][2]:.2f})" for name, r in runs.items())
            print(f"{kind:6s} {slots:2d} slots: {cells}", flush=True)
    return 0


def rule_gap(args) -> int:
    import torch

    from specfit import embedded
    from specfit.decoding import batch_rows
    from specfit.evaluation import datasets, harness
    from specfit.evaluation.batches import left_padded, pad_id

    prompts = datasets.prompts("gsm8k", 100 + args.prompts)[100:]  # held out (the other benchmarks read the first)
    torch.set_num_threads(1)
    link = embedded.default_link()
    models, tokenizer = harness.load_instances(("specfit",), 12, link, host=embedded.default_host(
        embedded.HOST_TO_LINK, link))
    model = models["specfit"]
    ids, mask = left_padded([tokenizer(t, return_tensors="pt").input_ids for t in prompts], len(prompts),
                            pad_id(model))[0]  # [B, T] each
    recorded, original = [], batch_rows.select_batch

    def record(rows, intercepts, *rest):  # as RowTrees calls it: (rows, intercepts, beta, miss, resident)
        recorded.append((rows, tuple(intercepts), *rest))
        return original(rows, intercepts, *rest)

    batch_rows.select_batch = record  # RowTrees looks the rule up when the batch starts
    try:
        model.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, do_sample=False, assistant="specfit")
    finally:
        batch_rows.select_batch = original
    pair_gaps, all_gaps = [], []  # 1 - coordinate ascent's batch ratio / the exact optimum's
    gap = lambda rows, prices: 1 - np.divide(*gap_to_exact(rows, *prices))  # noqa: E731
    for rows, *prices in recorded:
        pair_gaps += [gap([a, b], prices) for a, b in itertools.combinations(rows, 2)]
        all_gaps.append(gap([replace(r, max_nodes=min(r.max_nodes, args.cap)) for r in rows], prices))
    print(f"{len(recorded)} recorded batch pools ({args.prompts} rows, GSM8K held out, 12 slots)")
    for name, gaps in (("row pairs, full budget", pair_gaps), (f"all rows, <= {args.cap} nodes per row", all_gaps)):
        g = np.array(gaps)
        print(f"  {name}: {len(g)} searches" + (f", gap to exact mean {g.mean():.4%}, worst {g.max():.4%}, exact "
                                                f"reached in {np.mean(g <= 1e-12):.0%}" if len(g) else ""))
    return 0


def check_slot_plan(args) -> None:
    at_least(args, 1, "rounds")
    at_least(args, 2, "forwards", why="a prompt, then the timed plans")
    if bad := [s for s in args.slots if not 1 <= s <= SLOT_EXPERTS]:
        raise ValueError(f"--slots must be in 1..{SLOT_EXPERTS} (the trace's experts), got {bad[0]}")
    if args.reference and not os.path.isfile(args.reference):
        raise ValueError(f"--reference {args.reference} is not a file (a Python file with an LRUSlots class)")
    args.reference_class = reference_book(args.reference) if args.reference else None


PARTS = {"selector": (selector, lambda args: at_least(args, 1, "calls", "max_nodes")),  # (run, check the options)
         "slot-plan": (slot_plan, check_slot_plan),
         "rule-gap": (rule_gap, lambda args: (at_least(args, 2, "prompts", why="the rows of a batch"),
                                              at_least(args, 1, "tokens", "cap")))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="run.py rules", description=__doc__.splitlines()[0])
    parts = parser.add_subparsers(dest="part", required=True, metavar="PART")
    s = parts.add_parser("selector", help="select_subtree's time on paper-shaped pools")
    s.add_argument("--calls", type=int, default=2000, help="timed calls (one fresh pool each, up to 500 pools)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-nodes", type=int, default=7)
    p = parts.add_parser("slot-plan", help="one layer's slot plan per policy")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--forwards", type=int, default=640, help="plans per trace and round")
    p.add_argument("--slots", type=int, nargs="+", default=[6, 12, 24])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", help="a file with an LRUSlots class to time beside the policies")
    g = parts.add_parser("rule-gap", help="the batch rule's coordinate ascent against the exact optimum")
    g.add_argument("--prompts", type=int, default=4, help="rows of the batch (held-out GSM8K questions)")
    g.add_argument("--tokens", type=int, default=16)
    g.add_argument("--cap", type=int, default=2, help="node budget per row for the all-rows exact search")
    return run_part(parser, parts, PARTS, argv)
