"""A batch's drafting in one drafter forward per step for every row: the rows' committed pairs (catch-up), then each
drafted level's frontier nodes, with one route-head call and one host transfer per level.

Every row keeps its own ``TreeDrafter`` (its drafter KV cache, tree and per-node records) and is drafted exactly as
``TreeDrafter.levels`` drafts it alone; only the forward is shared. For one forward the rows' drafter caches are
stacked ([R, nkv, S_max, D], each row's entries first, its tail masked), the rows' new positions padded to the
longest (a padding query sees itself only) and each row's new keys and values go back to its own cache. Each row's
generator decides after every level whether it drafts another (``level_drafted``): a row that stops leaves the
level loop, the others go on. Needs a drafter whose forward takes stacked rows (``Eagle3Drafter``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..drafting.drafter import DraftCache
from ..drafting.levels import TreeDrafter
from ..drafting.tree import DraftTree, ancestors_or_self
from ..transfer import Staging, to_host


def draft_rows(gens, cycles) -> list[DraftTree]:
    """Every row's pool this cycle (``gens``: the rows' tree generators, ``cycles``: their cycles), drafting in one
    drafter forward per step for all rows that draft. A row whose generator set its route head aside
    (``route_after``: SpecFit's way in a batch) drafts its levels as EAGLE-3 does, and its whole pool is routed after
    the levels, with the other such rows, in one more forward (``route_pools``)."""
    trees: list[DraftTree | None] = [gen.begin_draft(cycle) for gen, cycle in zip(gens, cycles)]
    rows = [r for r, tree in enumerate(trees) if tree is None]  # rows that draft levels now
    if rows:
        catch_up([gens[r] for r in rows])
        drafters = [gens[r].drafter for r in rows]
        drafted = dict(_levels(drafters, lambda i, tree: gens[rows[i]].level_drafted(tree, cycles[rows[i]])))
        later = [i for i in drafted if getattr(gens[rows[i]], "route_after", None) is not None]
        if later:
            route_pools([drafters[i] for i in later], gens[rows[later[0]]].route_after)
        for i, tree in drafted.items():
            trees[rows[i]] = gens[rows[i]].end_draft(tree)
    return trees


def route_pools(drafters: list[TreeDrafter], head) -> None:
    """Every node's and every root's routes by ``head`` (states [n, H] -> bool routes [n, L, E] on the device), for
    pools drafted without it: the nodes no level processed go through one drafter forward first (every row's at
    once), then one head call over all states and one transfer."""
    todo = [[v for v in range(len(d.tree)) if v not in d._out] for d in drafters]
    if any(todo):
        _process(drafters, todo)
    sizes = [len(d.tree) for d in drafters]
    states = [torch.stack([d.root_state for d in drafters])]  # [R, H]
    states += [torch.stack([d._out[v][1] for v in range(n)]) for d, n in zip(drafters, sizes) if n]  # [n, H] each
    routes, = to_host(head(torch.cat(states)))  # [R + sum n, L, E] host
    start = len(drafters)
    for r, (d, n) in enumerate(zip(drafters, sizes)):
        d.keep_routes(list(range(n)), routes[start:start + n], routes[r])
        start += n


def catch_up(gens) -> None:
    """The committed pairs every row's drafter has not read yet, in one forward (causal within each row)."""
    todo = [gen for gen in gens if gen._pending]
    if not todo:
        return
    pairs = []
    for gen in todo:
        pairs.append((torch.cat([f for f, _ in gen._pending], dim=1)[0], torch.cat([t for _, t in gen._pending],
                                                                                 dim=1)[0]))  # [m, 3H], [m]
        gen._pending.clear()
    drafters = [gen.drafter for gen in todo]
    for d in drafters:
        d.cache.crop(d.stable)
    m = [t.shape[0] for _, t in pairs]
    most, width = max(m), max(d.stable for d in drafters)
    allow = np.zeros((len(todo), most, width + most), dtype=bool)  # [R, m, S + m]
    for r, (d, n) in enumerate(zip(drafters, m)):
        allow[r, :, :d.stable] = True
        allow[r, :n, width:width + n] = np.tril(np.ones((n, n), dtype=bool))
        allow[r, range(n, most), range(width + n, width + most)] = True  # padding sees itself only
    positions = [[d.stable + j for j in range(most)] for d in drafters]
    features = torch.stack([F.pad(f, (0, 0, 0, most - f.shape[0])) for f, _ in pairs])  # [R, m, 3H]
    tokens = torch.stack([F.pad(t, (0, most - t.shape[0])) for _, t in pairs])  # [R, m]
    logits, hidden = _forward(drafters, tokens, features, positions, allow, m)
    for r, (d, n) in enumerate(zip(drafters, m)):
        d.stable += n
        d.root_logits, d.root_state = logits[r, n - 1], hidden[r, n - 1]


def _levels(drafters: list[TreeDrafter], go_on):
    """Draft every row's tree level by level as ``TreeDrafter.levels`` does; ``go_on(i, tree)`` after each level
    drafted for row i (False: row i stops). Yields (i, tree) once per row when its drafting ends."""
    first_d = drafters[0]
    topk, depth, max_pool, head = first_d.topk, first_d.depth, first_d.max_pool, first_d.route_head
    for d in drafters:
        d.begin_cycle()
    # level 1: every row's root children, processed from the device's top-k before their tokens reach the host
    q, ids = first_d._topk(torch.stack([d.root_logits for d in drafters]))  # [R, k] each
    first = min(topk, max_pool)
    for d in drafters:
        for rank in range(1, first + 1):
            d._drafted_by[d.tree.add(-1, -1, 0.0, rank, 0.0)] = d.root_state
    process = [list(range(first)) if head is not None or depth > 1 else [] for _ in drafters]
    roots = torch.stack([d.root_state for d in drafters])  # [R, H]
    host = _process(drafters, process, ids[:, :first], pull=[q, ids], head_roots=roots if head is not None else None)
    root_q, root_ids = host[0].tolist(), host[1].tolist()
    for r, d in enumerate(drafters):
        for v in range(first):
            d.tree.tokens[v] = int(root_ids[r][v])
            d.tree.path_probs[v] = d.tree.qs[v] = float(root_q[r][v])
    going = []
    for i in range(len(drafters)):
        if go_on(i, drafters[i].tree):
            going.append(i)
        else:
            yield i, drafters[i].tree
    for level in range(2, depth + 1):
        rows, process = [], []
        for i in going:
            d = drafters[i]
            tree = d.tree
            frontier = sorted(tree.level(level - 1), key=lambda v: -tree.path_probs[v])[:topk]
            if not frontier or len(tree) >= max_pool:
                yield i, tree
                continue
            added = d._add_children(frontier)
            if head is not None:
                nodes = added
            elif level < depth:  # only the nodes the next level expands
                nodes = sorted(added, key=lambda v: -tree.path_probs[v])[:topk]
            else:
                nodes = []
            rows.append(i)
            process.append(nodes)
        if any(process):
            busy = [k for k, nodes in enumerate(process) if nodes]
            _process([drafters[rows[k]] for k in busy], [process[k] for k in busy])
        going = []
        for i in rows:
            if go_on(i, drafters[i].tree) and level < depth:
                going.append(i)
            else:
                yield i, drafters[i].tree
    for i in going:  # rows still going when the depth ran out
        yield i, drafters[i].tree


def _process(drafters, process, ids=None, pull=(), head_roots=None) -> list[np.ndarray]:
    """One drafter forward over every row's ``process`` nodes (tokens: ``ids`` [R, n] on the device, else the
    trees'), then one transfer to the host of ``pull``, every node's top-k children and, with a route head, the
    routes of ``head_roots`` [R, H] (the rows' roots, at level 1) and of the nodes. Records children and routes per
    row; returns the host copies of ``pull``."""
    pull = list(pull)
    n = [len(nodes) for nodes in process]
    most = max(n)
    head = drafters[0].route_head
    states = None
    if most:
        width = max(len(d.cache) for d in drafters)
        allow = np.zeros((len(drafters), most, width + most), dtype=bool)  # [R, n, S + n]
        positions, hidden = [], []
        for r, (d, nodes) in enumerate(zip(drafters, process)):
            s, tree = len(d.cache), d.tree
            for j, v in enumerate(nodes):
                d._slot[v] = s + j
            allow[r, :, :d.stable] = True
            for j, v in enumerate(nodes):  # ancestors are all processed: a node is drafted by processing its parent
                for a in ancestors_or_self(tree.parents, v):
                    slot = d._slot[a]
                    allow[r, j, slot if slot < s else width + slot - s] = True
            allow[r, range(len(nodes), most), range(width + len(nodes), width + most)] = True  # padding: itself
            positions.append([d.stable + tree.depths[v] - 1 for v in nodes] + [d.stable] * (most - len(nodes)))
            hidden += [d._drafted_by[v] for v in nodes] + [d.root_state] * (most - len(nodes))
        if ids is None:
            ids = _staging(drafters[0]).to_device([[d.tree.tokens[v] for v in nodes] + [0] * (most - len(nodes))
                                                  for d, nodes in zip(drafters, process)])  # [R, n]
        hidden = torch.stack(hidden).view(len(drafters), most, -1)  # [R, n, H]
        logits, states = _forward(drafters, ids, hidden, positions, allow, n)  # [R, n, Vd], [R, n, H]
        for r, (d, nodes) in enumerate(zip(drafters, process)):
            for j, v in enumerate(nodes):
                d._out[v] = (logits[r, j], states[r, j])
        pull += list(drafters[0]._topk(logits.reshape(-1, logits.shape[-1])))  # [R * n, k] each
    head_in = ([head_roots] if head_roots is not None else []) + ([states.reshape(-1, states.shape[-1])]
                                                                  if states is not None else [])
    if head is not None and head_in:
        pull.append(head(torch.cat(head_in)))  # [(R +) R * n, L, E]
    host = to_host(*pull) if pull else []
    given = len(host) - (2 if most else 0) - (1 if head is not None and head_in else 0)
    rest = host[given:]
    if most:
        qs, tokens = rest[0].tolist(), rest[1].tolist()
        for r, (d, nodes) in enumerate(zip(drafters, process)):
            for j, v in enumerate(nodes):
                d._children[v] = (qs[r * most + j], tokens[r * most + j])
    if head is not None and head_in:
        routes = rest[-1]  # [(R +) R * n, L, E] host
        offset = len(drafters) if head_roots is not None else 0
        for r, (d, nodes) in enumerate(zip(drafters, process)):
            start = offset + r * most
            d.keep_routes(nodes, routes[start:start + len(nodes)], routes[r] if head_roots is not None else None)
    return list(host[:given])


def _forward(drafters, ids, hidden, positions, allow, n):
    """One drafter forward over the rows' new positions (``ids`` [R, t] device, ``hidden`` [R, t, W], ``positions``
    [R][t] host, ``allow`` [R, t, S + t] host bool: what each new position attends, S the longest row cache), with
    the rows' caches stacked; row r's first ``n[r]`` new keys/values go to its own cache. Returns (logits [R, t, Vd],
    states [R, t, H])."""
    module = drafters[0].drafter
    c = module.config
    dtype = module.fc.weight.dtype
    lengths = [len(d.cache) for d in drafters]
    width = max(lengths)
    stacked = DraftCache()
    if width:
        keys, values = [], []
        for d, s in zip(drafters, lengths):
            if s:
                keys.append(F.pad(d.cache.keys[0], (0, 0, 0, width - s)))  # [nkv, S, D]
                values.append(F.pad(d.cache.values[0], (0, 0, 0, width - s)))
            else:
                keys.append(hidden.new_zeros(c.num_key_value_heads, width, c.head_dim, dtype=dtype))
                values.append(keys[-1])
        stacked.keys, stacked.values = torch.stack(keys), torch.stack(values)  # [R, nkv, S, D]
    allow_d, positions_d = _staging(drafters[0]).to_device(allow, positions)  # [R, t, S + t], [R, t]
    mask = torch.zeros(allow.shape, dtype=dtype, device=allow_d.device).masked_fill_(allow_d == 0,
                                                                                    torch.finfo(dtype).min)
    logits, states = module(ids, hidden, positions_d, cache=stacked, attention_mask=mask[:, None])
    new_k, new_v = stacked.keys[:, :, width:], stacked.values[:, :, width:]  # [R, nkv, t, D]
    for r, (d, m) in enumerate(zip(drafters, n)):
        if m:
            d.cache.append(new_k[r:r + 1, :, :m], new_v[r:r + 1, :, :m])
    return logits, states


_STAGING: dict = {}  # device -> Staging: one per device, as each TreeDrafter keeps its own


def _staging(drafter: TreeDrafter) -> Staging:
    device = drafter.drafter.fc.weight.device
    staging = _STAGING.get(device)
    if staging is None:
        staging = _STAGING[device] = Staging(device)
    return staging
