"""``specfit estimate``: the tok/s each method should reach, from the calibrated cost profile, before any decoding.

A cycle's time is the profile's ``a(n) + beta * demand + miss * cold`` (``selection/cost_model.py``, priced for the
link and host lane at hand); what it commits is ``1 + the sum of the path values`` of the nodes it verifies, each a
product of the drafter's acceptance rates per depth and sibling rank (its ``acceptance.json``). What the profile
cannot tell is where each token's experts fall, so the estimate assumes every token routes uniformly and
independently: a forward over ``T`` tokens computes ``E (1 - (1 - k/E)^T)`` experts per layer, and a share
``1 - hit rate`` of them is cold, the hit rate being ``slots / experts`` unless given (``--hit-rate``; a run's
``hit_rate`` in the stats is the measured one). Real routing repeats experts from token to token, so real hit rates
are higher and the estimate is on the slow side, most for AR.

- AR: one token per cycle, nothing drafted.
- EAGLE-3: the 7 best nodes of the draft tree, every level drafted, priced by the same profile (EAGLE-3's own
  drafting is cheaper than SpecFit's, whose route predictor runs per level: its estimate is on the slow side).
- SpecFit: the best number of nodes ``n`` (the ``n`` best of the tree, 0: a cycle that drafts nothing) by expected
  tokens per predicted second, drafting only the levels those nodes need. Its 7 best nodes cost at most EAGLE-3's
  cycle here, so its figure is never below EAGLE-3's (what its guard does on the clock).

Pure functions (no torch, no model loaded) and the command around them; figures for the embedded model's emulated
link are CPU figures, not GPU speed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from .. import cli_checks

TREE = dict(topk=2, depth=5, pool_nodes=18, max_nodes=7)  # the paper's pool and EAGLE-3's budget (DecodingOptions)
HIT_RATES = (0.9, 0.95, 0.99)  # --hit-rate's columns besides slots / experts
KEY_SHAPE = re.compile(r"\[(\d+)x(\d+)e top(\d+) ")  # a profile's model_key: '<name> [48x64e top4 h80 float32]'


@dataclass(frozen=True)
class Shape:
    """What sets a forward's experts: MoE layers, routed experts per layer, experts per token."""

    layers: int
    experts: int
    top_k: int


def distinct_experts(tokens: int, shape: Shape) -> float:
    """Expected distinct experts one layer computes for ``tokens`` tokens routed uniformly and independently.

    >>> round(distinct_experts(1, Shape(48, 64, 4)), 6), round(distinct_experts(8, Shape(48, 64, 4)), 2)
    (4.0, 25.81)
    """
    return shape.experts * (1.0 - (1.0 - shape.top_k / shape.experts) ** tokens)


def depth_rank_rates(table) -> dict:
    """The acceptance rate per (depth, rank) of an ``AcceptanceTable`` (its labels summed over the q-bins; an empty
    pair takes its rank's rate over all depths, else the table's)."""
    sums, by_rank, everything = {}, {}, [0.0, 0.0]
    for (d, r, _), (s, n) in table.counts.items():
        for bucket, key in ((sums, (d, r)), (by_rank, r)):
            got = bucket.setdefault(key, [0.0, 0.0])
            got[0], got[1] = got[0] + s, got[1] + n
        everything[0], everything[1] = everything[0] + s, everything[1] + n
    overall = everything[0] / everything[1] if everything[1] else 0.5
    rates = {}
    for d in range(1, table.max_depth + 1):
        for r in range(1, table.max_rank + 1):
            s, n = sums.get((d, r), by_rank.get(r, (0.0, 0.0)))
            rates[(d, r)] = s / n if n else overall
    return rates


def draft_pool(rates: dict, topk: int, depth: int, pool_nodes: int) -> list[tuple[float, int]]:
    """The draft tree's ``pool_nodes`` best nodes as (path value, depth), best first: every node has ``topk``
    children by rank, a node's path value is its parent's times the rate of its (depth, rank), deeper depths and
    lower ranks taking the table's last.

    >>> draft_pool({(1, 1): 0.8, (1, 2): 0.1, (2, 1): 0.5, (2, 2): 0.1}, 2, 2, 3)
    [(0.8, 1), (0.4, 2), (0.1, 1)]
    """
    deepest = max(d for d, _ in rates)
    lowest = max(r for _, r in rates)
    frontier, nodes = [(1.0, 0)], []
    for level in range(1, depth + 1):
        children = [(value * rates[(min(level, deepest), min(rank, lowest))], level)
                    for value, _ in frontier for rank in range(1, topk + 1)]
        nodes += children
        frontier = sorted(children, reverse=True)[:pool_nodes]
    return sorted(nodes, key=lambda node: (-node[0], node[1]))[:pool_nodes]


def cycle(cost, shape: Shape, pool: list, n: int, levels: int, hit_rate: float) -> dict:
    """One cycle verifying the ``n`` best nodes of ``pool`` after drafting ``levels`` levels: its expected tokens,
    predicted seconds and cold experts."""
    tokens = 1.0 + sum(value for value, _ in pool[:n])
    demand = shape.layers * distinct_experts(n + 1, shape)
    cold = demand * (1.0 - hit_rate)
    seconds = cost.predict(n, demand, levels=levels, misses=cold)
    return dict(nodes=n, levels=levels, tokens_per_cycle=tokens, seconds_per_cycle=seconds,
                tok_s=tokens / seconds if seconds > 0 else math.inf, cold_per_token=cold / tokens)


def estimate(cost, shape: Shape, rates: dict, hit_rate: float, tree: dict = TREE) -> list[dict]:
    """Rows for AR, EAGLE-3 and SpecFit (``cost``: a ``CostModel`` priced for the link and host lane)."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate is a share of the experts needed found in a slot, 0..1, got {hit_rate}")
    budget = min(tree["max_nodes"], cost.max_nodes, tree["pool_nodes"])
    pool = draft_pool(rates, tree["topk"], tree["depth"], tree["pool_nodes"])
    ar = cycle(cost, shape, pool, 0, 0, hit_rate)
    eagle = cycle(cost, shape, pool, budget, tree["depth"], hit_rate)
    own = [cycle(cost, shape, pool, n, max((d for _, d in pool[:n]), default=0), hit_rate)
           for n in range(budget + 1)]
    best = max(own, key=lambda row: row["tok_s"])
    specfit = dict(best, way=f"its own subtree, {best['nodes']} nodes, {best['levels']} levels drafted")
    return [dict(ar, method="ar", label="AR", way="one token per forward"),
            dict(eagle, method="eagle3", label="EAGLE-3", way=f"{budget} nodes, {tree['depth']} levels drafted"),
            dict(specfit, method="specfit", label="SpecFit")]


def shape_of(cost) -> Shape:
    """The model's shape from the profile's ``model_key`` (e.g. '... [48x64e top4 h80 float32]')."""
    found = KEY_SHAPE.search(str(cost.meta.get("model_key", "")))
    if found is None:
        raise ValueError(f"the profile names no model shape (its model_key is {cost.meta.get('model_key')!r}); "
                         f"give a profile `specfit calibrate` wrote")
    return Shape(*map(int, found.groups()))


def sweep(cost, shape: Shape, rates: dict, hit_rates) -> dict:
    """``estimate`` at each hit rate: {hit rate: rows}."""
    return {h: estimate(cost, shape, rates, h) for h in hit_rates}


def format_sweep(by_rate: dict, uniform: float) -> str:
    """tok/s of each method at each hit rate (SpecFit's nodes per cycle beside its figure), and AR's cold experts
    per token.

    >>> row = lambda m, label, t, n, w: dict(method=m, label=label, tok_s=t, nodes=n, cold_per_token=2.0, way=w)
    >>> print(format_sweep({0.5: [row("ar", "AR", 10.0, 0, ""), row("specfit", "SpecFit", 12.0, 3, "its own")]}, 0.5))
    hit rate              0.50*
    ---------------------------
    AR tok/s               10.0
    SpecFit tok/s    12.0 (3 n)
    cold/tok AR             2.0
    """
    rates = list(by_rate)
    head = f"{'hit rate':<16}" + "".join(f"{f'{h:.2f}' + ('*' if h == uniform else ''):>11}" for h in rates)
    lines = [head, "-" * len(head)]
    labels = [(r["method"], r["label"]) for r in by_rate[rates[0]]]
    for method, label in labels:
        cells = []
        for h in rates:
            r = next(x for x in by_rate[h] if x["method"] == method)
            tag = f" ({r['nodes']} n)" if method == "specfit" else ""
            cells.append(f"{r['tok_s']:.1f}{tag}")
        lines.append(f"{label + ' tok/s':<16}" + "".join(f"{c:>11}" for c in cells))
    for method, label in labels[:1]:
        cold = [next(x for x in by_rate[h] if x["method"] == method)["cold_per_token"] for h in rates]
        lines.append(f"{'cold/tok ' + label:<16}" + "".join(f"{c:>11.1f}" for c in cold))
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    from ..embedded import DEMO_SLOTS, HOST_TO_LINK

    p.add_argument("--slots", type=int, default=DEMO_SLOTS, help="expert slots per layer (the demo's by default)")
    p.add_argument("--link-ms", type=float, default=None,
                   help="emulated ms per expert copy (default: the structural default link kept for this machine, "
                        "else 1.4x one token's compute as the profile predicts it, over layers x top-k)")
    p.add_argument("--host-ratio", type=float, default=HOST_TO_LINK, metavar="RATIO",
                   help="the emulated host lane at RATIO x the link's bandwidth, as the demo's; 0: no host lane")
    p.add_argument("--hit-rate", type=float, nargs="+", default=list(HIT_RATES), metavar="SHARE",
                   help="shares of the experts a forward needs found in a slot, one column each, beside slots / "
                        "experts (what uniform routing gives; real routing repeats experts, and a run's stats show "
                        "the hit rate it reached: model.specfit.stats.last_generate.hit_rate)")
    p.add_argument("--profile", default=None,
                   help="a cost profile (JSON) to read (default: this machine's for the embedded model in the user "
                        "cache, else the reference profile shipped with specfit)")


def check_arguments(args) -> None:
    """Every option, before anything is read: counts, the link, the share, the profile file."""
    experts = cli_checks.experts_per_layer(_embedded_config())
    if not 1 <= args.slots <= experts:
        raise ValueError(f"--slots must be in 1..{experts} (the embedded model's experts per layer), got {args.slots}")
    cli_checks.milliseconds(args, "link_ms")
    if not (math.isfinite(args.host_ratio) and args.host_ratio >= 0):
        raise ValueError(f"--host-ratio must be a finite number >= 0 (0: no host lane), got {args.host_ratio}")
    bad = [h for h in args.hit_rate if not 0.0 <= h <= 1.0]
    if bad:
        raise ValueError(f"--hit-rate takes shares from 0 to 1, got {' '.join(map(str, bad))}")
    if args.profile is not None and not Path(args.profile).expanduser().is_file():
        raise ValueError(f"--profile {args.profile!r}: no such file (a cost profile `specfit calibrate` wrote)")


def _embedded_config() -> dict:
    from ..embedded.paths import TARGET_DIR

    return json.loads((TARGET_DIR / "config.json").read_text())


def main(args) -> int:
    from .. import embedded
    from ..selection.acceptance_model import AcceptanceTables
    from ..selection.cost_model import CostModel

    cost, where = (CostModel.load(Path(args.profile).expanduser()), args.profile) if args.profile else _profile()
    shape = shape_of(cost)
    link, how = _link(args, cost, shape)
    expert = embedded.bf16_expert_bytes()
    host = embedded.default_host(args.host_ratio, link) if args.host_ratio > 0 and link is not None else None
    link_seconds = link.copy_time(expert) if link is not None else 0.0
    host_seconds = host.expert_time(expert, 1) if host is not None else None
    priced = cost.priced(link_seconds, host_seconds, "auto" if host is not None else "copy")
    uniform = min(1.0, args.slots / shape.experts)
    tables = AcceptanceTables.load(embedded.DRAFTER_DIR / "acceptance.json")
    by_rate = sweep(priced, shape, depth_rank_rates(tables.greedy), sorted({uniform, *args.hit_rate}))
    print(f"specfit estimate: expected decode tok/s of each method on the embedded model, from the cost profile "
          f"alone (no decoding): {where}.")
    print(f"{args.slots} slots of {shape.experts} per layer, emulated link {link_seconds * 1e3:.3f} ms per copy "
          f"({how}), " + (f"{host.label}, {host_seconds * 1e3:.3f} ms per host expert" if host else "no host lane")
          + "; CPU, emulated: not GPU speed.\n")
    print(format_sweep(by_rate, uniform))
    print(f"\n* slots / experts: the hit rate if every token routed uniformly and independently. Real routing repeats "
          f"experts from token to token, so a run's hit rate is higher (the stats' hit_rate says which column "
          f"applies). SpecFit (n): the nodes it verifies per cycle. cold/tok: experts per token not in a slot (copied, "
          f"or computed on the host lane where cheaper). Assumed besides: EAGLE-3 priced with SpecFit's drafting (its "
          f"own is cheaper), greedy acceptance from the drafter's acceptance.json. Measure: specfit demo.")
    return 0


def _profile():
    """(cost model, where it came from): this machine's profile for the embedded model (fp32), else the reference."""
    from .. import embedded
    from ..selection.cost_model import CostModel
    from ..selection.profile_files import profile_path
    from ..selection.profiles import _cpu_model, reference_profile

    config = _embedded_config()
    key = dict(device_name=f"cpu-{_cpu_model()}",
               model_key=f"{embedded.MODEL_ID} [{config['num_hidden_layers']}x{cli_checks.experts_per_layer(config)}e "
                         f"top{config['num_experts_per_tok']} h{config['hidden_size']} float32]")
    path = profile_path(**key)
    if path.is_file():
        return CostModel.load(path), f"this machine's profile ({path})"
    found = reference_profile(key)
    if found is None:
        raise ValueError(f"no cost profile for {key['model_key']}: run `specfit calibrate` once on this machine")
    return found, f"the reference profile shipped with specfit, measured on {found.meta.get('device')!r}"


def _link(args, cost, shape: Shape):
    """(LinkConfig or None, how it was set): --link-ms; else the kept default link; else 1.4x one token's compute as
    the profile predicts it (a cycle verifying nothing, every expert resident) over layers x top-k."""
    from .. import embedded
    from ..embedded import link_store
    from ..offload.link import LinkConfig

    if args.link_ms is not None:
        return (LinkConfig(seconds_per_expert=args.link_ms / 1e3) if args.link_ms > 0 else None), "given (--link-ms)"
    kept = link_store.read(link_store.key(embedded.FASTEST_THREADS, embedded.TARGET_DIR / "model.safetensors"))
    demand = shape.layers * shape.top_k
    if kept is not None:
        compute, how = kept[1], f"the default link kept in {link_store.path()}"
    else:
        compute, how = cost.predict(0, demand, levels=0), "the default link from the profile's own compute per token"
    per_copy = embedded.DEMAND_TO_COMPUTE * compute / demand
    return LinkConfig(bandwidth=embedded.bf16_expert_bytes() / per_copy, relative=1.0), how
