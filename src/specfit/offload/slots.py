"""Slot bookkeeping for one layer's experts: which expert sits in which slot, planned one forward at a time, with a
replacement policy (``policies.py``) choosing what to evict. Pure Python, no torch.

Vocabulary: an expert is *resident* when a device slot holds its weights. For one forward the layer *needs* a set
of experts; each needed expert is a *hit* (resident), a *load* (copied into a slot: a free one, else one whose expert
the policy evicts; never one this forward needs), or *streamed* (copied through a scratch buffer and not kept: every
slot holds an expert this forward needs, or a policy with bypass keeps every evictable expert over it). Loads and
streamed experts are both *misses*, and every miss is exactly one host-to-device copy.

Plans are transactional: a load planned with ``confirmed=False`` counts as resident only once ``confirm`` says its
copy was issued; the next plan forgets it otherwise, and ``forget`` drops loads whose copies did not all happen, so
an interrupt anywhere (inside a plan too) never leaves a slot marked with an expert it does not hold.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from .policies import LRU, Policy


@dataclass(frozen=True)
class FetchPlan:
    hits: tuple[tuple[int, int], ...]  # (expert, slot)
    loads: tuple[tuple[int, int], ...]  # (expert, slot), in copy order
    streamed: tuple[int, ...]  # experts copied through scratch, not admitted
    evicted: tuple[int, ...]  # experts that lost their slot to a load

    @property
    def misses(self) -> int:
        return len(self.loads) + len(self.streamed)


class SlotBook:
    """Which expert sits in which of ``num_slots`` slots, least recently used first, and the ``policy`` that picks
    victims (``policies.LRU`` when not given).

    >>> book = SlotBook(num_slots=2, num_experts=8)
    >>> book.plan([3, 5]).loads          # both miss, slots 0 and 1 are free
    ((3, 0), (5, 1))
    >>> p = book.plan([5, 6])            # 5 hits; 6 evicts 3, the least recently used
    >>> p.hits, p.loads, p.evicted
    (((5, 1),), ((6, 0),), (3,))
    >>> book.plan([1, 2, 4]).streamed    # 3 needed, 2 slots: the third is streamed through scratch
    (4,)
    """

    def __init__(self, num_slots: int, num_experts: int, policy: Policy | None = None):
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots must be in 1..{num_experts} (the number of experts), got {num_slots}")
        self.num_slots = num_slots
        self.num_experts = num_experts
        self.policy = policy if policy is not None else LRU(num_experts)
        if self.policy.num_experts != num_experts:
            raise ValueError(f"the policy tracks {self.policy.num_experts} experts, the slots {num_experts}")
        self._order: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        # loads planned whose copies have not been confirmed as issued: forgotten by the next plan unless confirmed
        # (an interrupt between a plan and its copies must not leave a slot marked with an expert it never got)
        self._unconfirmed: set[int] = set()

    def slot_of(self, expert: int) -> int | None:
        return None if expert in self._unconfirmed else self._order.get(expert)

    @property
    def resident(self) -> dict[int, int]:
        """expert -> slot, least recently used first (loads not yet confirmed excluded)."""
        if self._unconfirmed:
            return {e: s for e, s in self._order.items() if e not in self._unconfirmed}
        return dict(self._order)

    def score(self, expert: int) -> float:
        """How likely ``expert`` is to be needed soon, as the policy judges it now: the value it evicts the lowest
        of (resident or not; in the policy's own units, so compare scores of one layer only). Cheap: a few list
        reads, no change to any state."""
        return self.policy.score(expert, self._order)

    def admits(self, expert: int) -> bool:
        """Whether a slot pays for a miss of ``expert`` in the next forward, were no slot needed by that forward: a
        free slot, or a resident the policy ranks below ``expert`` once this use is counted (LRU: always). A copy
        into a slot may pay for itself later; for the others a host lane may compute them where they are (a
        policy with ``bypass`` streams them)."""
        return bool(self._free) or self.policy.admits(expert, self._order)

    def expect(self, forecast: Sequence[float] | None) -> None:
        """A forecast for the next plan: per expert, how many of the coming tokens are expected to need it (e.g.
        the drafted tree's predicted routes weighted by their path values); None: no forecast. Read by policies
        that use one (``policies.FORECAST``), consumed by the next plan."""
        self.policy.expect(forecast)

    def clear(self) -> None:
        """Empty every slot and forget what the policy learned."""
        self._order.clear()
        self._unconfirmed.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.policy.reset()

    def plan(self, needed: Iterable[int], confirmed: bool = True, uses: Sequence[int] | None = None) -> FetchPlan:
        """Assign slots for one forward's ``needed`` experts (distinct ids) and update the recency order and the
        policy's record. ``uses``: per needed expert, how many of the forward's tokens route to it (None: one
        each). With ``confirmed=False`` the loads are resident only once ``confirm`` says their copies were issued:
        the next plan forgets them otherwise (what the slot cache uses, so an interrupt cannot leave a stale mark)."""
        if not isinstance(needed, list):
            needed = list(needed)
        if len(set(needed)) != len(needed):
            raise ValueError(f"needed experts must be distinct, got {needed}")
        if needed and (min(needed) < 0 or max(needed) >= self.num_experts):
            bad = next(e for e in needed if not 0 <= e < self.num_experts)
            raise ValueError(f"expert id {bad} out of range 0..{self.num_experts - 1}")
        if uses is not None and len(uses) != len(needed):
            raise ValueError(f"uses must give one count per needed expert ({len(needed)}), got {len(uses)}")
        if self._unconfirmed or len(self._free) + len(self._order) != self.num_slots:
            self._recover()
        order = self._order
        hits, misses = [], []
        for e in needed:
            slot = order.get(e)
            if slot is None:
                misses.append(e)
            else:
                order.move_to_end(e)
                hits.append((e, slot))
        policy = self.policy
        policy.observe(needed, uses)
        loads, streamed, evicted = [], [], []
        if misses:
            misses = policy.admission(misses)
            free = self._free
            first = len(free)  # the misses from here on find no free slot: each evicts its victim, or is streamed
            victims = policy.victims(order, {e for e, _ in hits}, misses[first:]) if len(misses) > first else ()
            for i, e in enumerate(misses):  # (slots taken inline: this runs for every layer of every forward)
                if free:
                    slot = free.pop()
                else:
                    victim = victims[i - first]
                    if victim is None:
                        streamed.append(e)
                        continue
                    evicted.append(victim)
                    slot = order.pop(victim)  # an interrupt from here to the mark below: _recover frees the slot
                if not confirmed:
                    self._unconfirmed.add(e)  # before the slot is marked: an interrupt in between leaves nothing stale
                order[e] = slot
                loads.append((e, slot))
        policy.planned()
        return FetchPlan(tuple(hits), tuple(loads), tuple(streamed), tuple(evicted))

    def confirm(self, experts: Iterable[int]) -> None:
        """The copies of these planned loads have been issued: they are resident."""
        self._unconfirmed.difference_update(experts)

    def forget(self, experts: Iterable[int]) -> None:
        """Mark ``experts`` as not resident and free their slots (a plan whose copies did not all happen)."""
        for e in experts:
            self._unconfirmed.discard(e)
            slot = self._order.pop(e, None)
            if slot is not None:
                self._free.append(slot)

    def _recover(self) -> None:
        """After an interrupted plan: drop unconfirmed loads and rebuild the free list from what is assigned."""
        for e in list(self._unconfirmed):
            self._order.pop(e, None)
        self._unconfirmed.clear()
        used = set(self._order.values())
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]
