"""The host syncs a decode would make on CUDA, counted on the CPU (``specfit.evaluation.syncs.WouldBeSyncs``).

At batch 1 a GPU decode is launch- and sync-bound: each sync drains the compute stream and the GPU idles until the
next launch. The budget pinned here: one per MoE layer at decode and at verify (the routes reach the host once:
a layer's experts are known only then), at most 10 per cycle outside the layers with drafting (about one per drafted
level, one for acceptance), and a cycle that skips drafting at most 2 + 1 per layer.
"""

import numpy as np
import pytest
import torch
from conftest import tiny_moe, tiny_moe_config

import specfit
from specfit.decoding.assistants import ASSISTANTS
from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter
from specfit.evaluation.syncs import WouldBeSyncs
from specfit.offload.experts import LayerRuntime
from specfit.selection.cost_model import CostModel
from specfit.transfer import Staging, to_host

FREE = CostModel(intercepts=(1.0,) * 8, beta=0.0)  # nodes cost nothing: SpecFit drafts and verifies full trees
DEAR = CostModel(intercepts=(1.0,) + (50.0,) * 7, beta=0.0)  # no draft node pays: SpecFit skips drafting
PROMPT = torch.randint(2, 256, (1, 12), generator=torch.Generator().manual_seed(1))


def gate_drafter(seed=0) -> Eagle3Drafter:
    """A random drafter as wide as the target, so ``route_source="auto"`` runs the target's gates on its states."""
    torch.manual_seed(seed)
    return Eagle3Drafter(Eagle3Config.from_target(tiny_moe_config(), draft_vocab_size=128))


class Count:
    """Counts one generate(): syncs inside each MoE layer forward, and the counter at each cycle's start."""

    def __init__(self, model, assistant=None, cost=FREE, slots=3, new_tokens=24, **options):
        self.model = model
        self.syncs = WouldBeSyncs(sites=True)
        self.layers: list[tuple[int, int]] = []  # (tokens, syncs) per MoE layer forward
        self.cycles: list[tuple[int, int, int]] = []  # (syncs so far, layer forwards so far, pool size) per cycle
        original = LayerRuntime.forward

        def counted(layer, *args):
            before = self.syncs.total
            out = original(layer, *args)
            self.layers.append((args[1].shape[0], self.syncs.total - before))
            return out

        def marked(model):
            gen = ASSISTANTS[assistant](model)
            draft = gen.draft

            def draft_marked(cycle):
                mark = (self.syncs.total, len(self.layers))
                tree = draft(cycle)
                self.cycles.append((*mark, len(tree)))
                return tree

            gen.draft = draft_marked
            return gen

        LayerRuntime.forward = counted
        try:
            with self.syncs:
                kw = {} if assistant is None else {"assistant": marked}
                self.out = model.generate(PROMPT, max_new_tokens=new_tokens, do_sample=False, **kw)
        finally:
            LayerRuntime.forward = original

    def outside_layers(self) -> list[tuple[int, int]]:
        """(syncs outside the layers, pool size) of every complete cycle."""
        out = []
        for (s0, l0, pool), (s1, l1, _) in zip(self.cycles, self.cycles[1:]):
            inside = sum(s for _, s in self.layers[l0:l1])
            out.append((s1 - s0 - inside, pool))
        return out

    def whole(self) -> list[tuple[int, int]]:
        """(all syncs, pool size) of every complete cycle."""
        return [(s1 - s0, pool) for (s0, _, pool), (s1, _, _) in zip(self.cycles, self.cycles[1:])]


def enabled(**options):
    return specfit.enable(tiny_moe(), cache_slots=3, drafter=gate_drafter(), cost_model=options.pop("cost", FREE),
                          **options)


def test_one_sync_per_moe_layer_at_decode_prefill_and_verify():
    """Fails when a Python list indexes a device tensor in the experts path (each is a pageable copy + sync)."""
    for assistant in (None, "eagle3", "specfit"):
        count = Count(enabled(), assistant)
        tokens = {t for t, _ in count.layers}
        assert PROMPT.shape[1] in tokens and len(tokens) >= 2, tokens  # prefill, and decode or verify forwards
        assert assistant is not None or 1 in tokens
        bad = [(t, s) for t, s in count.layers if s != 1]
        assert not bad, f"{assistant}: layer forwards with other than one sync (tokens, syncs): {bad[:5]}; " \
                        f"sites: {count.syncs.where.most_common(5)}"


@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_a_drafting_cycle_makes_at_most_ten_syncs_outside_the_layers(assistant):
    count = Count(enabled(guard=False), assistant)  # the rule alone drafts every cycle (the guard may run plain ones)
    cycles = count.outside_layers()
    assert len(cycles) >= 3 and all(pool > 0 for _, pool in cycles)  # full trees drafted every cycle
    worst = max(s for s, _ in cycles)
    assert worst <= 10, f"{worst} syncs in a cycle outside the layers; sites: {count.syncs.where.most_common(12)}"


def test_a_cycle_that_skips_drafting_costs_two_syncs_plus_one_per_layer():
    model = enabled(cost=DEAR, guard=False)  # the rule's backoff
    count = Count(model, "specfit", new_tokens=40)
    skipped = [s for s, pool in count.whole() if pool == 0]
    assert len(skipped) >= 10  # the backoff skips drafting most cycles under a cost no node can pay
    budget = 2 + len(model.specfit.layers)
    assert max(skipped) <= budget, f"{max(skipped)} > {budget}; sites: {count.syncs.where.most_common(8)}"


def test_the_counter_counts_what_would_sync_and_nothing_else():
    x = torch.arange(12).view(3, 4)
    idx = torch.tensor([0, 2])
    with WouldBeSyncs() as syncs:
        x[1:]  # a view
        x.index_select(0, idx)  # a device index
        torch.arange(3, device="cpu")  # made on the device
        Staging("cpu").to_device([1, 2, 3])  # pinned staging: no sync
    assert syncs.total == 0
    with WouldBeSyncs() as syncs:
        x[[0, 2]]  # list index
        x[[0, 2]] = 0  # list index, written
        x.sum().item()  # host read
        bool(x.any())  # host read
        x.tolist()
        x.cpu()
        torch.tensor([1, 2], device="cpu")  # host data to the device
        x.nonzero()
        x[x > 3]  # boolean mask: nonzero
    assert syncs.total == 9, syncs.by_kind
    with WouldBeSyncs() as syncs:
        a, b, c = to_host(x, x.float(), x > 3)  # several tensors, one transfer
    assert syncs.total == 1 and np.array_equal(b, x.float().numpy()) and c.dtype == np.bool_


def counted(fn) -> dict:
    """The kinds WouldBeSyncs saw while ``fn()`` ran (an exception after the count is fine: a CPU build cannot run a
    CUDA wait, the counter has seen the call by then)."""
    with WouldBeSyncs() as syncs:
        try:
            fn()
        except (RuntimeError, TypeError, AttributeError, AssertionError):
            pass
    return syncs.by_kind


x6 = torch.arange(6)
OPS = {  # issue 29, 3: each would sync on CUDA (a host read, or an output sized by the data)
    "masked_select": (lambda: x6.masked_select(x6 > 2), "masked_select"),
    "unique": (lambda: torch.unique(x6), "unique"),
    "unique_consecutive": (lambda: torch.unique_consecutive(x6), "unique"),
    "repeat_interleave": (lambda: torch.repeat_interleave(x6, x6), "repeat_interleave"),
    "bincount": (lambda: torch.bincount(x6), "bincount"),
    "histc": (lambda: torch.histc(x6.float()), "histc"),
    "equal": (lambda: torch.equal(x6, x6), "host read"),
    "allclose": (lambda: torch.allclose(x6.float(), x6.float()), "host read"),
    "nonzero": (lambda: x6.nonzero(), "nonzero"),
    "numpy index": (lambda: x6[np.array([1, 2])], "host-array index"),
    "list index": (lambda: x6[[1, 2]], "host-array index"),
    "numpy index, written": (lambda: x6.clone().__setitem__(np.array([1]), 0), "host-array index"),
    "device synchronize": (lambda: torch.cuda.synchronize(), "device synchronize"),
    "event synchronize": (lambda: torch.cuda.Event.synchronize(object()), "event synchronize"),
    "stream synchronize": (lambda: torch.cuda.Stream.synchronize(object()), "stream synchronize"),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_syncing_op_and_wait_is_seen_once(name):
    fn, kind = OPS[name]
    assert counted(fn) == {kind: 1}


def test_ops_that_do_not_sync_are_not_counted():
    assert not counted(lambda: torch.repeat_interleave(x6, x6, output_size=15))  # the size is given
    assert not counted(lambda: x6.repeat_interleave(2))  # int repeats
    assert not counted(lambda: x6.index_select(0, torch.tensor([1, 2])))


class SlowEvent:
    """A copy's event that has not fired yet (a CPU stand-in for the staging ring's CUDA event)."""

    waited = 0

    def query(self):
        return False

    def synchronize(self):
        SlowEvent.waited += 1

    def record(self):
        pass


def test_specfit_host_waits_are_counted_once_on_any_device():
    """settle (a forward that copied), drain, and the staging ring's wait go through transfer.host_wait; a CPU
    run reports there the waits CUDA would make."""
    from specfit.offload.cache import CopyEngine
    from specfit.stats import Counters
    from specfit.transfer import host_wait

    engine, counters = CopyEngine(torch.device("cpu")), Counters()
    with WouldBeSyncs() as syncs:
        engine.settle(counters)  # nothing copied: no wait
        engine.copy_batch([(torch.empty(4), torch.ones(4))], counters)
        engine.settle(counters)  # CUDA waits for the forward's last batch
        engine.settle(counters)  # settled already
        engine.drain()
        host_wait(SlowEvent(), "event")  # a real wait, counted once (not again as an event synchronize)
    assert dict(syncs.by_kind) == {"settle": 1, "drain": 1, "event": 1}
    staging = Staging("cpu")
    staging.pinned = True  # the pinned path, with buffers and events a CPU run can hold
    staging._buffers = [torch.zeros(8, dtype=torch.int64) for _ in staging._buffers]
    staging._events = [SlowEvent() for _ in staging._events]
    SlowEvent.waited = 0
    with WouldBeSyncs() as syncs:
        out = staging.to_device([4, 5])
    assert dict(syncs.by_kind) == {"staging ring wait": 1} and SlowEvent.waited == 1 and out.tolist() == [4, 5]


def test_the_cuda_waits_are_restored_after_counting():
    originals = [torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize]
    with WouldBeSyncs():
        assert torch.cuda.synchronize is not originals[0]
    assert [torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize] == originals


def test_empty_host_data_is_no_copy():
    assert not counted(lambda: torch.tensor([], device="cpu"))  # transformers' KV cache starts so: no bytes move
    assert counted(lambda: torch.tensor([0], device="cpu")) == {"tensor from host data": 1}


def test_waits_are_told_apart_from_the_other_syncs():
    """The GPU check adds ``waits`` to what CUDA's debug mode reports (it sees the rest, not these)."""
    from specfit.transfer import host_wait

    with WouldBeSyncs() as syncs:
        x6.tolist()
        host_wait(None, "settle")
        try:
            torch.cuda.synchronize()
        except (RuntimeError, AssertionError):
            pass
    assert syncs.total == 3 and syncs.waits == 2
