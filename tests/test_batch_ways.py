"""A batch of SpecFit rows runs every cycle one of three ways (SpecFit's, EAGLE-3's, plain), chosen by a guard per
number of rows in flight and priced by the batch cost model: what users see in the output, the counters, the trace and
the forecasts."""

import time

import pytest
import torch
from conftest import tiny_moe
from test_batch_decoding import padded_batch

import specfit
from specfit.decoding import batch_rows
from specfit.decoding.guard import Guard
from specfit.decoding.specfit_generator import SpecFitGenerator
from specfit.selection.batch_cost import BatchCost
from specfit.selection.cost_model import CostModel

COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)


def drafter_for(model, seed=1):
    from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter

    torch.manual_seed(seed)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return Eagle3Drafter(Eagle3Config.from_target(model.config, draft_vocab_size=vocab, intermediate_size=32))


def enabled(**kw):
    model = tiny_moe()
    kw.setdefault("cost_model", COST)
    return specfit.enable(model, cache_slots=4, drafter=drafter_for(model), route_source="gate", **kw)


def expected_output(ids, mask, tokens, **kw):
    return tiny_moe().generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, **kw)


def test_every_batch_cycle_is_learned_under_the_way_it_ran():
    """A guard that explores often: every way runs, the output is plain generate()'s, and the guard of the rows in
    flight counted exactly the cycles the stats and the trace give each way."""
    ids, mask = padded_batch()
    model = enabled()
    runtime = model.specfit
    guard = Guard(warmup=2, trials=2, spread=5.0, budget=1.0)
    runtime.batch_guards = (runtime.options, {3: guard})
    runtime.stats.start_trace()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant="specfit")
    assert torch.equal(out, expected_output(ids, mask, 16))
    g, trace = runtime.stats.last_generate, runtime.stats.trace
    ways = {way: sum(r.way == way for r in trace) for way in ("specfit", "eagle3", "plain")}
    assert g.ways == ways == guard.cycles and all(ways.values()) and sum(ways.values()) == g.cycles
    for r in trace:
        assert len(r.row_nodes) == 3 and r.n_nodes == sum(r.row_nodes)  # every row in flight, nodes summed
        if r.way == "plain":
            assert r.pool == 0 and r.n_nodes == 0 and r.row_levels == (0, 0, 0)  # nothing drafted
        if r.way == "eagle3":
            assert r.row_nodes == (7, 7, 7)  # EAGLE-3's tree in every row
    assert g.nodes_verified == sum(r.n_nodes for r in trace)
    assert g.forecast_cycles == g.cycles  # every way forecast
    assert runtime.guard is None or not any(runtime.guard[1].cycles.values())  # batch 1's guard learned nothing


def slowed_drafting(monkeypatch, seconds):
    original = batch_rows.draft_rows

    def slow(gens, cycles):
        time.sleep(seconds)
        return original(gens, cycles)
    monkeypatch.setattr(batch_rows, "draft_rows", slow)


def test_the_batch_guard_runs_the_fastest_way_within_its_budget(monkeypatch):
    """Drafting made 0.2 s slower per cycle: after the warm-up and the trials, plain batch steps win, and the slower
    ways take at most the budget of the wall clock."""
    slowed_drafting(monkeypatch, 0.2)
    ids, mask = padded_batch()
    model = enabled()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant="specfit")
    assert torch.equal(out, expected_output(ids, mask, 40))
    guard = model.specfit.batch_guards[1][3]
    g = model.specfit.stats.last_generate
    assert guard.best() == "plain" and g.ways["plain"] >= g.cycles - 4 - 2 - 2 - 2
    # exploration after the trials stays within the budget (one cycle's overshoot allowed)
    assert guard.explored_seconds <= guard.budget * guard.seconds + 0.3


def test_a_batch_of_three_is_not_a_batch_of_one():
    """Rows that finish move the batch to the guard of its new size; batch-1 calls keep their own guard."""
    ids, mask = padded_batch()
    free = expected_output(ids, mask, 14)
    eos = int(free[1, ids.shape[1] + 3])  # row 1 ends at its 4th new token
    model = enabled()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, assistant="specfit")
    assert torch.equal(out, expected_output(ids, mask, 14, eos_token_id=eos, pad_token_id=0))
    guards = model.specfit.batch_guards[1]
    assert 3 in guards and min(guards) < 3  # a guard per rows in flight
    total = sum(sum(g.cycles.values()) for g in guards.values())
    assert total == model.specfit.stats.last_generate.cycles
    model.generate(ids[:1, mask[0].bool()], max_new_tokens=6, do_sample=False, assistant="specfit")
    assert sum(model.specfit.guard[1].cycles.values()) == model.specfit.stats.last_generate.cycles  # its own guard
    assert 1 not in guards or sum(guards[1].cycles.values()) < total  # ... not the batch's guard of one row


def test_a_guard_for_a_new_size_starts_from_what_the_nearest_size_learned():
    """A row that leaves after the guard of three rows has compared the ways: the guard of two rows starts from that
    comparison (no warm-up, no trials of its own) and learns on from its own clock."""
    ids, mask = padded_batch()
    free = expected_output(ids, mask, 30)[:, ids.shape[1]:]  # the new tokens
    # row 1 ends at a token first seen late in it (after the first guard is warm) and not soon in the other rows
    eos = next(int(free[1, k]) for k in range(12, 28) if int(free[1, k]) not in free[1, :k].tolist()
               and int(free[1, k]) not in free[0, :k + 4].tolist() + free[2, :k + 4].tolist())
    model = enabled()
    model.specfit.stats.start_trace()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, assistant="specfit")
    assert torch.equal(out, expected_output(ids, mask, 30, eos_token_id=eos, pad_token_id=0))
    guards = model.specfit.batch_guards[1]
    assert guards[3].best() is not None and 2 in guards
    two = guards[2]
    assert two.warmed and two.best() is not None
    first_of_two = next(r for r in model.specfit.stats.trace if len(r.row_nodes) == 2)
    assert first_of_two.way == guards[3].best()  # the way three rows found best, from its first cycle


def test_configure_gives_the_next_call_fresh_guards():
    """New options, new guards: the batch's and batch 1's, each counting the next call's cycles only."""
    ids, mask = padded_batch()
    model = enabled()
    row = ids[2:, mask[2].bool()]
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant="specfit")
    model.generate(row, max_new_tokens=8, do_sample=False, assistant="specfit")
    batch_guard, single = model.specfit.batch_guards[1][3], model.specfit.guard[1]
    specfit.configure(model, max_nodes=6)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant="specfit")
    fresh = model.specfit.batch_guards[1][3]
    assert fresh is not batch_guard and sum(fresh.cycles.values()) == model.specfit.stats.last_generate.cycles
    model.generate(row, max_new_tokens=8, do_sample=False, assistant="specfit")
    assert model.specfit.guard[1] is not single
    assert sum(model.specfit.guard[1].cycles.values()) == model.specfit.stats.last_generate.cycles


def test_a_batch_starts_no_prefetch_of_rows_own_winners():
    """prefetch=True prefetches at batch 1; in a batch the rows' own winners are not what it verifies: none."""
    ids, mask = padded_batch()
    model = enabled(prefetch=True, guard=False)
    model.generate(ids[2:, mask[2].bool()], max_new_tokens=12, do_sample=False, assistant="specfit")
    assert model.specfit.stats.last_generate.prefetch_copies > 0  # the option works at batch 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant="specfit")
    assert torch.equal(out, expected_output(ids, mask, 12))
    assert model.specfit.stats.last_generate.prefetch_copies == 0


class Way(SpecFitGenerator):
    """A SpecFit row whose batch runs one way every cycle (as calibrate's batch probes do)."""
    batch_way = "plain"


@pytest.mark.parametrize("cold", ["copy", "host"])
def test_a_plain_batch_step_is_forecast_at_its_fixed_time_plus_the_last_steps_experts(cold):
    """Every cycle plain: the forecast is the batch model's fixed time for the rows in flight, plus the demand and
    cold experts per token of the last plain step (copied, or computed on the host lane), priced at the rows' beta
    and miss."""
    from specfit.offload.host_lane import HostConfig

    ids, mask = padded_batch()
    lane = dict(host=HostConfig(bandwidth=2e9), cost_model=CostModel(COST.intercepts, COST.beta, copy_overhead=0.008,
                                                                      link_share=1.0, host_overhead=0.003,
                                                                      host_share=1.0))
    model = enabled(guard=False, cold=cold, **(lane if cold == "host" else {}))
    model.specfit.stats.start_trace()
    Way.batch_way = "plain"
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant=Way)
    assert torch.equal(out, expected_output(ids, mask, 10))
    rows_cost = SpecFitGenerator(model).cost
    cost = BatchCost.of(rows_cost)
    trace = model.specfit.stats.trace
    assert all(r.way == "plain" and r.pool == 0 for r in trace)
    assert any(r.host_experts for r in trace) == (cold == "host")
    for before, r in zip(trace, trace[1:]):
        per_row = before.demand / 3, (before.misses + before.host_experts) / 3
        want = cost.fixed(3, 0) + rows_cost.beta * per_row[0] * 3 + rows_cost.miss * per_row[1] * 3
        assert r.predicted_seconds == pytest.approx(want, rel=1e-9)


def test_specfits_way_prices_one_drafter_forward_per_level_not_per_row(monkeypatch):
    """The batch rule is given the batch model's fixed time by tokens: per forward, per row, per node, one drafted
    level for all rows (``level``) and each row's own levels (``level_row``), nothing per row per level beyond that;
    the cycle's forecast is the rule's own."""
    seen = []
    original = batch_rows.select_batch

    def record(pools, intercepts, beta, miss, resident):
        pick = original(pools, intercepts, beta, miss, resident)
        seen.append((len(pools), list(intercepts), beta, miss, pick))
        return pick
    monkeypatch.setattr(batch_rows, "select_batch", record)
    ids, mask = padded_batch()
    model = enabled(guard=False)
    model.specfit.stats.start_trace()
    model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant="specfit")
    rows_cost = SpecFitGenerator(model).cost
    cost = BatchCost.of(rows_cost)
    drafted = [r for r in model.specfit.stats.trace if r.pool]
    assert len(drafted) == len(seen) > 0
    for r, (rows, table, beta, miss, pick) in zip(drafted, seen):
        levels, row_levels = max(r.row_levels), sum(r.row_levels)
        most = len(table) - rows  # the nodes the rows' pools can give
        assert most <= 7 * rows and table == [pytest.approx(x) for x in cost.tokens_table(rows, most, levels,
                                                                                         row_levels)]
        assert table[rows - 1] == pytest.approx(cost.base + cost.per_row * rows + cost.level * levels
                                                + cost.level_row * row_levels)
        assert (beta, miss) == (rows_cost.beta, rows_cost.miss)
        assert r.predicted_seconds == pick.predicted_time and r.row_nodes == tuple(len(n) for n in pick.nodes)


def test_calibrated_batch_nodes_are_valued_as_batch_one_values_them(monkeypatch):
    """Two copies of one prompt as a batch: in the first cycle each row's pool is the batch-1 pool, and the batch rule
    values its nodes with the path values of the acceptance model the batch-1 selector uses (not the draft's path
    probabilities)."""
    from specfit.decoding import specfit_generator

    single, batch, probs = [], [], []
    real_select = specfit_generator.select_subtree

    def select(parents, values, *args, **kw):
        single.append(list(values))
        return real_select(parents, values, *args, **kw)
    monkeypatch.setattr(specfit_generator, "select_subtree", select)
    real_batch = batch_rows.select_batch

    def select_batch(pools, *args, **kw):
        batch.append([list(p.values) for p in pools])
        return real_batch(pools, *args, **kw)
    monkeypatch.setattr(batch_rows, "select_batch", select_batch)
    real_end = SpecFitGenerator.end_draft
    monkeypatch.setattr(SpecFitGenerator, "end_draft", lambda self, tree: probs.append(list(tree.path_probs))
                        or real_end(self, tree))
    ids, _ = padded_batch(lengths=(9,))
    model = enabled(guard=False)
    assert model.specfit.options.acceptance == "calibrated"
    model.generate(ids, max_new_tokens=3, do_sample=False, assistant="specfit")
    alone = single[:]
    enabled(guard=False).generate(ids.repeat(2, 1), attention_mask=torch.ones(2, 9, dtype=torch.long),
                                  max_new_tokens=3, do_sample=False, assistant="specfit")
    first = batch[0]
    b1 = alone[0]  # batch 1's first cycle: the values of its pool after its last drafted level
    for values in alone[1:]:
        if len(values) <= len(b1):
            break
        b1 = values
    # the rows draft deeper in a batch (levels are cheap there); the levels both drafted are valued alike
    assert len(first[0]) >= len(b1) > 0
    assert first[0][:len(b1)] == pytest.approx(b1) and first[1][:len(b1)] == pytest.approx(b1)
    assert first[0] != pytest.approx(probs[0])  # path values, not the draft's path probabilities


@pytest.mark.parametrize("case", ["sliding", "logits", "return_sequences"])
def test_batches_refused_before_any_forward(case):
    """Refused before the prefill: a sliding-window cache (GPT-OSS), output_logits=True, and one prompt made two rows
    by num_return_sequences=2 meets the same refusals."""
    from families import tiny

    ids, mask = padded_batch()
    if case == "sliding":
        model = tiny("gpt_oss")
        ids, mask = ids % 128, mask
        specfit.enable(model, cache_slots=2, drafter=drafter_for(model), cost_model=COST, topk=2, depth=3,
                       pool_nodes=8, max_nodes=5)
        kw, message = {}, "dynamic cache of full-attention layers"
    elif case == "logits":
        model = enabled()
        kw, message = dict(output_logits=True, return_dict_in_generate=True), "output_logits"
    else:
        model = enabled()
        ids, mask = ids[2:], mask[2:]
        kw, message = dict(num_return_sequences=2, do_sample=True, output_scores=True, return_dict_in_generate=True), \
            "2 rows does not return output_scores"
    kw.setdefault("do_sample", False)
    forwards = model.specfit.stats.total.forwards
    with pytest.raises(ValueError, match=message):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, assistant="specfit", **kw)
    assert model.specfit.stats.total.forwards == forwards


LEVELED = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                    link_share=1.0, draft_level_seconds=(0.05, 0.04, 0.04, 0.04, 0.04),
                    meta={"batch": {"base": 0.3, "per_row": 0.05, "per_node": 0.02, "level": 0.03,
                                    "level_row": 0.007}})


def test_eagle3s_way_is_forecast_by_its_last_cycles_experts_per_token_verified():
    """Every cycle EAGLE-3's way: the forecast is the batch model's fixed time at its nodes and levels, plus the
    demand and cold experts per token verified (roots and nodes) of the last such cycle."""
    ids, mask = padded_batch()
    model = enabled(guard=False)
    model.specfit.stats.start_trace()
    Way.batch_way = "eagle3"
    model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant=Way)
    Way.batch_way = "plain"
    rows_cost = SpecFitGenerator(model).cost
    cost = BatchCost.of(rows_cost)
    trace = model.specfit.stats.trace
    assert all(r.way == "eagle3" for r in trace)
    for before, r in zip(trace, trace[1:]):
        rows, tokens = len(r.row_nodes), len(r.row_nodes) + r.n_nodes
        seen = before.demand / (len(before.row_nodes) + before.n_nodes), \
            (before.misses + before.host_experts) / (len(before.row_nodes) + before.n_nodes)
        want = cost.fixed(rows, r.n_nodes, max(r.row_levels), sum(r.row_levels)) + \
            rows_cost.beta * seen[0] * tokens + rows_cost.miss * seen[1] * tokens
        assert r.predicted_seconds == pytest.approx(want, rel=1e-9)


def test_a_row_drafts_one_level_deeper_than_the_batch_last_took_from_it(monkeypatch):
    """SpecFit's way in a batch: a row's first cycle drafts the full depth; each next one drafts one level deeper
    than the deepest node the batch rule took from it (at least one level), every row by its own depth."""
    picks = []
    original = batch_rows.select_batch

    def record(pools, *args):
        pick = original(pools, *args)
        depths = []
        for pool, nodes in zip(pools, pick.nodes):
            d = [0] * len(pool.parents)
            for v, p in enumerate(pool.parents):
                d[v] = 1 if p < 0 else d[p] + 1
            depths.append(max((d[v] for v in nodes), default=0))
        picks.append(depths)
        return pick
    monkeypatch.setattr(batch_rows, "select_batch", record)
    ids, mask = padded_batch()
    model = enabled(guard=False, cost_model=LEVELED)
    model.specfit.stats.start_trace()
    model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant="specfit")
    trace = [r for r in model.specfit.stats.trace if r.pool]  # the cycles the batch rule priced, as picks
    assert len(trace) == len(picks) and trace[0].row_levels == (5, 5, 5)
    history = {k: [] for k in range(3)}  # per row: (levels drafted, deepest node taken) of its drafted cycles
    for r, taken in zip(trace, picks):
        if len(r.row_levels) != 3:  # a row left: the rows' places in flight change
            break
        for k in range(3):
            if r.row_levels[k]:
                history[k].append((r.row_levels[k], taken[k]))
    pairs = [(before, after) for h in history.values() for before, after in zip(h, h[1:])]
    assert len(pairs) >= 3
    for (_, deepest), (levels, _) in pairs:
        assert levels == max(1, min(5, 1 + deepest))


def test_specfits_way_charges_its_levels_once_and_its_row_levels_per_row(monkeypatch):
    """With a calibrated batch section whose level and row-level prices differ, the rule's fixed time charges
    ``level`` per level drafted (the deepest row's) and ``level_row`` per level each row drafted."""
    seen = []
    original = batch_rows.select_batch

    def record(pools, intercepts, *args):
        seen.append((len(pools), list(intercepts)))
        return original(pools, intercepts, *args)
    monkeypatch.setattr(batch_rows, "select_batch", record)
    ids, mask = padded_batch()
    model = enabled(guard=False, cost_model=LEVELED, cost_refresh=False)
    model.specfit.stats.start_trace()
    model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant="specfit")
    drafted = [r for r in model.specfit.stats.trace if r.pool]
    assert len(drafted) == len(seen) > 0 and any(len(set(r.row_levels)) > 1 for r in drafted)
    b = LEVELED.meta["batch"]
    for r, (rows, table) in zip(drafted, seen):
        want = b["base"] + b["per_row"] * rows + b["level"] * max(r.row_levels) + b["level_row"] * sum(r.row_levels)
        assert table[rows - 1] == pytest.approx(want)


def test_rows_left_plain_inside_specfits_way_are_counted_as_they_ran():
    """plain_row_cycles counts exactly the rows of SpecFit-way cycles that drafted nothing (their backoff)."""
    ids, mask = padded_batch()
    steep = CostModel(intercepts=(1.0,) + tuple(50.0 * k for k in range(1, 8)), beta=0.002, copy_overhead=0.008,
                      link_share=1.0)
    model = enabled(guard=False, cost_model=steep)
    model.specfit.stats.start_trace()
    model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant="specfit")
    trace = model.specfit.stats.trace
    idle_rows = sum(r.row_levels.count(0) for r in trace if r.way == "specfit")
    assert 0 < model.specfit.stats.last_generate.plain_row_cycles == idle_rows < 3 * len(trace)


def test_plain_steps_teach_both_drafted_ways_and_a_way_teaches_its_own(monkeypatch):
    """The batch refresh: a plain step's clock refits the fixed time of SpecFit's way and of EAGLE-3's; an EAGLE-3
    cycle refits EAGLE-3's alone."""
    ids, mask = padded_batch()
    model = enabled(guard=False, cost_model=LEVELED)
    Way.batch_way = "plain"
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, assistant=Way)
    refresh = model.specfit.batch_refresh[1]
    plain = model.specfit.stats.last_generate.cycles
    assert refresh["specfit"].cycles == refresh["eagle3"].cycles == plain
    Way.batch_way = "eagle3"
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, assistant=Way)
    Way.batch_way = "plain"
    eagle = model.specfit.stats.last_generate.cycles
    assert refresh["specfit"].cycles == plain and refresh["eagle3"].cycles == plain + eagle
    specfit.configure(model, depth=3)  # another depth drafts other levels: its batch refresh starts again
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, assistant=Way)
    fresh = model.specfit.batch_refresh[1]
    plain = model.specfit.stats.last_generate.cycles
    assert fresh["specfit"] is not refresh["specfit"] and fresh["specfit"].cycles == fresh["eagle3"].cycles == plain


def test_a_batch_rows_pool_is_routed_as_its_pool_alone(monkeypatch):
    """The pools drafted together are routed after their levels in one forward: each row's routes (nodes and
    root) equal the routes of the same pool drafted alone."""
    from specfit.decoding import batch_drafting

    routed = []
    original = batch_drafting.route_pools

    def record(drafters, head):
        original(drafters, head)
        routed.append([(d.stable, d.routes()) for d in drafters])
    monkeypatch.setattr(batch_drafting, "route_pools", record)
    ids, mask = padded_batch()
    model = enabled(guard=False)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, assistant="specfit")
    first = {stable: routes for stable, routes in routed[0]}
    for b in range(3):
        tokens = int(mask[b].sum())
        alone = enabled(guard=False)
        seen = []
        from specfit.decoding.specfit_generator import SpecFitGenerator as Gen
        real = Gen.end_draft
        monkeypatch.setattr(Gen, "end_draft", lambda self, tree: seen.append(self.drafter.routes()) or
                            real(self, tree))
        alone.generate(ids[b:b + 1, mask[b].bool()], max_new_tokens=2, do_sample=False, assistant="specfit")
        monkeypatch.setattr(Gen, "end_draft", real)
        nodes, root = seen[0]
        together_nodes, together_root = first[tokens]
        assert (together_root == root).all()
        assert (together_nodes[:len(nodes)] == nodes).all(), f"row {b}"


def test_a_batch_expects_the_tokens_its_rows_expect_alone():
    """EAGLE-3's batch of two copies of one prompt: a cycle expects what each row expects (1 + its verified nodes'
    path probabilities) summed over the rows, so expected_over_committed reads as at batch 1."""
    ids, _ = padded_batch(lengths=(9,))
    model = enabled()
    model.generate(ids, max_new_tokens=8, do_sample=False, assistant="eagle3")
    alone = model.specfit.stats.last_generate
    cycles, committed, expected = alone.cycles, alone.tokens_committed, alone.expected_tokens
    out = model.generate(ids.repeat(2, 1), attention_mask=torch.ones(2, 9, dtype=torch.long), max_new_tokens=8,
                         do_sample=False, assistant="eagle3")
    g = model.specfit.stats.last_generate
    assert torch.equal(out[0], out[1]) and g.cycles == cycles and g.tokens_committed == 2 * committed
    assert expected > cycles and g.expected_tokens == pytest.approx(2 * expected, rel=1e-4)


def test_plain_and_speculative_batches_count_the_same_new_tokens():
    """A row that stops early at its end token: plain generate() fills it with padding, which is no token a user
    reads; the stats count every method's rows through their end token, so their tok/s compare like with like."""
    ids, mask = padded_batch()
    free = expected_output(ids, mask, 14)
    eos = int(free[1, ids.shape[1] + 3])
    model = enabled()
    counts = {}
    for assistant in (None, "eagle3", "specfit"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, assistant=assistant)
        counts[assistant] = model.specfit.stats.last_generate.new_tokens
    new = out[:, ids.shape[1]:].tolist()
    real = sum(next((i + 1 for i, t in enumerate(row) if t == eos), len(row)) for row in new)
    assert real < 3 * 14 and counts == {None: real, "eagle3": real, "specfit": real}
