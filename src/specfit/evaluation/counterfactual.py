"""The counterfactual instrument of issue 38: what SpecFit's objective says of EAGLE-3's tree, against what that tree
really does, on the same pools. A measurement device, never a default.

Cycles alternate. A *SpecFit turn* is SpecFit as it runs (its stop rule, its backoff, its winner verified). An
*EAGLE-3 turn* drafts the full pool, as EAGLE-3 does, and verifies EAGLE-3's tree (the ``max_nodes`` pool nodes of
highest path probability); on the way it replays SpecFit's rule on the same pool without acting on it: the level
where the stop rule would have stopped and its winner there (or that the backoff would have skipped drafting), the
winner of the exact search on the full pool, and the pick of the throughput-optimal rule (expected tokens minus
``lambda`` x predicted seconds, ``lambda`` the run's measured tokens per second so far). SpecFit's forecast (tokens
and seconds) of each of these subtrees is recorded with its parts: the path values, ``a(n)``, drafting, predicted
demand and misses. After the call, each cycle's record is joined with its trace row (the realized tokens and
seconds, the verify forward's demand and misses).

Greedy decoding knows what the target would do at every verified position, so the tokens a subtree *inside*
EAGLE-3's tree would have committed are exact (``realized tokens`` of SpecFit's stop-rule winner, where it lies in
EAGLE-3's tree). Drafting runs the route head on every drafted node in both turns (SpecFit needs the routes), so an
EAGLE-3 turn's drafting is SpecFit's, not EAGLE-3's own (which drafts fewer nodes): the report shows drafting apart.

``summarize(rows)`` turns the records of a cell into the figures that say which term mis-values what
(``python benchmarks/run.py calibration counterfactual`` runs the cells and prints them). Use: ``generate(...,
assistant=Counterfactual.factory(log))`` with ``model.specfit.stats.start_trace()`` on, then ``join(log, trace)``.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np

from ..decoding.assistants import SpecFitGenerator, acceptance_model, eagle_tree
from ..drafting.tree import DraftTree
from ..selection.selector import select_subtree, takes_from_level

NAME = "specfit-counterfactual"


class Counterfactual(SpecFitGenerator):
    """SpecFit and EAGLE-3 on alternate cycles of one decoding, with SpecFit's forecast of both (module docstring).

    ``log``: a list that receives one dict per cycle (the forecasts; ``join`` adds what happened)."""

    def __init__(self, model, log: list):
        super().__init__(model)
        self.log = log
        self.guard = None  # SpecFit's turns are SpecFit's rule; the alternation is the instrument's
        self.turn = 0
        self.row: dict = {}
        self.verified: tuple[int, ...] = ()
        self.lam = None  # measured tokens per second of the run so far (the throughput rule's lambda)
        self._done_tokens = self._done_seconds = 0.0

    @classmethod
    def factory(cls, log: list):
        return lambda model: cls(model, log)

    # phases 1-2 ------------------------------------------------------------------------------------------------
    def draft(self, cycle):
        self._update_lambda()
        self.turn += 1
        if self.turn % 2:  # SpecFit's turn: SpecFit as it runs
            skipping = self.backoff.skipping
            tree = super().draft(cycle)
            w = self.winner
            levels = tree.depth if len(tree) else 0
            self.verified = w.nodes if w is not None else ()
            self.row = dict(kind="specfit", skipped=skipping, levels=levels, pool=len(tree), nodes=len(self.verified),
                            fc_tokens=self.expected_tokens, fc_seconds=self.predicted_seconds,
                            fc_draft=self._drafting(levels), fc_demand=None if w is None else w.demand,
                            fc_misses=None if w is None else w.misses, fc_a=self._intercept(len(self.verified), levels))
            self._node_rows(tree, self.verified)
            return tree
        return self._eagle_turn(cycle)

    def _eagle_turn(self, cycle) -> DraftTree:
        """Draft the full pool; replay SpecFit's rule on it (stop level, winner there, full-pool winner, throughput
        pick); verify EAGLE-3's tree."""
        would_skip = self.backoff.skipping
        self.winner = None
        self._catch_up()
        cycle.drafter = self.drafter
        self.values, self.estimates = [], []
        if self.calibrated:
            self.acceptance = acceptance_model(self.runtime, cycle.sampling)
        resident = self.runtime.resident_mask() if self.cost.miss else None  # as SpecFit's draft()
        stop = None  # (level, Selection) where SpecFit's stop rule would have stopped
        tree = DraftTree()
        for tree in self.drafter.levels():
            node_routes, root_routes = self.routes(cycle, tree)  # [N, L, E], [L, E]
            cost = self._cost(tree.depth)
            values = self._path_values(tree) if self.calibrated else tree.path_probs
            sel = select_subtree(tree.parents, values, node_routes, root_routes, cost, self.max_nodes,
                                 resident=resident)
            if stop is None and not takes_from_level(sel, tree.depths, tree.depth):
                stop = (tree.depth, sel)
        levels = tree.depth
        full = sel
        if stop is None:
            stop = (levels, sel)
        values = self.values if self.calibrated else tree.path_probs
        res = resident if resident is not None else np.zeros(root_routes.shape, bool)
        e_nodes = eagle_tree(tree.path_probs, self.max_nodes)
        cost = self._cost(levels)
        e = _score(e_nodes, values, node_routes, root_routes, cost, res)
        tp = None
        if self.lam:
            tp_nodes = throughput_pick(tree.parents, values, node_routes, root_routes, cost, res, self.max_nodes,
                                       self.lam)
            tp = _score(tp_nodes, values, node_routes, root_routes, cost, res)
        demand0 = int(root_routes.sum())
        self._root = (demand0, demand0 if resident is None else int((root_routes & ~resident).sum()))
        if would_skip:
            stop_levels, stop_nodes = 0, ()
            stop_tokens, stop_seconds = 1.0, self._predict_root_only()
        else:
            stop_levels, stop_nodes = stop[0], stop[1].nodes
            stop_tokens, stop_seconds = stop[1].expected_tokens, stop[1].predicted_time
        self.verified, self.levels = e_nodes, levels
        self.expected_tokens, self.predicted_seconds = e["tokens"], e["seconds"]
        self.row = dict(kind="eagle3", skipped=False, levels=levels, pool=len(tree), nodes=len(e_nodes),
                        fc_tokens=e["tokens"], fc_seconds=e["seconds"], fc_draft=self._drafting(levels),
                        fc_demand=e["demand"], fc_misses=e["misses"], fc_a=self._intercept(len(e_nodes), levels),
                        sf_would_skip=would_skip, sf_stop_level=stop_levels, sf_nodes=stop_nodes,
                        sf_fc_tokens=stop_tokens, sf_fc_seconds=stop_seconds,
                        sf_in_eagle=set(stop_nodes) <= set(e_nodes),
                        full_nodes=full.nodes, full_fc_tokens=full.expected_tokens, full_fc_seconds=full.predicted_time,
                        tp_nodes=None if tp is None else tp["nodes"],
                        tp_fc_tokens=None if tp is None else tp["tokens"],
                        tp_fc_seconds=None if tp is None else tp["seconds"], lam=self.lam,
                        eagle_nodes=e_nodes, parents=tuple(tree.parents), tokens=tuple(tree.tokens))
        self._node_rows(tree, e_nodes)
        self._skipped = False
        return tree

    def select(self, tree, cycle):
        return self.verified

    def timed(self, seconds, forward, committed) -> dict:
        """SpecFit's turns refresh the cost model as SpecFit's cycles do; EAGLE-3's turns do not (their node count and
        levels are the instrument's, not a choice)."""
        if self.row.get("kind") != "specfit":
            return {}
        self.nodes = self.verified
        self._forecast_on = (self.row["fc_demand"], self.row["fc_misses"]) if self.row["fc_demand"] is not None \
            else self._root
        return super().timed(seconds, forward, committed)

    # phase 4 ---------------------------------------------------------------------------------------------------
    def learn(self, tree, layout, acc, choices, sampling):
        super().learn(tree, layout, acc, choices, sampling)
        accepted = {layout.nodes[t - 1] for t in acc.path}
        row = self.row
        row["accepted"] = len(acc.path)
        for node in row.get("node_rows", ()):
            node["accepted"] = node["v"] in accepted
        if row["kind"] == "eagle3" and choices is not None:
            # greedy: the target's choice at every verified position, so any subtree of the verified tree commits a
            # known number of tokens
            where = {v: t + 1 for t, v in enumerate(layout.nodes)}
            for key in ("sf", "full", "tp"):
                nodes = row.get(f"{key}_nodes")
                if nodes is not None and set(nodes) <= set(layout.nodes):
                    row[f"{key}_tokens"] = committed_within(nodes, tree.parents, tree.tokens, where, choices)
        self.log.append(row)

    # helpers ---------------------------------------------------------------------------------------------------
    def _update_lambda(self) -> None:
        trace = self.runtime.stats.trace
        if trace:
            self.lam = sum(r.committed for r in trace) / max(sum(r.seconds for r in trace), 1e-9)

    def _cost(self, levels: int):
        return self.level_costs[levels - 1] if self.level_costs else self.cost

    def _drafting(self, levels: int) -> float:
        return self.cost.drafting_seconds(levels) if self.level_costs and levels else 0.0

    def _intercept(self, n: int, levels: int) -> float:
        """The fixed part of the forecast without drafting: ``a(n)`` as a cycle that drafts nothing pays it."""
        if self.level_costs is None:
            return self.cost.intercepts[n]
        return max(self.cost.intercepts[n] - self.cost.drafting_seconds(self.cost.draft_levels), 0.0)

    def _node_rows(self, tree, nodes) -> None:
        values = self.values if self.calibrated and self.values else tree.path_probs
        est = self.estimates if self.calibrated and self.estimates else tree.qs
        self.row["node_rows"] = [dict(v=v, depth=tree.depths[v], rank=tree.ranks[v], q=tree.qs[v], estimate=est[v],
                                      value=values[v]) for v in nodes]


def _score(nodes, values, routes, root_routes, cost, resident) -> dict:
    """SpecFit's forecast of one subtree: tokens, and the cost model's seconds at its demand and cold experts (each
    priced at ``cost.miss``: a copy, or the host lane where the selector prices it there), with their parts."""
    nodes = tuple(sorted(nodes))
    union = root_routes | routes[list(nodes)].any(0) if nodes else root_routes  # [L, E]
    demand, misses = int(union.sum()), int((union & ~resident).sum())
    tokens = 1.0 + math.fsum(values[v] for v in nodes)
    seconds = cost.predict(len(nodes), demand, misses=misses)  # a cold expert at cost.miss, as the selector
    return dict(nodes=nodes, tokens=tokens, seconds=seconds, demand=demand, misses=misses)


def subtrees(parents, max_nodes: int):
    """Every ancestor-closed subtree of at most ``max_nodes`` pool nodes (the empty one first), as sorted tuples."""
    children = defaultdict(list)
    for v, p in enumerate(parents):
        children[p].append(v)
    out = [()]
    frontier = [((), tuple(children[-1]))]
    for _ in range(max_nodes):
        grown = []
        for chosen, cands in frontier:
            for i, v in enumerate(cands):
                nxt = chosen + (v,)
                out.append(tuple(sorted(nxt)))
                grown.append((nxt, cands[i + 1:] + tuple(children[v])))
        frontier = grown
    return out


def throughput_pick(parents, values, routes, root_routes, cost, resident, max_nodes: int, lam: float):
    """The subtree with the most ``expected tokens - lam x predicted seconds`` (the throughput-optimal rule at a
    global rate ``lam``), by enumeration."""
    best, pick = -math.inf, ()
    for nodes in subtrees(parents, max_nodes):
        s = _score(nodes, values, routes, root_routes, cost, resident)
        gain = s["tokens"] - lam * s["seconds"]
        if gain > best + 1e-12:
            best, pick = gain, nodes
    return pick


def committed_within(nodes, parents, tokens, where: dict, choices: list[int]) -> int:
    """Tokens a verified subtree ``nodes`` commits under greedy decoding (accepted nodes + the bonus): follow the
    target's choice from the root through ``nodes`` only. ``where[v]``: the tree index of pool node ``v`` in the
    verify forward, whose ``choices[t]`` is the target's token after position ``t``."""
    chosen = set(nodes)
    at, t, count = -1, 0, 1
    while True:
        nxt = next((v for v in chosen if parents[v] == at and tokens[v] == choices[t]), None)
        if nxt is None:
            return count
        count, at, t = count + 1, nxt, where[nxt]


def join(log: list, trace) -> list[dict]:
    """The cycle records with what happened: realized tokens, seconds, drafting seconds, demand and misses from the
    trace rows of the same cycles (one per record, in order)."""
    records = list(trace)
    if len(records) != len(log):
        raise ValueError(f"{len(log)} counterfactual records but {len(records)} trace rows: start the trace before "
                         f"the call and keep one log per call")
    for row, rec in zip(log, records):
        row.update(tokens=rec.committed, seconds=rec.seconds, draft_seconds=rec.draft_seconds, demand=rec.demand,
                   misses=rec.misses)
    return log


def _sum(rows, key) -> float:
    return float(sum(r[key] for r in rows if r.get(key) is not None))


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(rows: list[dict]) -> dict:
    """The figures of one cell (see the module docstring): by turn, forecast against realized, tokens and seconds
    and their parts; acceptance by depth and rank; the stop rule, the backoff and the throughput rule on EAGLE-3's
    turns; and the attribution of the gap between SpecFit's predicted and realized advantage over EAGLE-3's tree."""
    out: dict = {}
    for kind in ("specfit", "eagle3"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        tok, sec = _sum(rs, "tokens"), _sum(rs, "seconds")
        fc_tok, fc_sec = _sum(rs, "fc_tokens"), _sum(rs, "fc_seconds")
        fc_draft, draft = _sum(rs, "fc_draft"), _sum(rs, "draft_seconds")
        drafted = [r for r in rs if r.get("fc_demand") is not None]
        out[kind] = dict(
            cycles=len(rs), skipped=sum(1 for r in rs if r["skipped"]), nodes=_sum(rs, "nodes") / len(rs),
            levels=_sum(rs, "levels") / len(rs), tokens_per_cycle=tok / len(rs), ms_per_cycle=1e3 * sec / len(rs),
            tok_s=_ratio(tok, sec), fc_tok_s=_ratio(fc_tok, fc_sec),
            tokens_fc_over_real=_ratio(fc_tok, tok), seconds_fc_over_real=_ratio(fc_sec, sec),
            draft_fc_over_real=_ratio(fc_draft, draft), verify_fc_over_real=_ratio(fc_sec - fc_draft, sec - draft),
            demand_fc_over_real=_ratio(_sum(drafted, "fc_demand"), _sum(drafted, "demand")),
            misses_fc_over_real=_ratio(_sum(drafted, "fc_misses"), _sum(drafted, "misses")),
            draft_ms=1e3 * draft / len(rs), fc_draft_ms=1e3 * fc_draft / len(rs))
    # the verify part's residual by node count: a(n) (and per-node compute) where SpecFit rarely verifies
    by_n: dict = defaultdict(list)
    for r in rows:
        if r.get("seconds") is not None:
            by_n[r["nodes"]].append(1e3 * ((r["seconds"] - r["draft_seconds"]) - (r["fc_seconds"] - r["fc_draft"])))
    out["verify_residual_ms_by_nodes"] = {n: (len(v), float(np.mean(v))) for n, v in sorted(by_n.items())}
    # acceptance: predicted path value against accepted, by depth and rank, over every verified node
    acc: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        for node in r.get("node_rows", ()):
            if "accepted" not in node:
                continue
            cell = acc[(node["depth"], min(node["rank"], 2))]
            cell[0] += 1
            cell[1] += node["value"]
            cell[2] += float(node["accepted"])
    out["acceptance_by_depth_rank"] = {k: dict(nodes=n, predicted=p / n, accepted=a / n)
                                       for k, (n, p, a) in sorted(acc.items())}
    e3 = [r for r in rows if r["kind"] == "eagle3"]
    if e3:
        n = len(e3)
        sf_fc_ratio = _ratio(_sum(e3, "sf_fc_tokens"), _sum(e3, "sf_fc_seconds"))
        e_fc_ratio = _ratio(_sum(e3, "fc_tokens"), _sum(e3, "fc_seconds"))
        full_fc_ratio = _ratio(_sum(e3, "full_fc_tokens"), _sum(e3, "full_fc_seconds"))
        covered = [r for r in e3 if r.get("sf_tokens") is not None]
        skip = [r for r in e3 if r["sf_would_skip"]]
        live = [r for r in e3 if not r["sf_would_skip"]]
        tp = [r for r in e3 if r.get("tp_nodes") is not None]
        out["stop_rule"] = dict(
            cycles=n, would_skip=len(skip) / n,
            stop_level=_sum(live, "sf_stop_level") / len(live) if live else None,
            root_only_at_stop=sum(1 for r in live if not r["sf_nodes"]) / len(live) if live else None,
            stop_differs_from_full=sum(1 for r in live if tuple(r["sf_nodes"]) != tuple(r["full_nodes"]))
            / len(live) if live else None,
            fc_ratio_stop=sf_fc_ratio, fc_ratio_full=full_fc_ratio, fc_ratio_eagle=e_fc_ratio,
            sf_covered=len(covered) / n,
            sf_tokens_fc_over_real=_ratio(_sum(covered, "sf_fc_tokens"), _sum(covered, "sf_tokens")),
            eagle_tokens_when_sf_skips=_sum(skip, "tokens") / len(skip) if skip else None,
            eagle_tokens_when_sf_drafts=_sum(live, "tokens") / len(live) if live else None,
            sf_stop_tokens_real_when_covered=_sum(covered, "sf_tokens") / len(covered) if covered else None,
            eagle_tokens_when_covered=_sum(covered, "tokens") / len(covered) if covered else None,
            throughput_differs=sum(1 for r in tp if tuple(r["tp_nodes"]) != tuple(r["full_nodes"])) / len(tp)
            if tp else None,
            fc_ratio_throughput=_ratio(_sum(tp, "tp_fc_tokens"), _sum(tp, "tp_fc_seconds")) if tp else None)
    if "specfit" in out and "eagle3" in out:
        s, e = out["specfit"], out["eagle3"]
        real = _ratio(s["tok_s"] or 0.0, e["tok_s"] or 0.0)
        predicted = _ratio(out["stop_rule"]["fc_ratio_stop"] or 0.0, out["stop_rule"]["fc_ratio_eagle"] or 0.0)
        out["advantage"] = dict(
            predicted=predicted, realized=real,
            # each factor: how much the realized advantage differs from the predicted one through that term
            tokens_specfit=_ratio(1.0, s["tokens_fc_over_real"] or 0.0),
            tokens_eagle=e["tokens_fc_over_real"],
            seconds_specfit=s["seconds_fc_over_real"], seconds_eagle=_ratio(1.0, e["seconds_fc_over_real"] or 0.0))
    return out


def report(name: str, s: dict) -> str:
    """The summary of one cell as text."""
    f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [f"== {name}"]
    for kind, label in (("specfit", "SpecFit turns"), ("eagle3", "EAGLE-3 turns")):
        if kind not in s:
            continue
        k = s[kind]
        lines.append(f"  {label:14s} cycles {k['cycles']:4d} (skipped {k['skipped']}), nodes {f(k['nodes'])}, "
                     f"levels {f(k['levels'])}, tokens/cycle {f(k['tokens_per_cycle'])}, ms/cycle "
                     f"{f(k['ms_per_cycle'], 1)}, tok/s {f(k['tok_s'])} (forecast {f(k['fc_tok_s'])})")
        lines.append(f"  {'':14s} forecast/real: tokens {f(k['tokens_fc_over_real'])}, seconds "
                     f"{f(k['seconds_fc_over_real'])} (drafting {f(k['draft_fc_over_real'])}: {f(k['fc_draft_ms'], 1)}"
                     f" vs {f(k['draft_ms'], 1)} ms; the rest {f(k['verify_fc_over_real'])}), demand "
                     f"{f(k['demand_fc_over_real'])}, misses {f(k['misses_fc_over_real'])}")
    lines.append("  verify part, realized - forecast (ms) by nodes verified: " + ", ".join(
        f"{n}: {m:+.1f} ({c})" for n, (c, m) in s["verify_residual_ms_by_nodes"].items()))
    lines.append("  acceptance of verified nodes, predicted path value / accepted share, by (depth, rank 1|2+): " +
                 ", ".join(f"{d},{r}: {v['predicted']:.2f}/{v['accepted']:.2f} ({v['nodes']})"
                           for (d, r), v in s["acceptance_by_depth_rank"].items()))
    if "stop_rule" in s:
        t = s["stop_rule"]
        lines.append(f"  on EAGLE-3 turns: SpecFit would skip {f(t['would_skip'])} of cycles (EAGLE-3 then commits "
                     f"{f(t['eagle_tokens_when_sf_skips'])} tokens/cycle, else {f(t['eagle_tokens_when_sf_drafts'])});"
                     f" stop level {f(t['stop_level'])}, root only at the stop {f(t['root_only_at_stop'])}, stop "
                     f"winner != full-pool winner {f(t['stop_differs_from_full'])}")
        lines.append(f"  forecast tok/s: stop-rule winner {f(t['fc_ratio_stop'])}, full-pool winner "
                     f"{f(t['fc_ratio_full'])}, throughput pick {f(t['fc_ratio_throughput'])} (differs from the "
                     f"full-pool winner {f(t['throughput_differs'])}), EAGLE-3's tree {f(t['fc_ratio_eagle'])}")
        lines.append(f"  stop-rule winner inside EAGLE-3's tree {f(t['sf_covered'])}: its tokens forecast/real "
                     f"{f(t['sf_tokens_fc_over_real'])} ({f(t['sf_stop_tokens_real_when_covered'])} real vs "
                     f"EAGLE-3's {f(t['eagle_tokens_when_covered'])} on those cycles)")
    if "advantage" in s:
        a = s["advantage"]
        lines.append(f"  SpecFit / EAGLE-3 tok/s: predicted {f(a['predicted'])}, realized {f(a['realized'])}; factors "
                     f"(realized/predicted through each term): SpecFit tokens {f(a['tokens_specfit'])}, EAGLE-3 "
                     f"tokens {f(a['tokens_eagle'])}, SpecFit seconds {f(a['seconds_specfit'])}, EAGLE-3 seconds "
                     f"{f(a['seconds_eagle'])}")
    return "\n".join(lines)
