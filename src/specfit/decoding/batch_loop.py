"""Tree decoding of a left-padded batch of prompts: every row drafts its own tree, one verify forward runs every
row's root + subtree, each row accepts its own path.

One cycle: (1) draft every active row's pool (each row's own drafter state), (2) select every row's subtree (EAGLE-3:
its top nodes; SpecFit: the batch rule, ``selection/batch_rule.py``, every row priced against the batch's expert
union), (3) verify all rows in one target forward (row b's tree at its own positions ``length_b + depth``, a
per-row tree mask, padding and holes masked), (4) accept per row, (5) keep each row's path in the KV cache (rows
keep different counts: the shorter rows' tails become masked holes, ``seam/batch_kv.py``), (6) commit per row
(stopping criteria per row) and feed each row's drafter; a finished row leaves the batch and costs nothing more.
Greedy output equals plain ``generate()`` on the same padded batch, row by row, token for token in fp32.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..drafting.tree import VerifyLayout, ancestor_matrix
from ..seam import batch_kv, kv_cache, layers as hf_layers
from ..selection.route_sources import Cycle
from ..transfer import to_host
from .acceptance import walk, walk_greedy
from .batch_rows import RowTrees, padded_sequences, pad_token
from .loop import _Run


@torch.no_grad()
def decode_batch(model, assistant, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                 **model_kwargs):
    runtime = model.specfit
    rows, prompt = input_ids.shape
    if streamer is not None:
        raise ValueError(f"a streamer takes one sequence (transformers' streamers support batch size 1), got a batch "
                         f"of {rows}; stream one prompt at a time")
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask  # [B, T]
    cache = model_kwargs["cache"]
    kv_cache.check_cache(cache)
    batch_kv.check_batch_cache(cache)
    do_sample = bool(generation_config.do_sample)
    runs = [_Run(input_ids[b:b + 1], logits_processor, stopping_criteria, generation_config, None, runtime.staging)
            for b in range(rows)]
    trees = RowTrees(model, assistant, rows)
    dtype, staging = hf_layers.compute_dtype(model), runtime.staging
    scope = runtime.stats.begin_generate()

    # 0. prefill, positions as plain generate() gives a left-padded batch
    positions = (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 1)  # [B, T]
    out = model(input_ids, cache=cache, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    features = runtime.aux_capture.features()  # [B, T, 3H]
    scope.prefill_done()
    lengths = mask.sum(1).tolist()  # real positions per row: the next root's position
    for b in range(rows):
        runs[b].commit(walk(lambda t: [], [], lambda t, acc: runs[b].scores(out.logits[b, -1], acc), do_sample,
                            runs[b].sample))
        if not runs[b].done:
            pad = prompt - lengths[b]
            nxt = torch.cat([input_ids[b:b + 1, pad + 1:], staging.to_device([[runs[b].tokens[-1]]])], dim=1)
            trees.start(b, features[b:b + 1, pad:], nxt)  # the row's own tokens, padding left out
    active = list(range(rows))  # the prompt row of each cache row
    valid = mask.bool()  # [B, kv] positions each row's queries see (padding and holes: False)
    kv = prompt
    active, valid = _leave(cache, runs, active, valid)

    while active:
        t0 = time.perf_counter()
        cycles = [Cycle(model, cache, base=kv, root=runs[b].tokens[-1], sampling=do_sample) for b in active]
        chosen = trees.draft_and_select(active, cycles)  # 1-2. draft every row, select every row's subtree
        t_drafted = time.perf_counter()
        q = 1 + max(len(nodes) for _, nodes in chosen)
        layouts, tokens, pos, anc = [], [], [], np.zeros((len(active), q, q), dtype=bool)
        for i, (b, (tree, nodes)) in enumerate(zip(active, chosen)):
            index = {v: j + 1 for j, v in enumerate(nodes)}
            parents = (-1,) + tuple(0 if tree.parents[v] < 0 else index[tree.parents[v]] for v in nodes)
            layouts.append(VerifyLayout(nodes, parents, None, None, None))
            row = [cycles[i].root] + [tree.tokens[v] for v in nodes]
            tokens.append(row + [pad_token(generation_config)] * (q - len(row)))
            depths = [0] + [tree.depths[v] for v in nodes]
            pos.append([lengths[b] + d for d in depths] + [lengths[b]] * (q - len(row)))
            anc[i, :len(row), :len(row)] = ancestor_matrix(parents).astype(bool)
            anc[i, range(len(row), q), range(len(row), q)] = True  # a padding query sees itself only
        tokens_d, pos_d, anc_d = staging.to_device(tokens, pos, anc)  # [B, q] each, [B, q, q]
        attention = batch_kv.batch_tree_mask(valid, anc_d.bool(), dtype)  # [B, 1, q, kv + q]
        out = model(tokens_d, cache=cache, position_ids=pos_d, attention_mask=attention, use_cache=True,
                    logits_to_keep=0)  # 3. verify every row
        verify = runtime.stats.last_forward
        choices = to_host(out.logits.argmax(-1))[0].tolist() if runs[0].plain_greedy else None  # [B][q]
        accs = []
        for i, b in enumerate(active):  # 4. accept, row by row
            run, children, row_tokens = runs[b], layouts[i].children, tokens[i]
            if choices is not None:
                acc = walk_greedy(children, row_tokens, choices[i], run.raw_scores(out.logits[i]))
            else:
                acc = walk(children, row_tokens, lambda t, a, i=i, run=run: run.scores(out.logits[i, t], a),
                           do_sample, run.sample)
            trees.gens[b].learn(chosen[i][0], layouts[i], acc, None if choices is None else choices[i], do_sample)
            accs.append(acc)
        kept = [[0] + acc.path for acc in accs]
        most = max(len(k) for k in kept)
        prefix = all(k == list(range(len(k))) for k in kept)  # every path a prefix of its layout: no entry moves
        if prefix:  # 5. keep every row's path; the rest become holes (a prefix needs only a crop)
            kv_cache.crop_kv(cache, kv + most, current=kv + q)
        else:
            keep_d = staging.to_device([k + [0] * (most - len(k)) for k in kept])  # [B, M]
            batch_kv.keep_rows_kv(cache, kv, keep_d)
        held = torch.arange(most, device=valid.device)[None] < torch.tensor([len(k) for k in kept])[:, None].to(
            valid.device)  # [B, M]
        valid, kv = torch.cat([valid, held], dim=1), kv + most
        features = runtime.aux_capture.features()  # [B, q, 3H]
        committed = []
        for i, b in enumerate(active):  # 6. commit and observe, row by row
            committed.append(runs[b].commit(accs[i]))
            lengths[b] += len(kept[i])
            if not runs[b].done:
                row = features[i:i + 1, :len(kept[i])] if prefix else \
                    features[i:i + 1].index_select(1, keep_d[i, :len(kept[i])])  # [1, m, 3H]
                trees.observe(b, row, staging.to_device([accs[i].tokens]))
        seconds = time.perf_counter() - t0
        counts = trees.timed(active, seconds, verify, committed)
        scope.cycle(pool=trees.pool, verified=sum(len(n) for _, n in chosen), committed=sum(committed),
                    demand=verify.demand, misses=verify.misses, seconds=seconds,
                    measurement=sum(c.measurement_seconds for c in cycles), draft_seconds=t_drafted - t0,
                    expected=trees.expected, predicted=trees.predicted, host=verify.host_experts, counts=counts,
                    way=trees.ways.way if trees.ways is not None else "", row_nodes=trees.row_nodes,
                    row_levels=trees.row_levels)
        active, valid = _leave(cache, runs, active, valid)

    scope.end(new_tokens=sum(run.length - prompt for run in runs))
    runtime.stats.last_rows = [run.length - prompt for run in runs]
    return padded_sequences(runs, generation_config, input_ids)


def _leave(cache, runs, active, valid):
    """Finished rows leave the batch (their cache rows dropped): they cost nothing more."""
    stay = [i for i, b in enumerate(active) if not runs[b].done]
    if len(stay) == len(active):
        return active, valid
    if stay:
        index = torch.tensor(stay, device=valid.device)
        batch_kv.drop_rows(cache, index)
        valid = valid.index_select(0, index)
    return [active[i] for i in stay], valid
