"""LRU slot bookkeeping, the policy SpecFit started with: ``LRUSlots`` is a ``SlotBook`` (``slots.py``) whose policy
evicts the least recently used expert that the forward does not need (``policies.LRU``). Pure Python, no torch.
"""

from __future__ import annotations

from .policies import LRU
from .slots import FetchPlan, SlotBook

__all__ = ["FetchPlan", "LRUSlots"]


class LRUSlots(SlotBook):
    """``SlotBook`` with the LRU policy.

    >>> lru = LRUSlots(num_slots=2, num_experts=8)
    >>> lru.plan([3, 5]).loads          # both miss, slots 0 and 1 are free
    ((3, 0), (5, 1))
    >>> p = lru.plan([5, 6])            # 5 hits; 6 evicts 3, the least recently used
    >>> p.hits, p.loads, p.evicted
    (((5, 1),), ((6, 0),), (3,))
    """

    def __init__(self, num_slots: int, num_experts: int):
        super().__init__(num_slots, num_experts, LRU(num_experts))
