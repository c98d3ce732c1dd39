"""The forecast of a SpecFit cycle that skips drafting (a root-only step): priced at the root's own demand and
misses (not its hits), reported as that cycle's forecast (not the last drafted cycle's), and, after a root-only
forward, taken from that forward's demand and misses in their places (issue 35, item 7)."""

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.decoding.assistants import SpecFitGenerator
from specfit.selection.cost_model import CostModel
from specfit.selection.route_sources import Cycle

PROMPT = torch.tensor([[3, 5, 7, 9, 11, 13]])
LAYERS, EXPERTS = 4, 16
# copies dear against compute (1 ms per copy, 10 us per expert), so hits and misses price far apart
COST = CostModel((0.010, 0.0105, 0.011, 0.0115, 0.012, 0.0125, 0.013, 0.0135), 1e-5, copy_overhead=1e-3,
                 link_share=1.0)


@pytest.fixture
def setup():
    model = tiny_moe()
    specfit.enable(model, cache_slots=6, drafter=SelfDrafter(model, first_token=int(PROMPT[0, 0])), cost_model=COST)
    runtime = model.specfit
    root = np.zeros((LAYERS, EXPERTS), dtype=bool)  # [L, E] the root needs experts 0..2 of each layer
    root[:, :3] = True
    nodes = np.zeros((LAYERS, EXPERTS), dtype=bool)  # [L, E] every draft node needs experts 8..11
    nodes[:, 8:12] = True
    runtime.backoff = None
    gen = SpecFitGenerator(model)
    gen.guard = None  # the rule's backoff decides which cycles skip drafting (the tests set it)
    gen.routes = lambda cycle, tree: (np.broadcast_to(nodes, (len(tree), LAYERS, EXPERTS)).copy(), root.copy())
    gen.start(torch.zeros(1, PROMPT.shape[1], 3 * 64), torch.cat([PROMPT[:, 1:], PROMPT[:, :1]], dim=1))
    cycle = Cycle(model, cache=None, base=PROMPT.shape[1], root=int(PROMPT[0, 0]))
    resident = nodes.copy()  # the nodes' experts resident (so drafted cycles verify nodes), and one of the root's
    resident[:, 0] = True  # three per layer: 4 hits, 8 misses
    runtime.clear_cache()
    runtime.prefetch(resident)
    assert (runtime.resident_mask() == resident).all()
    return model, gen, cycle


def test_a_skipped_cycle_forecasts_the_roots_misses_not_its_hits(setup):
    model, gen, cycle = setup
    assert len(gen.draft(cycle)) > 0 and gen.winner.nodes  # a drafted cycle that verifies draft nodes
    drafted = gen.predicted_seconds
    gen.backoff.left = 1  # the next cycle skips drafting
    assert len(gen.draft(cycle)) == 0
    want = gen.cost.predict(0, 12, misses=8)  # demand 3 x 4 layers, of which 2 x 4 not resident
    assert gen.predicted_seconds == pytest.approx(want)
    assert gen.predicted_seconds != pytest.approx(gen.cost.predict(0, 12, misses=4))  # the hits, not the misses
    assert gen.predicted_seconds != pytest.approx(drafted)  # its own forecast, not the drafted cycle's
    assert gen.expected_tokens == 1.0


def test_after_a_root_only_forward_its_demand_and_misses_stay_in_their_places(setup):
    model, gen, cycle = setup
    gen.backoff.left = 2  # two cycles in a row skip drafting
    assert len(gen.draft(cycle)) == 0
    with torch.no_grad():  # the root-only step's forward: its experts were copied by the forward before, all hits
        model(PROMPT[:, :1])
        model(PROMPT[:, :1])
    last = model.specfit.stats.last_forward
    assert last.demand > 0 and last.misses == 0
    assert len(gen.draft(cycle)) == 0
    assert gen.predicted_seconds == pytest.approx(gen.cost.predict(0, last.demand, misses=last.misses))
    assert gen.predicted_seconds != pytest.approx(gen.cost.predict(0, last.misses, misses=last.demand))
