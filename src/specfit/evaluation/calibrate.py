"""``specfit calibrate``: fit this machine's cycle-time model ``intercepts[n] + beta * demand + copy * misses`` for a
model, check it, and install it where ``specfit.enable`` finds it only if it is good enough. One calibration per
machine and model: the profile prices any slot count, cache mode and link (``selection/cost_model.py``).

A probe *configuration* is one real decoding cycle whose verified subtree was chosen for the fit, not by a selector:
its size ``n`` comes from a balanced schedule over ``0..max_nodes``, and the subtree from a scheduled quantile
(lowest, highest or random) of ``candidates`` random ancestor-closed subtrees of that size, ranked by their demand or
by their misses (the schedule alternates), so node count, demand and misses vary independently. Demand and misses
are told apart further by *cold* cycles: one configuration in ``FLUSH_EVERY`` empties the slot cache before its
verify forward, so it copies every expert it computes. The choice reads the routes the model's deployable route
source gives (a trained predictor or the target's gates, as SpecFit runs; the route oracle only where neither
exists): a choice needs only variety, and the record keeps the demand and misses the verify forward really had.
So the probes need no extra target forward.

The run has ``1 + repeats x links`` rounds over the same prompts. Round 0 *plans*: it decodes each prompt and records
every cycle's pool, chosen subtree and whether it runs cold. The other rounds *replay* the plan: each generate()
starts from an empty slot cache, and greedy decoding is deterministic, so a configuration's cycle is the same cycle
in every round: same pool, same subtree, same cache state. Each round visits the prompts in a new random order, so a
configuration's repeats are spread over the whole run and a slow drift of the machine hits every configuration
alike. On a CPU the replays alternate between no link and an emulated one (the one given, or the embedded model's
structural default), so the share of the link's time a copy waits for is measured apart from the copy's own
overhead; on a GPU the real link is timed (its time per copy measured from the pinned bandwidth). A record is the
configuration's *fastest* repeat on each link (``STATISTIC``: load on a shared machine only ever adds time).
Drafting does not depend on the subtree (every probe drafts the full pool), so each record carries the drafting time
of the median configuration plus its own time after drafting; the drafting time of each level is measured too
(``draft_level_seconds``), as SpecFit drafts it.

``CostModel.fit`` solves the monotone NNLS problem; ``specfit.selection.fit_quality`` cross-validates it,
bootstraps intervals, checks the selector's choices on the planned pools, and gates it. The same probes fitted on
demand alone (at the user's link) are kept as the paper's model (``cost="paper"``). ``calibration/probes.json``
holds the defaults.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
import warnings
from importlib.resources import files
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..decoding.assistants import Eagle3Generator
from ..drafting.tree import DraftTree
from ..offload.link import EmulatedLink
from ..selection.cost_model import CostModel, Record
from ..selection.profile_files import profile_path
from ..selection.fit_quality import REMEDY, Pool, assess
from ..selection.profiles import device_name, link_seconds, model_id, model_key, profile_key
from ..selection.route_sources import ROUTE_SOURCES, choose_route_source, oracle_routes
from ..selection.selector import select_subtree

PROBES = json.loads(files("specfit.calibration").joinpath("probes.json").read_text())
# The statistic kept per configuration: its fastest repeat. Interference from other work only ever adds time (a
# descheduled thread, evicted caches), so the noise is one-sided; measured on a shared 2-core machine (embedded model,
# 12 slots, 0.28 ms link, 240 configurations x 5 repeats), a repeat took a median 1.17x and at the 90th percentile
# 2.2x its configuration's fastest, and whole rounds ran 14 to 22 ms per cycle. The minimum of 3 fitted with R^2
# 0.96 (misses) where the median of 3 reached 0.75 and the median of 5 0.76.
STATISTIC = "min"
FLUSH_EVERY = 6  # one probe configuration in this many runs cold (slot cache emptied before its verify forward)
ACCEPTANCE_PROMPTS = 24  # --acceptance-only: calibration prompts (each decoded greedily and sampled)
STABILITY_POOLS = 64  # recorded pools the selector-stability check uses (spread over the run)
READ_THE_PLOT = ("how to read the plot: one point per probe configuration and link (its fastest repeat); filled dots "
                 "are the fit, hollow circles the same probes predicted by a fit that held them out; on the dashed "
                 "diagonal a prediction is exact, and hollow circles far wider than the dots mean the fit does not "
                 "generalise")


class Planned(NamedTuple):
    tokens: tuple[int, ...]  # the pool's tokens, to check that a replay drafted the same pool
    parents: tuple[int, ...]  # the pool's shape
    nodes: tuple[int, ...]  # the verified subtree
    cold: bool = False  # the slot cache is emptied before this cycle's verify forward


class Calibration(NamedTuple):
    cost: CostModel
    records: list[Record]  # one per probe configuration and link (its fastest repeat), as fitted
    heldout_seconds: np.ndarray  # [records] each record predicted by the cross-validation fold that held it out


class _Probe(Eagle3Generator):
    """An EAGLE-3 cycle (the full pool) whose routes come from the model's deployable route source, as SpecFit's:
    the trained predictor or the target's gates, run inside each drafted level; the oracle only where neither
    exists (``self.oracle``)."""

    def __init__(self, model):
        super().__init__(model)
        try:
            source = choose_route_source(model, model.specfit.options.route_source)
        except ValueError:  # nothing deployable: the oracle chooses (untimed); levels are priced as EAGLE-3's
            source = "oracle"
        self.oracle = source == "oracle"
        self.routes = oracle_routes if self.oracle else ROUTE_SOURCES[source](model)
        if hasattr(self.routes, "attach"):
            self.routes.attach(self.drafter)

    def draft(self, cycle):
        cycle.drafter = self.drafter
        return super().draft(cycle)


class PlanningProbe(_Probe):
    """Round 0: drafts the full pool, reads its routes and verifies a subtree of scheduled size, ranking and
    quantile; records the plan and the pool (with the slot cache it was drafted against)."""

    def __init__(self, model, rng: random.Random, schedule, candidates: int):
        super().__init__(model)
        self.rng, self.schedule, self.candidates = rng, schedule, candidates
        self.plan: list[Planned] = []
        self.pools: list[Pool] = []

    def select(self, tree, cycle):
        node_routes, root_routes = self.routes(cycle, tree)  # [N, L, E], [L, E]
        resident = cycle.model.specfit.resident_mask()  # [L, E]
        size, by_misses, quantile, cold = next(self.schedule)
        size = min(size, len(tree))
        subtrees = sorted({random_subtree(tree.parents, size, self.rng) for _ in range(self.candidates)})
        unions = [root_routes | node_routes[list(s)].any(0) if s else root_routes for s in subtrees]
        score = [int((u & ~resident).sum()) if by_misses else int(u.sum()) for u in unions]
        ranked = [s for _, s in sorted(zip(score, subtrees))]
        chosen = ranked[min(len(ranked) - 1, int(quantile * len(ranked)))]
        self.plan.append(Planned(tuple(tree.tokens), tuple(tree.parents), chosen, cold))
        self.pools.append(Pool(tuple(tree.parents), tuple(tree.path_probs), node_routes.astype(bool),
                               root_routes.astype(bool), resident))
        if cold:
            cycle.model.specfit.clear_cache()
        return chosen


class ReplayProbe(_Probe):
    """Rounds 1..: the planned cycles again; times every drafted level. A cycle whose pool differs from the plan
    (decoding that is not deterministic, e.g. a drafter that samples) is marked diverged and verifies the planned
    nodes if the pool has the planned shape, else a random subtree of the planned size.

    A level is drafted and timed as SpecFit drafts it: with the model's deployable route source (a predictor or the
    gates: every node of the level processed, its routes computed in the level's step) and the selector run on the
    pool so far against the slot cache. (The pool is the same as EAGLE-3's; only the work per level differs.) The
    oracle, a measurement device, is not part of a level's price."""

    def __init__(self, model, plan: list[Planned], rng: random.Random):
        super().__init__(model)
        self.plan, self.rng = plan, rng
        self.level_seconds: list[list[float]] = []  # per cycle: seconds of each drafted level
        self.diverged: list[bool] = []
        # prices the selector's work per level, not its choice (which the probe's plan makes)
        self.pricing = CostModel(intercepts=(1.0,) * (self.max_nodes + 1), beta=1e-4, copy=1e-3)

    def draft(self, cycle):
        tree, times = DraftTree(), []
        cycle.drafter = self.drafter
        runtime = cycle.model.specfit
        start = time.perf_counter()
        resident = None if self.oracle else runtime.resident_mask()
        for tree in self.drafter.levels():
            if not self.oracle:
                node_routes, root_routes = self.routes(cycle, tree)
                select_subtree(tree.parents, tree.path_probs, node_routes, root_routes, self.pricing, self.max_nodes,
                               resident=resident)
            now = time.perf_counter()
            times.append(now - start)
            start = now
        self.level_seconds.append(times)
        return tree

    def select(self, tree, cycle):
        i = len(self.diverged)
        planned = self.plan[i] if i < len(self.plan) else None
        self.diverged.append(planned is None or planned.tokens != tuple(tree.tokens))
        if planned is not None and planned.cold:
            cycle.model.specfit.clear_cache()
        if planned is not None and planned.parents == tuple(tree.parents):
            return planned.nodes
        size = len(planned.nodes) if planned is not None else self.rng.randint(0, self.max_nodes)
        return random_subtree(tree.parents, min(size, len(tree)), self.rng)


def random_subtree(parents, size: int, rng: random.Random) -> tuple[int, ...]:
    """An ancestor-closed subset of ``size`` pool nodes, grown from the root by adding random frontier nodes."""
    children = [[] for _ in parents]
    frontier = []
    for v, p in enumerate(parents):
        (frontier if p < 0 else children[p]).append(v)
    chosen: list[int] = []
    while len(chosen) < size and frontier:
        v = frontier.pop(rng.randrange(len(frontier)))
        chosen.append(v)
        frontier += children[v]
    return tuple(sorted(chosen))


def schedule(rng: random.Random, max_nodes: int):
    """Endless (size, rank by misses?, quantile, cold?) tuples: every size once per block of ``max_nodes + 1``, in
    random order; candidates ranked by misses or by demand, alternately; the quantile the lowest, the highest or a
    random one, a third of the time each; one configuration in ``FLUSH_EVERY`` cold."""
    by_misses = False
    while True:
        sizes = list(range(max_nodes + 1))
        rng.shuffle(sizes)
        for size in sizes:
            by_misses = not by_misses
            yield size, by_misses, rng.choice((0.0, 1.0, rng.random())), rng.randrange(FLUSH_EVERY) == 0


def probe_links(model, link=None) -> list:
    """The links the replays alternate over, as ``LinkConfig`` or None (no emulated link). On CUDA: the real link
    only. On a CPU: no link, then ``link`` (the one given; else the model's own emulated link; else, for the embedded
    model, its structural default), so the link's share of a copy is measured apart from the copy's overhead."""
    runtime = model.specfit
    if runtime.device.type == "cuda":
        return [None]
    link = link if link is not None else runtime.config.link
    if link is None and model_id(model) == _embedded_id():
        from .. import embedded

        link = embedded.default_link()
    return [None] if link is None else [None, link]


def _embedded_id() -> str:
    from ..embedded import MODEL_ID

    return MODEL_ID


def calibrate(model, prompts: list[torch.Tensor], probes: int = PROBES["probes"], repeats: int = PROBES["repeats"],
              seed: int = PROBES["seed"], warmup: int = PROBES["warmup_cycles"],
              max_new_tokens: int = PROBES["max_new_tokens"], candidates: int = PROBES["candidates"],
              bootstrap: int = PROBES["bootstrap"], folds: int = PROBES["folds"], gate: dict | None = None,
              links=None, progress=None) -> Calibration:
    """Run the probes on an enabled model (with a drafter) over ``prompts`` ([1, P] token ids): ``probes``
    configurations after ``warmup`` cycles per prompt, each timed ``repeats`` times on each of ``links`` (default
    ``probe_links(model)``); fit, assess and return them.

    ``progress``, if given, is called as ``progress(done, total)`` in generate() calls."""
    for name, value, low in (("probes", probes, 10), ("repeats", repeats, 1), ("candidates", candidates, 1),
                             ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    runtime = model.specfit
    max_nodes = runtime.options.max_nodes
    links = probe_links(model) if links is None else list(links)
    rng = random.Random(seed)
    sizes = schedule(rng, max_nodes)
    report = progress or (lambda done, total: None)

    plans: list[tuple[int, list[Planned]]] = []  # (prompt index, its cycles)
    pools: list[Pool] = []
    configs, oracle = 0, False
    while configs < probes:
        before = configs
        for i, ids in enumerate(prompts):
            probe = PlanningProbe(model, rng, sizes, candidates)
            _generate(model, ids, probe, max_new_tokens)
            oracle = probe.oracle
            plans.append((i, probe.plan))
            pools += probe.pools[warmup:]
            configs += max(0, len(probe.plan) - warmup)
            report(len(plans), None)
            if configs >= probes:
                break
        if configs == before:
            raise RuntimeError("calibration produced no probes: every prompt ended within the warm-up cycles; use "
                               "longer generations (--max-new-tokens) or other prompts")

    # (plan, cycle, link) -> [(CycleRecord, level seconds, diverged)] per round
    timed: dict[tuple[int, int, int], list] = {}
    order = list(range(len(plans)))
    rounds = [(r, k) for r in range(repeats) for k in range(len(links))]
    saved = runtime.engine.link
    copy_time: list[float] = []  # the link's own time per copy, per link
    try:
        for k, link in enumerate(links):
            runtime.engine.link = EmulatedLink(link) if link is not None else None
            copy_time.append(_link_seconds(runtime, link))
        for done, (r, k) in enumerate(rounds):
            runtime.engine.link = EmulatedLink(links[k]) if links[k] is not None else None
            rng.shuffle(order)
            for j in order:
                i, plan = plans[j]
                probe = ReplayProbe(model, plan, rng)
                trace = _generate(model, prompts[i], probe, max_new_tokens)
                for c, run in enumerate(zip(trace, probe.level_seconds, probe.diverged)):
                    if c >= warmup:
                        timed.setdefault((j, c, k), []).append(run)
            report(len(plans) * (done + 2), len(plans) * (len(rounds) + 1))
    finally:
        runtime.engine.link = saved

    keys = [(j, c) for j, (_, plan) in enumerate(plans) for c in range(warmup, len(plan))][:probes]
    records, on_user_link, level_runs, dropped, matched_all = [], [], [], 0, True
    draft = None
    for k in range(len(links)):
        kept = [[(c, levels) for c, levels, _ in timed[(j, c, k)]] for j, c in keys
                if _agree(timed.get((j, c, k), []), repeats)]
        matched = len(kept) >= max(10, len(keys) // 2)
        if not matched:
            warnings.warn(f"only {len(kept)} of {len(keys)} probe configurations replayed identically in all "
                          f"{repeats} rounds: decoding is not deterministic here (the same prompt drafted other "
                          f"pools, e.g. a drafter that samples), so every timed cycle is fitted on its own, without "
                          f"the fastest of its repeats; expect a noisier fit", RuntimeWarning, stacklevel=2)
            kept = [[(c, levels)] for j, c in keys for c, levels, _ in timed.get((j, c, k), [])]
        dropped += len(keys) - len(kept) if matched else 0
        matched_all &= matched
        # each configuration's fastest repeat (see STATISTIC); drafting: the median configuration's fastest
        if draft is None:
            draft = statistics.median(min(c.draft_seconds for c, _ in runs) for runs in kept)
        post = [min(c.seconds - c.draft_seconds for c, _ in runs) for runs in kept]
        mine = [Record(runs[0][0].n_nodes, runs[0][0].demand, draft + p, runs[0][0].misses, copy_time[k])
                for runs, p in zip(kept, post)]
        records += mine
        if k == len(links) - 1:
            on_user_link = mine
        level_runs += [[levels for _, levels in runs] for runs in kept]
    levels = _level_seconds(level_runs)

    slots = runtime.config.cache_slots
    meta = dict(device=device_name(runtime), model_id=model_id(model), model_key=model_key(model),
                probe="specfit.calibrate/probes.json",
                probes=dict(configs=len(keys), records=len(records), dropped=dropped if matched_all else None,
                            repeats_matched=matched_all, repeats=repeats,
                            links=[_label(link) for link in links], link_seconds=copy_time, slots=slots,
                            cache_mode=runtime.config.cache_mode, cold_share=1 / FLUSH_EVERY,
                            route_source="oracle" if oracle else "deployable",
                            candidates=candidates, warmup_cycles=warmup, max_new_tokens=max_new_tokens, seed=seed,
                            median_draft_seconds=draft),
                torch_threads=torch.get_num_threads())
    chosen_pools = pools[:: max(1, len(pools) // STABILITY_POOLS)][:STABILITY_POOLS]
    gate = gate if gate is not None else PROBES["gate"]
    # the paper's model: the same probes at the user's link, fitted on demand alone (valid at these slots only)
    try:
        paper = CostModel.fit(on_user_link, max_nodes=max_nodes, draft_level_seconds=levels)
        checked, _ = assess(on_user_link, max_nodes, levels, folds=folds, bootstrap=max(20, bootstrap // 4),
                            seed=seed, gate=gate)
        meta["paper"] = dict(intercepts=list(paper.intercepts), beta=paper.beta, draft_level_seconds=list(levels),
                             slots=slots, link=_label(links[-1]), cache_mode=runtime.config.cache_mode,
                             r2=paper.meta["r2"], heldout_r2=checked["heldout_r2"],
                             beta_interval_s=checked["beta_interval_s"])
    except ValueError as err:
        meta["paper"] = None
        meta["paper_error"] = str(err)
    quality, heldout = assess(records, max_nodes, levels, kind="cache-aware", folds=folds, bootstrap=bootstrap,
                              seed=seed, pools=chosen_pools, gate=gate)
    cost = CostModel.fit(records, max_nodes=max_nodes, draft_level_seconds=levels, kind="cache-aware",
                         quality=quality, **meta)
    return Calibration(cost.priced(copy_time[-1]), records, heldout)


def _link_seconds(runtime, link) -> float:
    """The link's own time for one expert copy: an emulated link's, the real one's on CUDA, 0 for a CPU memcpy."""
    if link is not None:
        return float(link.copy_time(runtime.store.expert_bytes))
    if runtime.device.type == "cuda":
        return link_seconds(runtime)
    return 0.0


def _label(link) -> str:
    return link.label if link is not None else "real copies"


def fit_profile(model, prompts, *, out=None, force: bool = False, **options) -> CostModel:
    """Calibrate this machine for ``model`` (enabled, with a drafter) and install the profile where ``enable`` finds
    it, as ``specfit calibrate`` does, for a model built in code: ``prompts`` are token-id tensors ([1, P] or [P])
    or lists of ids; ``options`` go to ``calibrate`` (``probes``, ``repeats``, ``links``, ...). Returns the profile
    (priced for the model's link). A poor fit is not installed (``force=True`` installs it; enable warns)."""
    ids = [p if isinstance(p, torch.Tensor) else torch.tensor(p) for p in prompts]
    ids = [(p if p.dim() == 2 else p[None]).to(model.specfit.device) for p in ids]
    if not ids:
        raise ValueError("fit_profile needs at least one prompt (token ids of the model's tokenizer)")
    result = calibrate(model, ids, **options)
    install(result.cost, Path(out) if out else profile_path(**profile_key(model)), force=force)
    return result.cost


def _generate(model, ids, probe, max_new_tokens) -> list:
    """One greedy generate() with the probe as the assistant, from an empty slot cache; its cycles' records."""
    runtime = model.specfit
    runtime.clear_cache()
    runtime.stats.trace = []
    try:
        model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant=lambda m: probe)
        return runtime.stats.trace
    finally:
        runtime.stats.trace = None


def _agree(runs, repeats: int) -> bool:
    """A configuration counts when every round replayed it as planned, on the same subtree, demand and misses."""
    return (len(runs) == repeats and not any(diverged for _, _, diverged in runs)
            and len({(c.n_nodes, c.demand, c.misses) for c, _, _ in runs}) == 1)


def _level_seconds(per_config: list[list[list[float]]]) -> tuple[float, ...]:
    """Drafting time of each level: per configuration its fastest repeat, then the median over configurations, for
    as many levels as most cycles drafted."""
    if not per_config:
        return ()
    depth = statistics.mode(len(levels) for repeats in per_config for levels in repeats)
    return tuple(statistics.median(min(levels[d] for levels in repeats) for repeats in per_config
                                   if all(len(levels) > d for levels in repeats)) for d in range(depth))


# --- the command ------------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the embedded model)")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (default: the embedded drafter)")
    p.add_argument("--slots", type=int, default=None,
                   help="expert slots per MoE layer on the device (default: 3/8 of the model's experts per layer, "
                        "the paper's 48 of 128: 24 for the embedded model's 64; with --acceptance-only, all of them)")
    p.add_argument("--cache-mode", choices=("cached", "cleared"), default="cached",
                   help="'cached': slots keep experts across forwards (LRU); 'cleared': emptied before every forward")
    p.add_argument("--prompts", default=PROBES["prompts"],
                   help="gsm8k (default, as in the paper), cnn, random (token ids; for checkpoints without a "
                        "tokenizer), or a local .jsonl with a 'question' or 'text' field")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts to decode (default {PROBES['num_prompts']}; with --acceptance-only, "
                        f"{ACCEPTANCE_PROMPTS})")
    p.add_argument("--probes", type=int, default=PROBES["probes"],
                   help="probe configurations (cycles) to fit on")
    p.add_argument("--repeats", type=int, default=PROBES["repeats"],
                   help="timed repeats of each configuration; its fastest is fitted")
    p.add_argument("--bootstrap", type=int, default=PROBES["bootstrap"], help="bootstrap refits for the intervals")
    p.add_argument("--max-new-tokens", type=int, default=PROBES["max_new_tokens"],
                   help="tokens generated per prompt (each cycle is a probe)")
    p.add_argument("--link-ms", type=float, default=None, help="emulated host link: milliseconds per expert copy")
    p.add_argument("--default-link", type=float, nargs="?", const=1.0, default=None, metavar="RATIO",
                   help="the embedded model's structural default link (a token's expert copies = 1.4x its compute, "
                        "measured here), times RATIO (default 1): what the demo and the bench use")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on a CPU device: 1, as `specfit bench` and `demo` use; more "
                        "threads fight other jobs for the cores and make the timer noisy)")
    p.add_argument("--seed", type=int, default=PROBES["seed"], help="seed for the probe schedule and bootstrap")
    p.add_argument("--out", default=None, help="profile path (default: the user cache, where enable() looks)")
    p.add_argument("--force", action="store_true",
                   help="install the profile even when the fit fails the quality gate (enable() will warn)")
    p.add_argument("--plot", default=None,
                   help="PNG of predicted vs measured cycle time (default: beside the profile; needs matplotlib)")
    p.add_argument("--acceptance-only", action="store_true",
                   help="instead of the cost profile, fit the acceptance model's tables for the drafter: greedy and "
                        "sampling labels from the EAGLE-3 assistant on GSM8K train questions and CNN/DailyMail "
                        "articles from the end of the test file (--num-prompts of them, default 24), written to "
                        "the user cache under the drafter's content, where enable() reads them before the drafter "
                        "folder's own acceptance.json (or to --out); --slots defaults to all experts")


def main(args) -> int:
    from tqdm.auto import tqdm

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.acceptance_only:
        return _acceptance_only(args)
    args.num_prompts = args.num_prompts or PROBES["num_prompts"]
    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu" or (args.device is None and not torch.cuda.is_available()):
        torch.set_num_threads(1)  # see --threads: the default that keeps the timer quiet on a shared CPU
    t0 = time.perf_counter()
    model, tokenizer = _load(args)
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {model.specfit!r}", flush=True)  # before the probes' minutes
    prompts = _prompt_ids(args, tokenizer, model)
    with tqdm(desc="calibration (planning round, then timed rounds)", unit="generate") as bar:
        def progress(done, total):
            bar.total = total
            bar.n = done
            bar.refresh()

        result = calibrate(model, prompts, probes=args.probes, repeats=args.repeats, seed=args.seed,
                           max_new_tokens=args.max_new_tokens, bootstrap=args.bootstrap, progress=progress)
    cost = result.cost
    path = Path(args.out or profile_path(cost.meta["device"], cost.meta["model_key"]))
    print(describe(cost))
    written = install(cost, path, force=args.force)
    installed = written == path
    beside = str(path).removesuffix(".json") + ("" if installed else ".rejected") + ".png"
    plot_fit(result, args.plot or beside)
    return 0 if installed else 3


def _acceptance_only(args) -> int:
    """``--acceptance-only``: fit the drafter's acceptance tables (see evaluation/acceptance_tables.py) and write them
    to the user cache under the drafter's key, where ``enable`` finds them first (selection/acceptance_cache.py), or
    to ``--out``. Nothing is written into the drafter's folder (for the embedded drafter: the installed package)."""
    from tqdm.auto import tqdm

    from .acceptance_tables import calibration_prompts, describe as describe_tables, fit_tables
    from ..selection.acceptance_cache import user_tables_path

    from .. import embedded

    drafter = args.drafter or (embedded.DRAFTER_DIR if args.model is None else None)
    if args.out:
        out = Path(args.out)
    elif drafter is None or not Path(drafter).is_dir():
        raise ValueError("--acceptance-only files the tables in the user cache under a local drafter folder's "
                         "content; pass --drafter FOLDER (a local EAGLE-3 checkpoint folder) or --out PATH")
    else:
        out = user_tables_path(drafter)  # checked and named before the model loads
    if args.slots is None:
        from transformers import AutoConfig

        args.slots = AutoConfig.from_pretrained(embedded.TARGET_DIR if args.model is None else args.model).num_experts
    model, tokenizer = _load(args)
    torch.set_num_threads(args.threads or (1 if model.specfit.device.type == "cpu" else torch.get_num_threads()))
    if tokenizer is None:
        raise ValueError("--acceptance-only decodes text prompts and needs the model's tokenizer")
    prompts = calibration_prompts(tokenizer, args.num_prompts or ACCEPTANCE_PROMPTS)
    with tqdm(total=2 * len(prompts), desc="acceptance labels (greedy, then sampling)", unit="prompt") as bar:
        tables = fit_tables(model, prompts, max_new_tokens=args.max_new_tokens, seed=args.seed,
                            progress=lambda done: bar.update(done - bar.n))
    print(describe_tables(tables))
    out.parent.mkdir(parents=True, exist_ok=True)
    tables.save(out)
    if args.out:
        print(f"acceptance tables written to {out} (specfit.enable reads the user cache's tables, not --out; "
              f"without --out they go where it reads them first)")
    else:
        print(f"acceptance tables written to {out}: specfit.enable(..., drafter={str(drafter)!r}) loads them "
              f"first; the drafter folder's own acceptance.json is left as it was")
    return 0


def install(cost: CostModel, path, force: bool = False) -> Path:
    """Write the profile to ``path`` unless its fit is poor, in which case it goes to ``path + ".rejected"`` (a
    name neither ``enable()`` nor the reference lookup reads), a loud refusal with the remedy is printed, and
    whatever was at ``path`` stays. ``force`` installs a poor profile anyway (``enable()`` warns when it loads it).
    Returns the path written."""
    path = Path(path)
    quality = cost.quality or {}
    if quality.get("verdict") != "poor":
        cost.save(path)
        print(f"profile written to {path}")
        return path
    reasons = "".join(f"\n  - {reason}" for reason in quality.get("reasons", []))
    if force:
        cost.save(path)
        print(f"WARNING: the fit is unreliable and was installed anyway (--force) at {path}:{reasons}\n"
              f"  SpecFit will warn whenever it loads it. Remedy: {REMEDY}.", file=sys.stderr)
        return path
    rejected = path.with_name(path.name + ".rejected")
    cost.save(rejected)
    print(f"\nCALIBRATION REFUSED: the fit is unreliable, so it was NOT installed at {path}:{reasons}\n"
          f"  Remedy: {REMEDY}.\n"
          f"  The rejected profile is at {rejected} for inspection; rerun with --force to install it anyway.\n",
          file=sys.stderr)
    return rejected


def describe(cost: CostModel) -> str:
    m, q = cost.meta, cost.quality or {}
    probes = m.get("probes") or {}

    def num(x, scale=1.0, digits=3):
        return "n/a" if x is None else f"{x * scale:.{digits}f}"

    def ms(values, digits=2):
        return " ".join(num(v, 1e3, digits) for v in values)

    lines = [f"device      {m.get('device')}", f"model       {m.get('model_key', m.get('model_id'))}",
             f"probes      {probes.get('slots')} slots ({probes.get('cache_mode')}), links: "
             f"{', '.join(probes.get('links', []))}; one profile for every slot count and link",
             f"compute     {cost.beta * 1e3:.4f} ms per expert computed (beta)"]
    if cost.prices_copies:
        lines.append(f"copy        {cost.copy_overhead * 1e3:.4f} ms per expert copied + {cost.link_share:.2f} x the "
                     f"link's time per copy ({cost.copy * 1e3:.4f} ms at the probes' link)")
    lines += [f"intercepts  {ms(cost.intercepts)} ms (n = 0..)",
              f"drafting    {ms(cost.draft_level_seconds)} ms per level (1..), included in every intercept"
              if cost.draft_levels else "drafting    not modelled per level",
              f"fit         R^2 {num(m.get('r2'))}, rms residual {num(m.get('rms_residual_s'), 1e3, 2)} ms over "
              f"{m.get('n_records')} probe records"]
    paper = m.get("paper")
    if paper:
        lines.append(f"paper       {paper['beta'] * 1e3:.4f} ms per expert of demand, R^2 {num(paper.get('r2'))} "
                     f"(held out {num(paper.get('heldout_r2'))}): the demand-only fit for cost='paper', valid at "
                     f"{paper.get('slots')} slots and {paper.get('link')} only")
    if q.get("verdict") in ("good", "poor"):
        name = "copy" if q.get("kind") == "cache-aware" else "beta"
        width = q.get(f"{name}_halfwidth")
        interval = q.get(f"{name}_interval_s") or [None, None]
        lines += [f"held out    R^2 {num(q.get('heldout_r2'))}, rms {num(q.get('heldout_rms_s'), 1e3, 2)} ms "
                  f"({q.get('folds')}-fold cross-validation)",
                  f"bootstrap   {name} 95% [{ms(interval, 4).replace(' ', ', ')}] ms "
                  f"({'unbounded' if width is None else f'+-{100 * width:.0f}%'}); intercepts "
                  + " ".join(f"[{ms(pair).replace(' ', ', ')}]" for pair in q.get("intercept_intervals_s", []))
                  + " ms"]
        if q.get("choice_change_rate") is not None:
            lines.append(f"selector    choice changes on {100 * q['choice_change_rate']:.1f}% of (pool, bootstrap "
                         f"fit) pairs over {q.get('pools')} recorded pools, losing {100 * q['choice_loss']:.2f}% of "
                         f"the predicted tokens per second on average")
        limit = q.get("gate", {}).get("max_beta_halfwidth")
        if q["verdict"] == "good" and limit is not None and (width is None or width > limit):
            lines.append(f"note        the {name} interval is wider than +-{100 * limit:.0f}%, but the choices it "
                         f"moves lose little (see fit_quality's gate, rule 2)")
        lines.append(f"verdict     {q['verdict'].upper()}" + "".join(f"\n            - {r}" for r in q["reasons"]))
    elif q:
        lines.append(f"verdict     {q.get('verdict')}: " + "; ".join(q.get("reasons", [])))
    return "\n".join(lines)


def plot_fit(result: Calibration, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'specfit[plot]'): no plot written")
        return
    cost, records = result.cost, result.records
    measured = [r.seconds * 1e3 for r in records]
    predicted = [_predict(cost, r) * 1e3 for r in records]
    heldout = [s * 1e3 for s in result.heldout_seconds]
    q = cost.quality or {}
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(heldout, measured, s=22, facecolors="none", edgecolors="tab:red", lw=0.7,
               label=f"held out ({q.get('folds', '?')}-fold)")
    dots = ax.scatter(predicted, measured, s=8, c=[r.n_nodes for r in records], cmap="viridis", label="fitted")
    fig.colorbar(dots, ax=ax, label="draft nodes verified (n)", shrink=0.8)
    lo, hi = min(measured + predicted + heldout), max(measured + predicted + heldout)
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.set_xlabel("predicted cycle time (ms)")
    ax.set_ylabel("measured cycle time (ms, fastest of the repeats)")
    held = q.get("heldout_r2")
    ax.set_title(f"compute {cost.beta * 1e3:.3f} ms/expert, copy {cost.copy * 1e3:.3f} ms, R² "
                 f"{cost.meta.get('r2') or 0:.3f}, held-out R² "
                 f"{'n/a' if held is None else f'{held:.3f}'}\nverdict: {q.get('verdict', 'n/a')}", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")
    print(READ_THE_PLOT)


def _predict(cost: CostModel, record: Record) -> float:
    """A record's predicted seconds, its copies priced at the link it ran over."""
    priced = cost.priced(record.link_seconds) if cost.prices_copies else cost
    return priced.predict(record.n_nodes, record.demand, misses=record.misses)


SLOT_SHARE = 48 / 128  # --slots by default: the paper's headline setting, 48 of Qwen3-30B-A3B's 128 experts per layer


def default_slots(config) -> int:
    """``SLOT_SHARE`` of the model's experts per layer (at least 1), read from its config."""
    text = config.get_text_config(decoder=True)
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        n = getattr(text, name, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return max(1, round(n * SLOT_SHARE))
    raise ValueError("cannot tell the model's experts per layer from its config; pass --slots N")


def _load(args):
    from transformers import AutoConfig

    from .. import embedded
    from ..offload.link import LinkConfig

    if args.slots is None:
        args.slots = default_slots(AutoConfig.from_pretrained(args.model or embedded.TARGET_DIR))
        print(f"--slots not given: {args.slots} slots per MoE layer (3/8 of the model's experts, as the paper's 48 of "
              f"128)", flush=True)
    if args.default_link is not None and args.link_ms:
        raise ValueError("give --link-ms or --default-link, not both")
    if args.default_link is not None:
        link = embedded.default_link(args.default_link) if args.default_link > 0 else None
    else:
        link = LinkConfig(seconds_per_expert=args.link_ms / 1e3) if args.link_ms else None
    kw = dict(cache_mode=args.cache_mode, link=link)
    if args.model is None:

        model, tokenizer = embedded.load(args.slots, **kw)
        if args.drafter:
            from ..patch import set_drafter

            set_drafter(model, args.drafter)
        return model, tokenizer
    from ..patch import from_pretrained

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = from_pretrained(args.model, cache_slots=args.slots, dtype=dtype, device=args.device,
                            drafter=args.drafter, **kw)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception:  # synthetic checkpoints ship no tokenizer
        tokenizer = None
    return model, tokenizer


def _prompt_ids(args, tokenizer, model) -> list[torch.Tensor]:
    from . import datasets

    device = model.specfit.device
    if args.prompts == "random":
        g = torch.Generator().manual_seed(args.seed)
        vocab = model.config.vocab_size
        return [torch.randint(1, vocab, (1, 32), generator=g).to(device) for _ in range(args.num_prompts)]
    if tokenizer is None:
        raise ValueError(f"--prompts {args.prompts} needs a tokenizer, and none was found with the model; "
                         f"use --prompts random")
    if args.prompts in ("gsm8k", "cnn"):
        texts = datasets.prompts(args.prompts, args.num_prompts, max_chars=1500)
    elif args.prompts.endswith(".jsonl"):
        rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()]
        texts = [datasets.GSM8K_PROMPT.format(question=r["question"]) if "question" in r else r["text"]
                 for r in rows[: args.num_prompts]]
    else:
        raise ValueError(f"--prompts must be gsm8k, cnn, random or a .jsonl file, got {args.prompts!r}")
    return [tokenizer(t, return_tensors="pt").input_ids.to(device) for t in texts]
