"""LRU slot bookkeeping, the policy SpecFit started with: ``LRUSlots`` is a ``SlotBook`` (``slots.py``) whose policy
evicts the least recently used expert that the forward does not need (``policies.LRU``). Pure Python, no torch.
"""

from __future__ import annotations

from .policies import LRU
from .slots import FetchPlan, SlotBook

__all__ = ["FetchPlan", "LRUSlots"]


class LRUSlots(SlotBook):
    """``SlotBook`` with the LRU policy (its docstring's example is this class's)."""

    def __init__(self, num_slots: int, num_experts: int):
        super().__init__(num_slots, num_experts, LRU(num_experts))
