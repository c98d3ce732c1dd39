"""Time one layer's slot plan (``SlotBook.plan`` + ``confirm``, as ``LayerCache.start`` calls them) per policy: it
runs 48 times per forward on the embedded model (every MoE layer), so its Python overhead is real decode time.

Traces are synthetic, shaped like the embedded model's (64 experts, top-4): each layer has a Zipf popularity over
its experts, and each token keeps each of the previous token's experts with probability 0.5 and draws the rest by
popularity. Two kinds of trace: decode steps (1 token, 4 experts) and verify forwards (root + 7 nodes, about 12-16
distinct experts), each with a prompt (128 tokens) every 64 forwards, planned untimed (once per call, not per
token). The policies take turns round by round on the same trace; the figure is the mean thread CPU time per plan
in the best round (robust on a shared machine, which inflates every other round), the median round's wall time
beside it. ``--reference FILE`` times another
``LRUSlots`` beside them, e.g. the one before the policy seam:

    git show 1118733:src/specfit/offload/lru.py > /tmp/lru_before.py
    python benchmarks/bench_slot_plan.py --rounds 30 --reference /tmp/lru_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

from specfit.offload.policies import POLICIES, make_policy
from specfit.offload.slots import SlotBook

EXPERTS, TOP_K = 64, 4


def token_routes(rng, popularity, previous):
    """The experts of one token (top-4): each of ``previous``'s kept with p=0.5, the rest drawn by popularity."""
    kept = [e for e in previous if rng.random() < 0.5]
    rest = rng.choice(EXPERTS, size=TOP_K * 3, p=popularity)
    out = list(dict.fromkeys(kept + [int(e) for e in rest]))[:TOP_K]
    return out if len(out) == TOP_K else out + [e for e in range(EXPERTS) if e not in out][: TOP_K - len(out)]


def trace(rng, forwards: int, tokens_per_forward: int) -> list[tuple[list[int], list[int]]]:
    """(needed, uses) per forward: distinct experts, ascending, and the tokens routed to each (None for one token),
    as the experts function passes them."""
    popularity = 1.0 / np.arange(1, EXPERTS + 1) ** 1.1
    popularity = popularity[rng.permutation(EXPERTS)] / popularity.sum()
    out, previous = [], token_routes(rng, popularity, [])
    for i in range(forwards):
        count: dict[int, int] = {}
        tokens = 128 if i % 64 == 0 else tokens_per_forward
        for _ in range(tokens):
            previous = token_routes(rng, popularity, previous)
            for e in previous:
                count[e] = count.get(e, 0) + 1
        needed = sorted(count)
        out.append((needed, [count[e] for e in needed] if tokens > 1 else None))
    return out


def replay(book, forwards) -> tuple[int, int, int]:
    """(wall ns, thread CPU ns, misses) of planning every forward as the slot cache does; the prompts' plans run
    untimed (once per call, not per token)."""
    misses = wall = cpu = 0
    for i in range(0, len(forwards), 64):
        needed, uses = forwards[i]
        book.plan(needed, confirmed=True, uses=uses)
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        for needed, uses in forwards[i + 1: i + 64]:
            plan = book.plan(needed, confirmed=False, uses=uses)
            book.confirm(e for e, _ in plan.loads)
            misses += len(plan.loads) + len(plan.streamed)
        cpu += time.thread_time_ns() - start_cpu
        wall += time.perf_counter_ns() - start
    return wall, cpu, misses


def reference_book(path: str):
    spec = importlib.util.spec_from_file_location("reference_lru", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)

    class Reference(module.LRUSlots):  # the slot cache before the seam passed no uses
        def plan(self, needed, confirmed=True, uses=None):
            return super().plan(needed, confirmed)

    return Reference


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--forwards", type=int, default=640, help="plans per trace and round")
    parser.add_argument("--slots", type=int, nargs="+", default=[6, 12, 24])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", help="a file with an LRUSlots class to time beside the policies")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    makers = {name: (lambda slots, name=name: SlotBook(slots, EXPERTS, make_policy(name, EXPERTS)))
              for name in POLICIES}
    if args.reference:
        cls = reference_book(args.reference)
        makers["reference lru"] = lambda slots: cls(slots, EXPERTS)
    print(f"{args.rounds} rounds x {args.forwards} plans per trace, {EXPERTS} experts top-{TOP_K}, "
          f"load average {os.getloadavg()[0]:.2f}; us per plan + confirm (thread CPU time, the best round / wall "
          f"time, the median round), misses per forward")
    for kind, tokens in (("decode", 1), ("verify", 8)):
        forwards = trace(rng, args.forwards, tokens)
        for slots in args.slots:
            wall = {name: [] for name in makers}
            cpu = {name: [] for name in makers}
            misses = {}
            for _ in range(args.rounds):  # interleaved: every policy in every round
                for name, make in makers.items():
                    w, c, m = replay(make(slots), forwards)
                    timed = len(forwards) - len(forwards[::64])
                    wall[name].append(w / timed / 1e3)
                    cpu[name].append(c / timed / 1e3)
                    misses[name] = m / timed
            cells = "  ".join(f"{name} {np.min(cpu[name]):.2f}/{np.median(wall[name]):.2f} us "
                              f"({misses[name]:.2f})" for name in makers)
            print(f"{kind:6s} {slots:2d} slots: {cells}", flush=True)


if __name__ == "__main__":
    main()
