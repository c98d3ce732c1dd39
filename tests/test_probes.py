"""The calibration probes on CPU with the emulated link: what they time (copies told from compute, each drafted
level on its own), which subtrees they choose, and a drafter they cannot replay."""

import itertools
import random
import types

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.drafting.tree import DraftTree
from specfit.evaluation import probes as probes_module
from specfit.drafting.tree import random_subtree
from specfit.evaluation.probes import ReplayProbe, calibrate, schedule
from specfit.selection.batch_cost import FIXED, BatchCost
from specfit.selection.route_sources import Cycle

PROMPTS = [torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]


def random_drafter(model, seed=0):
    from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter

    torch.manual_seed(seed)
    config = Eagle3Config.from_target(model.config, draft_vocab_size=256, intermediate_size=128)
    config.aux_layer_ids = (0, 1, 3)
    return Eagle3Drafter(config)


def test_calibration_tells_copies_from_compute_and_recovers_the_emulated_link():
    """A cached slot cache of 6 of 16 experts and a 2 ms emulated link: the replays alternate between no link and the
    link, so the fit finds that a copy waits for (about) all of the link's time, and prices a copy at the link near
    2 ms plus a small overhead, whatever the slot count it is used at."""
    model = tiny_moe()
    specfit.enable(model, cache_slots=6, link=2e-3, drafter=random_drafter(model), depth=3, pool_nodes=10)
    result = calibrate(model, PROMPTS, probes=60, repeats=2, warmup=1, max_new_tokens=50, bootstrap=50)
    cost, records = result.cost, result.records
    probes = cost.meta["probes"]
    assert probes["configs"] == 60 and len(records) == 120 and probes["dropped"] == 0 and probes["repeats_matched"]
    assert sorted({r.link_seconds for r in records}) == [0.0, 2e-3]  # every configuration on both links
    assert probes["links"] == ["real copies", "emulated link, 2 ms per expert copy"]
    assert probes["route_source"] == "deployable"  # the target's gates (the drafter is as wide): no oracle forward
    assert len({r.n_nodes for r in records}) >= 6  # the probes span subtree sizes
    cold = [r for r in records if r.misses == r.demand]
    assert len(cold) >= 10 and len(cold) < len(records) // 2  # cold cycles and warm ones
    # a copy waits for most of the link's time (the compute of experts that landed overlaps the rest; more of it
    # on a loaded machine, where that compute is slower)
    assert cost.prices_copies and 0.5 < cost.link_share < 1.2, f"link share {cost.link_share:.2f}"
    assert 0.6 < cost.copy / 2e-3 < 1.25, f"copy {cost.copy * 1e3:.3f} ms"  # priced at the probes' link
    assert cost.meta["r2"] > 0.8 and cost.monotone
    assert cost.draft_levels == 3 and all(t > 0 for t in cost.draft_level_seconds)  # depth 3: three levels timed
    assert min(cost.intercepts) >= sum(cost.draft_level_seconds)
    quality = cost.quality
    assert quality["verdict"] == "good" and quality["reasons"] == [] and quality["heldout_r2"] > 0.75
    assert quality["kind"] == "cache-aware" and quality["copy_halfwidth"] < 0.25
    assert quality["pools"] > 0 and 0 <= quality["choice_change_rate"] <= 1
    assert len(quality["intercept_intervals_s"]) == cost.max_nodes + 1 and result.heldout_seconds.shape == (120,)
    batch = cost.meta["batch"]  # the batch probes: batches of 2 and 4 rows, each cycle's fixed time fitted
    assert {2, 4} <= set(batch["rows"]) <= {2, 3, 4} and batch["records"] >= 10  # rows finish on their own
    assert all(batch[k] >= 0 for k in FIXED)
    assert BatchCost.of(cost).per_row == batch["per_row"]  # what the batch rule prices with
    paper = cost.paper()  # the same probes at the 2 ms link on demand alone: valid at 6 slots and that link only
    assert paper.meta["slots"] == 6 and "2 ms" in paper.meta["link"] and not paper.prices_copies
    # demand and misses vary apart: at a size, subtrees of one demand miss differently and the other way round
    by_size = {}
    for r in records:
        by_size.setdefault(r.n_nodes, set()).add((r.demand, r.misses))
    assert sum(len(pairs) > 2 for n, pairs in by_size.items() if n > 0) >= 5


def test_a_drafter_that_samples_cannot_be_replayed_and_each_cycle_is_fitted_alone():
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPTS[0][0, 0]), noise=0.3)  # its noise RNG runs on across calls
    specfit.enable(model, cache_slots=5, drafter=drafter, depth=3, pool_nodes=10)
    with pytest.warns(RuntimeWarning, match="not deterministic here .* every timed cycle is fitted on its own"):
        result = calibrate(model, PROMPTS[:1], probes=12, repeats=2, warmup=1, max_new_tokens=30, bootstrap=30)
    probes = result.cost.meta["probes"]
    assert probes["repeats_matched"] is False and probes["dropped"] is None
    assert len(result.records) == probes["records"] >= 12  # every timed cycle of both rounds (the plan held 12)


def test_probe_subtrees_are_ancestor_closed_and_sizes_are_balanced():
    rng = random.Random(0)
    parents = [-1, -1, 0, 0, 1, 2, 2, 5, 7]
    for size in range(len(parents) + 1):
        nodes = random_subtree(parents, size, rng)
        assert len(nodes) == size and DraftTree(parents=parents).is_ancestor_closed(nodes)
    plan = list(itertools.islice(schedule(random.Random(1), 7), 240))
    sizes = [size for size, _, _, _ in plan]
    assert all(sorted(sizes[i: i + 8]) == list(range(8)) for i in range(0, 240, 8))
    assert [by_misses for _, by_misses, _, _ in plan[:4]] == [True, False, True, False]  # ranked alternately
    assert 20 <= sum(cold for *_, cold in plan) <= 60  # about one in FLUSH_EVERY (6) runs cold


def test_calibrate_times_each_drafted_level_on_its_own_not_cumulatively(monkeypatch):
    """A drafter whose levels take a known 4, 8 and 12 ms (on a fake clock): the replay probe records those, not
    running sums (4, 12, 24)."""
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=1))
    probe = ReplayProbe(model, plan=[], rng=random.Random(0))
    probe.oracle = True  # no routes to read: only the drafter's own time is in each level
    now = [100.0]
    monkeypatch.setattr(probes_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Levels:
        def levels(self):
            for ms in (4, 8, 12):
                now[0] += ms / 1e3
                yield DraftTree()

    probe.drafter = Levels()
    probe.draft(Cycle(model, cache=None, base=0, root=1))
    assert probe.level_seconds == [pytest.approx([4e-3, 8e-3, 12e-3])]

