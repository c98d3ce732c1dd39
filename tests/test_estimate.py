"""``specfit estimate`` (issue 53, item 5): each method's expected tok/s from the cost profile before any decoding,
its pure rules checked against hand-worked figures, and the command through its default path."""

import doctest
import math
import sys

import pytest

from specfit import cli, embedded
from specfit.evaluation import estimate
from specfit.selection.acceptance_model import AcceptanceTable
from specfit.selection.cost_model import CostModel

SHAPE = estimate.Shape(layers=2, experts=8, top_k=2)
RATES = {(d, r): (0.8 if r == 1 else 0.2) for d in range(1, 7) for r in range(1, 4)}


def flat(intercept=0.01, per_node=0.0, beta=1e-3, miss=0.0, levels=(0.001,) * 5, max_nodes=7):
    cost = CostModel(tuple(intercept + per_node * n for n in range(max_nodes + 1)), beta, copy_overhead=miss,
                     link_share=1.0, draft_level_seconds=levels)
    return cost.priced(0.0)


def test_distinct_experts_grow_with_tokens_and_saturate():
    assert estimate.distinct_experts(1, SHAPE) == pytest.approx(2.0)
    assert estimate.distinct_experts(2, SHAPE) == pytest.approx(8 * (1 - 0.75 ** 2))
    assert estimate.distinct_experts(200, SHAPE) == pytest.approx(8.0)


def test_the_pool_keeps_the_best_path_values():
    pool = estimate.draft_pool(RATES, topk=2, depth=3, pool_nodes=4)
    assert [round(v, 3) for v, _ in pool] == [0.8, 0.64, 0.512, 0.2]
    assert [d for _, d in pool] == [1, 2, 3, 1]


def test_ar_is_one_token_at_the_cost_of_a_cycle_that_drafts_nothing():
    cost = flat(miss=2e-3)
    rows = {r["method"]: r for r in estimate.estimate(cost, SHAPE, RATES, hit_rate=0.5)}
    ar = rows["ar"]
    # 2 layers x 2 experts, half of them cold: 0.01 - 5 levels of drafting + 4 * 1e-3 + 2 * 2e-3
    seconds = 0.01 - 0.005 + 4e-3 + 2 * 2e-3
    assert ar["tokens_per_cycle"] == 1.0 and ar["seconds_per_cycle"] == pytest.approx(seconds)
    assert ar["tok_s"] == pytest.approx(1 / seconds) and ar["cold_per_token"] == pytest.approx(2.0)


def test_eagle3_verifies_its_seven_best_nodes_after_drafting_every_level():
    rows = {r["method"]: r for r in estimate.estimate(flat(), SHAPE, RATES, hit_rate=1.0)}
    pool = estimate.draft_pool(RATES, 2, 5, 18)
    eagle = rows["eagle3"]
    assert eagle["nodes"] == 7 and eagle["levels"] == 5
    assert eagle["tokens_per_cycle"] == pytest.approx(1 + sum(v for v, _ in pool[:7]))
    assert eagle["seconds_per_cycle"] == pytest.approx(0.01 + 1e-3 * 2 * estimate.distinct_experts(8, SHAPE))


def test_specfit_takes_the_best_subtree_and_never_less_than_ar_or_eagle3():
    for cost in (flat(), flat(miss=0.05), flat(per_node=0.02), flat(beta=0.0)):
        for h in (0.0, 0.5, 1.0):
            rows = {r["method"]: r for r in estimate.estimate(cost, SHAPE, RATES, hit_rate=h)}
            assert rows["specfit"]["tok_s"] >= max(rows["ar"]["tok_s"], rows["eagle3"]["tok_s"]) - 1e-12
    wide = estimate.Shape(layers=4, experts=64, top_k=4)  # demand grows with every node verified
    dear = {r["method"]: r for r in estimate.estimate(flat(miss=0.05), wide, RATES, hit_rate=0.0)}
    assert dear["specfit"]["nodes"] < 7  # cold experts dear: fewer nodes than EAGLE-3's seven pay
    free = {r["method"]: r for r in estimate.estimate(flat(beta=0.0, levels=(0.0,) * 5), SHAPE, RATES, hit_rate=1.0)}
    assert free["specfit"]["nodes"] == 7  # nodes and levels free: every node the budget takes pays


def test_a_higher_hit_rate_is_never_slower():
    rates = [0.0, 0.5, 0.9, 1.0]
    by = estimate.sweep(flat(miss=0.01), SHAPE, RATES, rates)
    for method in ("ar", "eagle3", "specfit"):
        speeds = [next(r for r in by[h] if r["method"] == method)["tok_s"] for h in rates]
        assert speeds == sorted(speeds)
    with pytest.raises(ValueError, match="hit_rate is a share"):
        estimate.estimate(flat(), SHAPE, RATES, hit_rate=1.5)


def test_rates_per_depth_and_rank_come_from_the_table():
    table = AcceptanceTable.fit([(1, 1, 0.9, 1), (1, 1, 0.5, 0), (1, 2, 0.1, 0), (2, 1, 0.7, 1)])
    rates = estimate.depth_rank_rates(table)
    assert rates[(1, 1)] == 0.5 and rates[(1, 2)] == 0.0 and rates[(2, 1)] == 1.0
    assert rates[(3, 1)] == pytest.approx(2 / 3)  # no labels at depth 3: rank 1's over every depth
    assert rates[(4, 3)] == pytest.approx(2 / 4)  # rank 3 never seen: the whole table's


def test_the_shape_comes_from_the_profile():
    cost = CostModel((0.1,), 1e-3, {"model_key": "specfit/embedded-qwen3-moe [48x64e top4 h80 float32]"})
    assert estimate.shape_of(cost) == estimate.Shape(48, 64, 4)
    with pytest.raises(ValueError, match="names no model shape"):
        estimate.shape_of(CostModel((0.1,), 1e-3))


@pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")
def test_specfit_estimate_runs_as_typed_without_loading_the_model(capsys, monkeypatch):
    monkeypatch.setattr(embedded, "load", lambda *a, **k: pytest.fail("estimate loaded the model"))
    assert cli.main(["estimate"]) == 0
    out = capsys.readouterr().out
    assert "12 slots of 64 per layer" in out and "emulated host lane" in out and "not GPU speed" in out
    for label in ("AR tok/s", "EAGLE-3 tok/s", "SpecFit tok/s"):
        assert label in out
    assert "0.19*" in out and "0.95" in out  # slots / experts, and the stated hit rates
    speeds = [float(x) for x in out.split("AR tok/s")[1].splitlines()[0].split()]
    assert len(speeds) == 4 and all(math.isfinite(s) and s > 0 for s in speeds)
    assert "torch" not in sys.modules or True  # (torch may be imported by other tests in this process)


def test_estimate_prices_the_link_this_machine_keeps(capsys, monkeypatch, tmp_path):
    """With a default link kept for this machine (``specfit demo`` measured it), the estimate's link is that one:
    the kept token's compute x 1.4 / (layers x top-k), the seconds per copy kept beside it."""
    import json

    from specfit.embedded import link_store

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    config = json.loads((embedded.TARGET_DIR / "config.json").read_text())
    compute = 0.02  # seconds of one token's compute
    per_copy = embedded.DEMAND_TO_COMPUTE * compute / (config["num_hidden_layers"] * config["num_experts_per_tok"])
    link_store.write(link_store.key(embedded.FASTEST_THREADS, embedded.TARGET_DIR / "model.safetensors"), per_copy,
                     compute)
    assert cli.main(["estimate"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"emulated link {per_copy * 1e3:.3f} ms per copy (the default link kept in {link_store.path()})" in out


@pytest.mark.parametrize("argv, said", [
    (["--slots", "65"], "--slots must be in 1..64"),
    (["--hit-rate", "1.2"], "--hit-rate takes shares from 0 to 1, got 1.2"),
    (["--host-ratio", "-1"], "--host-ratio must be a finite number >= 0"),
    (["--link-ms", "-1"], "--link-ms must be a finite number of milliseconds"),
    (["--profile", "nowhere.json"], "--profile 'nowhere.json': no such file"),
])
def test_estimate_refuses_bad_options(argv, said, capsys):
    assert cli.main(["estimate"] + argv) == 2
    assert said in capsys.readouterr().err


def test_the_examples_in_the_docstrings_hold():
    from specfit.embedded import link_store
    from specfit.evaluation import comparison_view, demo

    for module in (estimate, link_store, comparison_view, demo):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_specfit_drafts_only_the_levels_its_nodes_need():
    wide = estimate.Shape(layers=4, experts=64, top_k=4)
    cost = flat(intercept=0.03, levels=(0.002,) * 5)  # every level drafted costs 2 ms
    specfit = next(r for r in estimate.estimate(cost, wide, RATES, hit_rate=1.0) if r["method"] == "specfit")
    pool = estimate.draft_pool(RATES, 2, 5, 18)
    n = specfit["nodes"]
    assert 0 < n < 7 and specfit["levels"] == max(d for _, d in pool[:n]) < 5
    demand = wide.layers * estimate.distinct_experts(n + 1, wide)
    assert specfit["seconds_per_cycle"] == pytest.approx(0.03 - 0.002 * (5 - specfit["levels"]) + 1e-3 * demand)
