"""The real host lane's settings and prices on the CUDA stand-in (issue 52, review 7 items 3, 7 and 8): the lane's
worker runs on the machine's cores whatever thread count the caller set for itself; it is priced over experts in
turn, as misses bring them, not one cache-hot expert; calibrate's lane rounds are skipped, with the reason, when the
lane's measured speed says they would pass the time allowed."""

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit import cli
from specfit.evaluation import lane_budget
from specfit.evaluation.probes import calibrate
from specfit.offload import experts as experts_module, host_compute, standin
from specfit.offload.host_compute import ThreadedLane, machine_threads
from specfit.offload.host_lane import HostConfig
from specfit.stats.counters import Counters

PROMPTS = [torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv(standin.ENV, "1")


def test_the_lane_runs_on_the_machines_threads_not_the_callers(monkeypatch):
    """Review 7 item 7: `specfit serve --threads 1` set one thread before the model loaded, and the lane's worker
    inherited it; the worker now sets its own, from the machine (every core but the Python thread's)."""
    assert torch.get_num_threads() == 1  # the caller's own setting (conftest)
    lane = ThreadedLane(torch.device("cpu"), standin.HostCopies(), threads=2)
    counters = Counters()
    seen = lane.join(lane.submit(lambda: torch.tensor([float(torch.get_num_threads())]), [], counters), counters)
    lane.close()
    assert seen.item() == 2 and torch.get_num_threads() == 1  # the worker's threads; the caller's untouched
    monkeypatch.setattr(host_compute.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert machine_threads() == 15 and ThreadedLane(torch.device("cpu"), standin.HostCopies()).threads == 15
    monkeypatch.setattr(host_compute.os, "sched_getaffinity", lambda pid: {0})
    assert machine_threads() == 1


def test_the_lane_is_priced_over_experts_in_turn(on, monkeypatch):
    """Review 7 item 3: the lane was timed on expert 0 again and again (its bytes in the host's cache); it is now
    timed on the first layer's experts in turn, each run on the next, as misses bring them."""
    model = specfit.enable(tiny_moe(), cache_slots=4)
    rt = model.specfit
    used = []
    original = experts_module.host_work

    def spy(module, store, layer, x, plans):  # the work, made; what it computes is recorded when it runs
        work = original(module, store, layer, x, plans)

        def run():
            used.append((layer, tuple(e for p in plans for e in p.experts)))
            return work()
        return run

    monkeypatch.setattr(experts_module, "host_work", spy)
    rt.lane.measured = None
    assert rt.host_seconds(1) > 0 and rt.host_seconds(32) >= rt.host_seconds(1)
    runs = 2 * (9 + 2)  # 1 and 32 tokens, two warm-ups and nine timed runs each
    assert len(used) == runs and all(layer == 0 and len(e) == 1 for layer, e in used)
    order = [e[0] for _, e in used]
    assert order == [r % min(host_compute.LANE_EXPERTS, rt.num_experts) for r in range(runs)]  # each run the next
    assert len(set(order)) == 16  # every expert of the tiny model's layer (16 < LANE_EXPERTS)


def _enabled(**kw):
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPTS[0][0, 0]), noise=0.3)
    return specfit.enable(model, cache_slots=6, drafter=drafter, depth=2, pool_nodes=6, max_nodes=3, **kw)


def test_calibrate_skips_lane_rounds_its_lane_is_too_slow_for(monkeypatch):
    """Review 7 item 8: the lane rounds compute every expert on the host; with the lane's measured (here: set) time
    per expert they would pass the time allowed, so they are skipped, said why, and the profile has no lane round."""
    model = _enabled()
    slow = HostConfig(bandwidth=1e6)  # ~1 ms per tiny expert: planned experts x 1 ms
    kw = dict(probes=12, repeats=1, warmup=1, max_new_tokens=20, bootstrap=20, links=[None], lanes=[slow])
    with pytest.warns(RuntimeWarning, match=r"host-lane rounds would take the lane about .* over the 0.01 s allowed "
                                            r"\(--lane-seconds\): skipped"):
        result = calibrate(model, PROMPTS, lane_seconds=0.01, **kw)
    assert result.cost.meta["probes"]["lanes"] == [None] and result.cost.cold == "copy"  # no lane round ran
    kept = calibrate(model, PROMPTS, lane_seconds=1e4, **kw)  # time enough: the lane round runs
    assert kept.cost.meta["probes"]["lanes"] == [None, slow.label] and kept.cost.cold == "auto"
    assert any(r.host for r in kept.records) and not any(r.host for r in result.records)


def test_lane_rounds_the_fit_needs_are_kept_and_the_limit_said():
    model = _enabled()
    runtime = model.specfit
    slow = HostConfig(bandwidth=1e6, per_token=1e-4)  # a prefill's 32 tokens cost more than a decode's one
    one = lane_budget.round_seconds(runtime, slow, 100, 10)
    assert one > lane_budget.round_seconds(runtime, slow, 110, 0)
    assert one == pytest.approx(100 * slow.expert_time(runtime.store.expert_bytes, 1)
                                + 10 * slow.expert_time(runtime.store.expert_bytes, lane_budget.PREFILL_TOKENS))
    assert lane_budget.bounded_lanes(runtime, [slow], (100, 10), 2, None, True) == [slow]  # no bound given
    assert lane_budget.bounded_lanes(runtime, [slow], (100, 10), 2, 2 * one, True) == [slow]  # just fits
    with pytest.warns(RuntimeWarning, match="kept, as the fit needs their records: the run may pass its time limit"):
        assert lane_budget.bounded_lanes(runtime, [slow], (100, 10), 2, one, False) == [slow]
    with pytest.warns(RuntimeWarning, match="skipped"):
        assert lane_budget.bounded_lanes(runtime, [slow], (100, 10), 2, one, True) == []


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_lane_seconds_is_checked_before_anything_loads(value, capsys):
    assert cli.main(["calibrate", "--lane-seconds", value]) == 2
    assert "--lane-seconds must be a finite number of seconds > 0" in capsys.readouterr().err
