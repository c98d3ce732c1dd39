"""Time ``select_subtree`` on EAGLE-style pools shaped like the paper's (Qwen3-30B-A3B routes).

Pools: top-2 expansion to depth 5, 18 nodes (2 children of the root, then the 2 best nodes of the newest level by
path probability get 2 children each). Routes: 48 layers x 128 experts, top-8 per layer; a child keeps each of its
parent's experts with probability 0.5 and draws the rest at random, so siblings share experts through the parent.
The timed call takes the bool arrays exactly as the API does, so packing them into bitmaps is included. Wall time
is the figure; thread CPU time is printed next to it because a shared machine inflates wall time.

    python benchmarks/bench_selector.py --calls 2000 --seed 0
"""

import argparse
import os
import time

import numpy as np

from specfit.selection.cost_model import CostModel
from specfit.selection.selector import select_subtree

LAYERS, EXPERTS, TOP_K = 48, 128, 8


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls (one fresh pool each, up to 500 pools)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-nodes", type=int, default=7)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    pools = [eagle_pool(rng) for _ in range(min(args.calls, 500))]
    cost = CostModel.default(args.max_nodes)
    for pool in pools[:20]:  # warm-up
        select_subtree(*pool, cost, max_nodes=args.max_nodes)

    wall, cpu, subtrees, sizes = [], [], [], []
    for i in range(args.calls):
        pool = pools[i % len(pools)]
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        sel = select_subtree(*pool, cost, max_nodes=args.max_nodes)
        cpu.append(time.thread_time_ns() - start_cpu)
        wall.append(time.perf_counter_ns() - start)
        subtrees.append(sel.subtrees)
        sizes.append(len(sel.nodes))

    print(f"pools: {len(pools)} x {len(pools[0][0])} nodes, routes {LAYERS}x{EXPERTS} top-{TOP_K}, "
          f"max_nodes={args.max_nodes}, calls={args.calls}, seed={args.seed}, load average {os.getloadavg()[0]:.2f}")
    for name, ns in (("wall time", wall), ("thread CPU time", cpu)):
        ms = np.array(ns) / 1e6
        print(f"{name} per call: median {np.median(ms):.4f} ms, p90 {np.percentile(ms, 90):.4f} ms, "
              f"min {ms.min():.4f} ms")
    print(f"subtrees scored per call: mean {np.mean(subtrees):.1f} (min {min(subtrees)}, max {max(subtrees)})")
    print(f"selected draft nodes (default cost model): mean {np.mean(sizes):.2f}")


if __name__ == "__main__":
    main()
