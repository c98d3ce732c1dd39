"""Never silently wrong after an interrupt: a fault at any torch call of an offloaded forward or of a prefetch
(KeyboardInterrupt, an out-of-memory error, a failed copy) leaves no slot marked with an expert it does not hold,
so the next greedy call equals the reference token for token.

``FaultAt`` is a dispatch mode that counts the aten calls made while it is armed and raises at call ``k``; it is
armed for one chosen forward of a ``generate()`` call (the prefill, a decode or verify forward) or for one prefetch.
CI runs a sample of call indices per case; ``-m slow`` runs every index.
"""

import random

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe
from torch.utils._python_dispatch import TorchDispatchMode

import specfit
from specfit.selection.cost_model import CostModel

FREE = CostModel(intercepts=(1.0,) * 8, beta=0.0)  # SpecFit verifies full subtrees: every path is exercised
PROMPT = torch.tensor([[5, 17, 99, 3, 42, 7, 61, 8]])
OTHER = torch.tensor([[9, 2, 77, 31, 4]])
NEW = 10


class Interrupt(BaseException):
    """Stands for KeyboardInterrupt (a BaseException, not an Exception: handlers for errors do not catch it)."""


class FaultAt(TorchDispatchMode):
    def __init__(self, k: int | None, slots: set[int] = frozenset()):
        super().__init__()
        self.k, self.calls, self.armed, self.fired = k, 0, False, False
        self.slots = slots  # storage pointers of the slot buffers
        self.copies: list[int] = []  # indices of the calls that wrote into a slot buffer while armed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.armed:
            self.calls += 1
            if func.overloadpacket is torch.ops.aten.copy_ and args[0].untyped_storage().data_ptr() in self.slots:
                self.copies.append(self.calls)
            if self.calls == self.k:
                self.fired = True
                raise Interrupt()
        return func(*args, **(kwargs or {}))


def arm_forward(model, mode: FaultAt, which: int):
    """Arm ``mode`` for the ``which``-th forward (1-based) of the model from now on."""
    rt, seen = model.specfit, [0]
    begin, end = rt.begin_forward, rt.end_forward

    def armed_begin():
        seen[0] += 1
        begin()
        mode.armed = seen[0] == which

    def disarmed_end():
        mode.armed = False
        end()

    rt.begin_forward, rt.end_forward = armed_begin, disarmed_end
    return lambda: (vars(rt).pop("begin_forward"), vars(rt).pop("end_forward"))


def arm_prefetch(model, mode: FaultAt):
    rt = model.specfit
    prefetch = rt.prefetch

    def armed(experts):
        mode.armed = True
        try:
            prefetch(experts)
        finally:
            mode.armed = False

    rt.prefetch = armed
    return lambda: vars(rt).pop("prefetch")


def make(assistant):
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=0.3)
    return specfit.enable(model, cache_slots=3, drafter=drafter, cost_model=FREE,
                          prefetch=assistant == "specfit")


def references():
    model = tiny_moe()
    return {name: model.generate(ids, max_new_tokens=NEW, do_sample=False) for name, ids in
            (("prompt", PROMPT), ("other", OTHER))}


def generate(model, ids, assistant):
    kw = {} if assistant is None else {"assistant": assistant}
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kw)


def calls_in(model, assistant, where) -> tuple[int, list[int]]:
    """How many aten calls the armed region makes when nothing fails, and which of them fill slots."""
    mode = FaultAt(None, {layer.cache.slots.untyped_storage().data_ptr() for layer in model.specfit.layers})
    undo = arm_forward(model, mode, where) if where != "prefetch" else arm_prefetch(model, mode)
    try:
        with mode:
            generate(model, PROMPT, assistant)
    finally:
        undo()
    return mode.calls, mode.copies


def faults_leave_no_stale_slot(assistant, where, indices, refs) -> int:
    """Interrupt the call at each index, then check the next greedy call (on another prompt, then the same one)
    against the reference. Returns how many faults fired."""
    model = make(assistant)
    fired = 0
    for k in indices:
        mode = FaultAt(k)
        undo = arm_forward(model, mode, where) if where != "prefetch" else arm_prefetch(model, mode)
        try:
            with mode:
                generate(model, PROMPT, assistant)
        except Interrupt:
            pass
        finally:
            undo()
        fired += mode.fired
        slots_hold_what_they_claim(model, f"right after a fault at call {k} of {where}")
        for name, ids in (("other", OTHER), ("prompt", PROMPT)):
            out = generate(model, ids, assistant)
            assert torch.equal(out, refs[name]), \
                f"{assistant or 'AR'}: after a fault at call {k} of {where}, the next greedy call on '{name}' differs"
        slots_hold_what_they_claim(model, "after the next calls")
    return fired


def slots_hold_what_they_claim(model, when: str) -> None:
    rt = model.specfit
    for layer in rt.layers:
        store = rt.store.arenas[layer.index]
        for expert, slot in layer.cache.lru.resident.items():
            assert torch.equal(layer.cache.slots[slot], store[expert]), \
                f"{when}: layer {layer.index}, slot {slot} is marked as expert {expert} but holds other weights"


CASES = [(None, 1), (None, 2), ("eagle3", 1), ("eagle3", 2), ("specfit", 2), ("specfit", "prefetch")]


def sampled(n: int, copies: list[int], count: int, seed: int) -> list[int]:
    """The slot copies (the window a fault can corrupt) and a spread sample of the other calls."""
    rng = random.Random(seed)
    rest = [k for k in range(1, n + 1) if k not in copies]
    chosen = copies if len(copies) <= count else sorted(rng.sample(copies, count))
    return sorted(chosen + rng.sample(rest, min(len(rest), count)))


@pytest.mark.parametrize("assistant, where", CASES)
def test_a_fault_at_sampled_calls_leaves_the_next_call_exact(assistant, where):
    refs = references()
    n, copies = calls_in(make(assistant), assistant, where)
    assert n > 20 and copies, f"the armed region made {n} calls, {len(copies)} of them into slots"
    indices = sampled(n, copies, 6, seed=sum(map(ord, f"{assistant}{where}")))
    assert faults_leave_no_stale_slot(assistant, where, indices, refs) > 0


@pytest.mark.slow
@pytest.mark.parametrize("assistant, where", CASES)
def test_a_fault_at_every_call_leaves_the_next_call_exact(assistant, where):
    refs = references()
    n, _ = calls_in(make(assistant), assistant, where)
    assert faults_leave_no_stale_slot(assistant, where, range(1, n + 1), refs) == n


def interrupt_at_line(k: int, files=("offload/slots.py", "offload/policies.py")):
    """A trace function that raises ``Interrupt`` at the ``k``-th line run in the slot bookkeeping's files (as a
    signal can land between any two bytecodes). Returns (tracer, [lines seen so far])."""
    seen = [0]

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.replace("\\", "/").endswith(files):
            return None
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                raise Interrupt()
        return tracer

    return tracer, seen


@pytest.mark.parametrize("policy", ["lru", "frequency", "forecast"])
def test_an_interrupt_at_any_line_of_a_plan_leaves_nothing_stale(policy):
    """A signal can land between any two bytecodes, inside the slot plan (and its policy) too: a load marked in the
    plan but never confirmed is forgotten by the next plan, a slot taken but not yet marked is freed again, and the
    next plan assigns every slot once."""
    import sys

    from specfit.offload.policies import make_policy
    from specfit.offload.slots import SlotBook

    def book():
        b = SlotBook(3, 8, make_policy(policy, 8))
        b.plan([0, 1])
        b.plan([1, 2], uses=[2, 1])
        b.expect([0.5] * 8)
        return b

    fired = 0
    for k in range(1, 1000):
        b = book()
        tracer, seen = interrupt_at_line(k)
        sys.settrace(tracer)
        try:
            b.plan([3, 4, 5, 6], confirmed=False, uses=[1, 3, 1, 2])  # 4 needed, 3 slots: loads, evictions, a stream
        except Interrupt:
            fired += 1
        finally:
            sys.settrace(None)
        if seen[0] < k:  # the plan ran to its end before line k: it has been interrupted at every line
            break
        assert not {3, 4, 5, 6} & set(b.resident), f"line {k}: an unconfirmed load is resident"
        plan = b.plan([3, 4, 5], uses=[50] * 3)  # the next plan recovers (used by 50 tokens each: no bypass)
        assert sorted(e for e, _ in plan.loads + plan.hits) == [3, 4, 5], f"line {k}: {plan}"
        assert sorted(s for _, s in plan.loads + plan.hits) == [0, 1, 2] and sorted(b.resident) == [3, 4, 5]
        assert not b._free and len(b._order) == 3  # every slot assigned once
    assert fired > 20
