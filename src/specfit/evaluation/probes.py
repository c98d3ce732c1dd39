"""The calibration probes: the configurations ``specfit calibrate`` times, the rounds that time them, and the fit.

A probe *configuration* is one real decoding cycle whose verified subtree was chosen for the fit, not by a selector:
its size ``n`` comes from a balanced schedule over ``0..max_nodes``, and the subtree from a scheduled quantile
(lowest, highest or random) of ``candidates`` random ancestor-closed subtrees of that size, ranked by their demand or
by their misses (the schedule alternates), so node count, demand and misses vary independently. Demand and misses
are told apart further by *cold* cycles: one configuration in ``FLUSH_EVERY`` empties the slot cache before its
verify forward, so it copies every expert it computes. The choice reads the routes the model's deployable route
source gives (a trained predictor or the target's gates, as SpecFit runs; the route oracle only where neither
exists): a choice needs only variety, and the record keeps the demand and misses the verify forward really had.
So the probes need no extra target forward.

The run has ``1 + repeats x (links + lanes)`` rounds over the same prompts. Round 0 *plans*: it decodes each prompt and records
every cycle's pool, chosen subtree and whether it runs cold. The other rounds *replay* the plan: each generate()
starts from an empty slot cache, and greedy decoding is deterministic, so a configuration's cycle is the same cycle
in every round: same pool, same subtree, same cache state. Each round visits the prompts in a new random order, so a
configuration's repeats are spread over the whole run and a slow drift of the machine hits every configuration
alike. On a CPU the replays alternate between no link and an emulated one (the one given, or the embedded model's
structural default), so the share of the link's time a copy waits for is measured apart from the copy's own
overhead; on a GPU the real link is timed (its time per copy measured from the pinned bandwidth). Where the model
has a host lane (or, for the embedded model, its structural default), more rounds compute every cold expert on it
(``cold="host"``): on a CPU the emulated lane and the same lane at half its bandwidth, so the share of the lane's
time a host expert waits for is measured apart from its overhead; on a GPU the real lane. A record is the
configuration's *fastest* repeat on each link (``STATISTIC``: load on a shared machine only ever adds time).
Drafting does not depend on the subtree (every probe drafts the full pool), so each record carries the drafting time
of the median configuration plus its own time after drafting; the drafting time of each level is measured too
(``draft_level_seconds``), as SpecFit drafts it.

``calibrate`` runs them and returns the fit: ``CostModel.fit`` solves the monotone NNLS problem;
``specfit.selection.fit_quality`` cross-validates it, bootstraps intervals, checks the selector's choices on the
planned pools, and gates it. The same probes fitted on demand alone (at the user's link) are kept as the paper's
model (``cost="paper"``). ``calibration/probes.json`` holds the defaults. The command around it (arguments,
installing, describing and plotting a profile) is ``specfit.evaluation.calibrate``.
"""

from __future__ import annotations

import random
import statistics
import time
import warnings
from typing import NamedTuple

import numpy as np
import torch

from ..calibration import LEAST, PROBES
from ..decoding.assistants import Eagle3Generator
from ..drafting.tree import DraftTree, random_subtree
from ..offload.host_compute import InlineLane
from ..offload.host_lane import EmulatedHostLane
from ..offload.link import EmulatedLink
from ..selection.cost_model import CostModel, Record
from ..selection.fit_quality import Pool, assess
from ..selection.profiles import device_name, link_seconds, model_id, model_key
from ..selection.route_sources import ROUTE_SOURCES, choose_route_source, oracle_routes
from ..selection.selector import select_subtree
from .lane_budget import bounded_lanes

# The statistic kept per configuration: its fastest repeat. Interference from other work only ever adds time (a
# descheduled thread, evicted caches), so the noise is one-sided; measured on a shared 2-core machine (embedded model,
# 12 slots, 0.28 ms link, 240 configurations x 5 repeats), a repeat took a median 1.17x and at the 90th percentile
# 2.2x its configuration's fastest, and whole rounds ran 14 to 22 ms per cycle. The minimum of 3 fitted with R^2
# 0.96 (misses) where the median of 3 reached 0.75 and the median of 5 0.76.
STATISTIC = "min"
FLUSH_EVERY = 6  # one probe configuration in this many runs cold (slot cache emptied before its verify forward)
STABILITY_POOLS = 64  # recorded pools the selector-stability check uses (spread over the run)


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
    if runtime.cuda:
        return [None]
    link = link if link is not None else runtime.config.link
    if link is None:
        from .. import embedded

        if embedded.is_embedded(model):
            link = embedded.default_link()
    return [None] if link is None else [None, link]


def probe_lanes(model, host=None) -> list:
    """The host lanes of the replays that compute every cold expert on the host (after the link rounds): on CUDA the
    real lane (``True``); on a CPU ``host`` (a ``HostConfig``; else the model's own emulated lane, else for the
    embedded model its structural default) and the same lane at half its bandwidth, so the share of the lane's time
    is measured apart from its overhead; none where there is no lane."""
    from dataclasses import replace

    runtime = model.specfit
    if not getattr(runtime.store.format, "host_path", False):
        return []  # a stored format the host lane cannot compute: always copied
    if runtime.cuda:
        return [True] if runtime.lane is not None else []
    host = host if host is not None else runtime.config.host
    if host is None:
        from .. import embedded

        if embedded.is_embedded(model):
            host = embedded.default_host()
    return [] if host is None else [host, replace(host, bandwidth=host.bandwidth / 2, relative=None)]


def calibrate(model, prompts: list[torch.Tensor], probes: int = PROBES["probes"], repeats: int = PROBES["repeats"],
              seed: int = PROBES["seed"], warmup: int = PROBES["warmup_cycles"],
              max_new_tokens: int = PROBES["max_new_tokens"], candidates: int = PROBES["candidates"],
              bootstrap: int = PROBES["bootstrap"], folds: int = PROBES["folds"], gate: dict | None = None,
              links=None, lanes=None, progress=None, batch_rows=tuple(PROBES["batch_rows"]),
              lane_seconds: float | None = None) -> Calibration:
    """Run the probes on an enabled model (with a drafter) over ``prompts`` ([1, P] token ids): ``probes``
    configurations after ``warmup`` cycles per prompt, each timed ``repeats`` times on each of ``links`` (default
    ``probe_links(model)``; every cold expert copied) and of ``lanes`` (default ``probe_lanes(model)``; every cold
    expert computed on the host); fit, assess and return them. Then the batch probes (``batch_probes.py``) time
    batches of ``batch_rows`` rows (none: ``()``) and add a batch's fixed time to the profile (``meta["batch"]``).

    ``progress``, if given, is called as ``progress(done, total)`` in generate() calls. ``lane_seconds``: the most
    the lane rounds may take by the lane's measured speed (``lane_budget.py``), else they are skipped."""
    for name, value, low in (("probes", probes, 10), ("repeats", repeats, LEAST["repeats"]),
                             ("bootstrap", bootstrap, LEAST["bootstrap"]), ("candidates", candidates, 1),
                             ("warmup", warmup, 0), ("max_new_tokens", max_new_tokens, warmup + 1), ("folds", folds, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:  # before the minutes of probing
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    runtime = model.specfit
    max_nodes = runtime.options.max_nodes
    links = probe_links(model) if links is None else list(links)
    lanes = probe_lanes(model) if lanes is None else list(lanes)
    # each round's setting: (link, lane); a lane None copies every cold expert, else computes every one on it
    settings = [(link, None) for link in links] + [(links[-1], lane) for lane in lanes]
    need, most = least_records(max_nodes, folds), probes * len(settings) * repeats  # most: every repeat fitted alone
    if most < need:  # the cross-validation would refuse them after the minutes of probing, whatever the replays do
        raise ValueError(f"probes must be >= {-(-need // (len(settings) * repeats))} here: {probes} x {repeats} "
                         f"repeats on {len(settings)} link and lane setting(s) give at most {most} records, and a "
                         f"{folds}-fold cross-validation of a fit with up to {max_nodes + 1} intercepts needs {need}")
    rng = random.Random(seed)
    sizes = schedule(rng, max_nodes)
    report = progress or (lambda done, total: None)

    plans: list[tuple[int, list[Planned]]] = []  # (prompt index, its cycles)
    pools: list[Pool] = []
    configs, oracle, planned = 0, False, [0, 0]  # planned: experts computed while decoding, in prefills
    while configs < probes:
        before = configs
        for i, ids in enumerate(prompts):
            probe = PlanningProbe(model, rng, sizes, candidates)
            _generate(model, ids, probe, max_new_tokens)
            planned = [planned[0] + runtime.stats.last_generate.demand, planned[1] + runtime.stats.last_prefill.demand]
            oracle = probe.oracle
            plans.append((i, probe.plan))
            pools += probe.pools[warmup:]
            configs += max(0, len(probe.plan) - warmup)
            report(len(plans), None)
            if configs >= probes:
                break
        if configs == before:
            raise RuntimeError(f"calibration produced no probes: every prompt ended within the {warmup} warm-up "
                               f"cycles (an eos, or max_new_tokens={max_new_tokens}); use longer generations "
                               f"(max_new_tokens; the command's --max-new-tokens) or other prompts")

    lanes = bounded_lanes(runtime, lanes, tuple(planned), repeats, lane_seconds,
                          fits_without=probes * len(links) * repeats >= need)
    settings = [(link, None) for link in links] + [(links[-1], lane) for lane in lanes]
    # (plan, cycle, link) -> [(CycleRecord, level seconds, diverged)] per round
    timed: dict[tuple[int, int, int], list] = {}
    order = list(range(len(plans)))
    rounds = [(r, k) for r in range(repeats) for k in range(len(settings))]
    saved = runtime.engine.link, runtime.lane, runtime.cold
    copy_time: list[float] = []  # the link's own time per copy, per setting
    host_time: list[float] = []  # the lane's own time per host expert (one token), per setting (0: no lane)
    try:
        for link, lane in settings:
            _use(runtime, link, lane, saved[1])
            copy_time.append(_link_seconds(runtime, link))
            host_time.append(runtime.host_seconds() if lane is not None else 0.0)
        for done, (r, k) in enumerate(rounds):
            _use(runtime, *settings[k], saved[1])
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
        runtime.engine.link, runtime.lane, runtime.cold = saved

    keys = [(j, c) for j, (_, plan) in enumerate(plans) for c in range(warmup, len(plan))][:probes]
    records, on_user_link, level_runs, dropped, matched_all = [], [], [], 0, True
    draft = None
    for k in range(len(settings)):
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
        mine = [Record(runs[0][0].n_nodes, runs[0][0].demand, draft + p, runs[0][0].misses, copy_time[k],
                       runs[0][0].host_experts, host_time[k]) for runs, p in zip(kept, post)]
        records += mine
        if k == len(links) - 1:  # the user's link, every cold expert copied
            on_user_link = mine
        level_runs += [[levels for _, levels in runs] for runs in kept]
    levels = _level_seconds(level_runs)

    slots = runtime.config.cache_slots
    meta = dict(device=device_name(runtime), model_id=model_id(model), model_key=model_key(model),
                probe="specfit.calibrate/probes.json",
                probes=dict(configs=len(keys), records=len(records), dropped=dropped if matched_all else None,
                            repeats_matched=matched_all, repeats=repeats,
                            links=[_label(link) for link, _ in settings], link_seconds=copy_time,
                            lanes=[_lane_label(runtime, lane) for _, lane in settings], host_seconds=host_time,
                            slots=slots,
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
    if lanes:  # priced at the user's link and the first lane, choosing per expert as "auto" does
        cost = cost.priced(copy_time[len(links) - 1], host_time[len(links)], "auto")
    else:
        cost = cost.priced(copy_time[-1])
    from .batch_probes import with_batches  # one way: the batch probes need nothing of this module

    return Calibration(with_batches(model, prompts, cost, batch_rows, repeats, seed, max_new_tokens), records,
                       heldout)


def least_records(max_nodes: int, folds: int) -> int:
    """The fewest records whose every cross-validation fit (all but one fold) has the ``max_nodes + 3`` a fit with
    every node count observed needs (``cost_fit.fit_coefficients``: one record more than its coefficients)."""
    n = max_nodes + 3
    while n - -(-n // folds) < max_nodes + 3:
        n += 1
    return n


def _use(runtime, link, lane, own_lane) -> None:
    """Set up one round's setting: the emulated link (or none), and every cold expert copied (``lane`` None) or
    computed on ``lane`` (a ``HostConfig`` emulated; ``True``: the model's own real lane)."""
    runtime.engine.link = EmulatedLink(link) if link is not None else None
    runtime.cold = "copy" if lane is None else "host"
    runtime.lane = own_lane if lane is None or lane is True else InlineLane(EmulatedHostLane(lane))


def _lane_label(runtime, lane) -> str | None:
    if lane is None:
        return None
    return runtime.host_label if lane is True else lane.label


def _link_seconds(runtime, link) -> float:
    """The link's own time for one expert copy: an emulated link's, the real one's on CUDA, 0 for a CPU memcpy."""
    if link is not None:
        return float(link.copy_time(runtime.store.expert_bytes))
    if runtime.cuda:
        return link_seconds(runtime)
    return 0.0


def _label(link) -> str:
    return link.label if link is not None else "real copies"


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
            and len({(c.n_nodes, c.demand, c.misses, c.host_experts) for c, _, _ in runs}) == 1)


def _level_seconds(per_config: list[list[list[float]]]) -> tuple[float, ...]:
    """Drafting time of each level: per configuration its fastest repeat, then the median over configurations, for
    as many levels as most cycles drafted."""
    if not per_config:
        return ()
    depth = statistics.mode(len(levels) for repeats in per_config for levels in repeats)
    return tuple(statistics.median(min(levels[d] for levels in repeats) for repeats in per_config
                                   if all(len(levels) > d for levels in repeats)) for d in range(depth))

