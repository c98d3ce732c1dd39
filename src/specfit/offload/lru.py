"""LRU bookkeeping for one layer's expert slots: pure Python, no torch.

Vocabulary: an expert is *resident* when a device slot holds its weights. For one forward the layer *needs* a set
of experts; each needed expert is a *hit* (resident), a *load* (copied into a slot, evicting the least recently
used expert that this forward does not need), or *streamed* (every slot already holds an expert this forward
needs, so it is copied through a scratch buffer and not kept). Loads and streamed experts are both *misses*, and
every miss is exactly one host-to-device copy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class FetchPlan:
    hits: tuple[tuple[int, int], ...]  # (expert, slot)
    loads: tuple[tuple[int, int], ...]  # (expert, slot), in copy order
    streamed: tuple[int, ...]  # experts copied through scratch, not admitted
    evicted: tuple[int, ...]  # experts that lost their slot to a load

    @property
    def misses(self) -> int:
        return len(self.loads) + len(self.streamed)


class LRUSlots:
    """Which expert sits in which of ``num_slots`` slots, least recently used first.

    >>> lru = LRUSlots(num_slots=2, num_experts=8)
    >>> lru.plan([3, 5]).loads          # both miss, slots 0 and 1 are free
    ((3, 0), (5, 1))
    >>> p = lru.plan([5, 6])            # 5 hits; 6 evicts 3, the least recently used
    >>> p.hits, p.loads, p.evicted
    (((5, 1),), ((6, 0),), (3,))
    >>> lru.plan([1, 2, 4]).streamed    # 3 needed, 2 slots: the third is streamed through scratch
    (4,)
    """

    def __init__(self, num_slots: int, num_experts: int):
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots must be in 1..{num_experts} (the number of experts), got {num_slots}")
        self.num_slots = num_slots
        self.num_experts = num_experts
        self._order: OrderedDict[int, int] = OrderedDict()  # expert -> slot, LRU first
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

    def clear(self) -> None:
        self._order.clear()
        self._unconfirmed.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def plan(self, needed: Iterable[int], confirmed: bool = True) -> FetchPlan:
        """Assign slots for one forward's ``needed`` experts (distinct ids) and update the LRU order. With
        ``confirmed=False`` the loads are resident only once ``confirm`` says their copies were issued: the next plan
        forgets them otherwise (what the slot cache uses, so an interrupt cannot leave a stale mark)."""
        needed = list(needed)
        if len(set(needed)) != len(needed):
            raise ValueError(f"needed experts must be distinct, got {needed}")
        for e in needed:
            if not 0 <= e < self.num_experts:
                raise ValueError(f"expert id {e} out of range 0..{self.num_experts - 1}")
        if self._unconfirmed or len(self._free) + len(self._order) != self.num_slots:
            self._recover()
        hits, misses = [], []
        for e in needed:
            slot = self._order.get(e)
            if slot is None:
                misses.append(e)
            else:
                self._order.move_to_end(e)
                hits.append((e, slot))
        in_use = {e for e, _ in hits}  # experts this forward reads: never evicted by it
        loads, streamed, evicted = [], [], []
        for e in misses:
            slot = self._take_slot(in_use, evicted)
            if slot is None:
                streamed.append(e)
                continue
            if not confirmed:
                self._unconfirmed.add(e)  # before the slot is marked: an interrupt in between leaves nothing stale
            self._order[e] = slot
            in_use.add(e)
            loads.append((e, slot))
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

    def _take_slot(self, in_use: set[int], evicted: list[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for victim in self._order:  # LRU first
            if victim not in in_use:
                evicted.append(victim)
                return self._order.pop(victim)
        return None
