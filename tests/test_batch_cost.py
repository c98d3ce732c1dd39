"""The batch cost model (pure): its coefficients from a profile, its online refresh, and the batch probes' fit."""

import doctest
import random
from types import SimpleNamespace

import pytest

from specfit.evaluation import batch_probes
from specfit.selection import batch_cost, batch_refresh, prior_fit
from specfit.selection.batch_cost import FIXED, BatchCost
from specfit.selection.batch_refresh import BatchRefresh
from specfit.selection.cost_model import CostModel

PROFILE = CostModel((0.05, 0.06, 0.07, 0.08), 1e-5, draft_level_seconds=(0.004, 0.002), copy_overhead=1e-5,
                    link_share=1.0).priced(2e-4)


def test_the_modules_examples_hold():
    for module in (batch_cost, batch_refresh, prior_fit):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_a_calibrated_batch_section_wins_over_the_prior_and_experts_keep_the_profiles_prices():
    prior = BatchCost.of(PROFILE)
    assert prior == BatchCost.prior(PROFILE)
    # a root-only cycle of one row is the batch-1 profile's, drafting left out
    assert prior.fixed(1, 0) == pytest.approx(PROFILE.intercepts[0] - sum(PROFILE.draft_level_seconds))
    assert prior.per_node == pytest.approx(0.01) and prior.level + prior.level_row == pytest.approx(0.003)
    measured = {"base": 0.02, "per_row": 0.004, "per_node": 0.001, "level": 0.002, "level_row": 0.0005}
    calibrated = CostModel(PROFILE.intercepts, PROFILE.beta, {"batch": {**measured, "records": 40, "r2": 0.9}},
                           PROFILE.draft_level_seconds, copy_overhead=1e-5, link_share=1.0).priced(2e-4)
    cost = BatchCost.of(calibrated)
    assert [getattr(cost, n) for n in FIXED] == [measured[n] for n in FIXED]
    assert (cost.beta, cost.miss) == (calibrated.beta, calibrated.miss)
    assert BatchCost.of(PROFILE, batch=measured).per_row == 0.004  # given explicitly
    partial = {k: v for k, v in measured.items() if k != "level_row"}
    assert BatchCost.of(PROFILE, batch=partial) == prior  # an incomplete section is not used


def test_the_fixed_time_charges_a_level_once_for_every_row_and_a_row_level_per_row():
    c = BatchCost(base=1.0, per_row=0.1, per_node=0.01, level=0.5, level_row=0.05, beta=0.0, miss=0.0)
    assert c.fixed(4, 0) == pytest.approx(1.4)
    assert c.fixed(4, 10, levels=3, drafted=9) - c.fixed(4, 10) == pytest.approx(3 * 0.5 + 9 * 0.05)
    assert c.fixed(8, 0, 3, 24) - c.fixed(4, 0, 3, 12) == pytest.approx(4 * 0.1 + 12 * 0.05)  # levels: not per row
    table = c.tokens_table(rows=3, most_nodes=4, levels=2, drafted=5)
    assert len(table) == 3 + 4 and table[2] == pytest.approx(c.fixed(3, 0, 2, 5))  # t = 3 tokens: the roots
    assert table[-1] == pytest.approx(c.fixed(3, 4, 2, 5))
    with pytest.raises(ValueError, match="per_node must be a finite number >= 0"):
        BatchCost(1.0, 0.1, -0.01, 0.5, 0.05, 0.0, 0.0)


def test_the_refresh_follows_a_machine_that_slows_down():
    """Records of a machine 1.6x slower than the model: the refresh moves every coefficient the records do not
    reach by the same factor (the host scale), so even an unseen shape is forecast within 10%."""
    start = BatchCost(0.03, 0.01, 0.002, 0.004, 0.002, 1e-4, 2e-4)
    refresh = BatchRefresh(start)
    rng = random.Random(0)
    for _ in range(80):
        rows = rng.randint(2, 4)
        nodes = rng.randint(0, 12)
        levels = rng.randint(1, 4) if nodes else 0
        refresh.record(rows, nodes, levels, levels * rows, 1.6 * start.fixed(rows, nodes, levels, levels * rows))
    assert refresh.fit.scale == pytest.approx(1.6, rel=0.05)
    unseen = (8, 20, 5, 40)
    assert refresh.model.fixed(*unseen) / (1.6 * start.fixed(*unseen)) == pytest.approx(1.0, abs=0.1)
    assert refresh.cycles == 80 and (refresh.model.beta, refresh.model.miss) == (start.beta, start.miss)


def test_the_batch_probes_fit_recovers_the_fixed_time_beside_the_experts():
    """Records made from a known batch model plus experts at the batch-1 fit's prices (copies and host experts):
    the fit subtracts the experts and recovers the five coefficients."""
    truth = {"base": 0.03, "per_row": 0.006, "per_node": 0.0015, "level": 0.004, "level_row": 0.001}
    cost = CostModel((0.05,) * 8, 2e-5, copy_overhead=1e-5, link_share=1.0, host_overhead=0.0,
                     host_share=1.0).priced(3e-4, 1e-4, "auto")
    rng = random.Random(1)
    records = []
    for _ in range(40):
        rows, nodes, levels = rng.randint(2, 4), rng.randint(0, 20), rng.randint(1, 5)
        drafted = rng.randint(rows, rows * levels)
        demand, misses, host = rng.randint(100, 400), rng.randint(0, 50), rng.randint(0, 50)
        seconds = (truth["base"] + truth["per_row"] * rows + truth["per_node"] * nodes + truth["level"] * levels
                   + truth["level_row"] * drafted + cost.beta * demand + cost.copy * misses + cost.host * host)
        records.append(dict(rows=rows, nodes=nodes, levels=levels, drafted=drafted, demand=demand, misses=misses,
                            host=host, seconds=seconds))
    fit = batch_probes.fit_batch(records, cost)
    assert {k: round(fit[k], 6) for k in FIXED} == truth
    assert fit["records"] == 40 and fit["rows"] == [2, 3, 4] and fit["r2"] == pytest.approx(1.0)
    assert batch_probes.fit_batch(records[:9], cost) is None  # too few records: no section


def test_the_batch_probes_keep_each_cycles_fastest_repeat_of_the_cycles_that_replayed_alike():
    """Each probe batch runs twice: a cycle's record takes the faster repeat's clock (interference only adds time),
    less its measurement; a cycle whose repeats differ, or that ran one row, is left out."""
    import torch
    from transformers import GenerationConfig

    from specfit.stats.trace import CycleRecord

    def cycle(seconds, demand=40, rows=(2, 3), measurement=0.0):
        return CycleRecord(sum(rows), demand, seconds, 8, 3, 5, 0.01, measurement, None, 2, "specfit", rows, (2, 1))

    repeats = [[cycle(0.5, measurement=0.1), cycle(0.2), cycle(0.3, demand=41), cycle(0.1, rows=(2,))],
               [cycle(0.3, measurement=0.05), cycle(0.4), cycle(0.3, demand=44), cycle(0.1, rows=(2,))]]
    stats = SimpleNamespace(trace=None)
    calls = []

    def generate(ids, attention_mask, **kw):
        assert ids.shape == attention_mask.shape == (2, 3)  # the two prompts, left-padded
        stats.trace.extend(repeats[len(calls)])
        calls.append(kw["assistant"])

    runtime = SimpleNamespace(stats=stats, device="cpu", clear_cache=lambda: None)
    model = SimpleNamespace(specfit=runtime, generate=generate, generation_config=GenerationConfig(pad_token_id=0))
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]])]
    records = batch_probes.probe_batches(model, prompts, rows=(2,), repeats=2)
    assert len(calls) == 2 and stats.trace is None
    assert [r["seconds"] for r in records] == [pytest.approx(0.25), pytest.approx(0.2)]
    assert records[0] == dict(rows=2, nodes=5, levels=2, drafted=3, demand=40, misses=5, host=2,
                              seconds=records[0]["seconds"])
