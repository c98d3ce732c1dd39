"""Device side of the offload: per MoE layer, N expert slots with LRU eviction, and the copies that fill them.

Bookkeeping (which expert sits in which slot) is ``lru.LRUSlots``; this file only moves bytes and counts them.
``LayerCache.fetch`` is a generator: it yields resident experts first, then each loaded expert as its copy lands,
then experts streamed through a two-buffer scratch ring when the layer needs more experts than it has slots. On
CUDA every copy runs on a dedicated copy stream and compute waits, per expert, only on that expert's event. On a
CPU "device" a copy is a memcpy; an optional emulated link makes each copy cost a set time.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from ..stats import Counters
from .link import EmulatedLink
from .lru import LRUSlots
from .store import ExpertStore


class CopyEngine:
    """How bytes move host -> device for every layer: one CUDA copy stream, a memcpy, or an emulated link."""

    def __init__(self, device: torch.device, link: EmulatedLink | None = None):
        self.device = device
        self.link = link
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, counters: Counters, after=None):
        """Start one copy (after CUDA event ``after``, if given); return a ticket for ``wait``."""
        counters.bytes_copied += src.numel() * src.element_size()
        if self.stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                if after is not None:
                    self.stream.wait_event(after)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
            self._timings.append((start, end))
            return end
        t0 = time.perf_counter()
        dst.copy_(src)
        counters.copy_seconds += time.perf_counter() - t0
        if self.link is not None:
            return self.link.issue(src.numel() * src.element_size())
        return None

    def wait(self, ticket, counters: Counters) -> None:
        if ticket is None:
            return
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket)
        else:
            counters.copy_seconds += self.link.wait(ticket)

    def mark_compute(self):
        """An event on the compute stream marking the work queued so far (CUDA), else None."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def before_overwrite(self) -> None:
        """Slots about to be overwritten may still be read by compute already queued: make copies wait for it."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        """Wait for every copy in flight (before slots or arenas are freed)."""
        if self.stream is not None:
            self.stream.synchronize()

    def harvest(self, counters: Counters) -> None:
        """Add the copy-engine time of finished CUDA copies (no synchronisation: unfinished ones wait)."""
        pending = []
        for start, end in self._timings:
            if end.query():
                counters.copy_seconds += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end))
        self._timings = pending


class LayerCache:
    def __init__(self, store: ExpertStore, layer: int, num_slots: int, engine: CopyEngine):
        self.store, self.layer, self.engine = store, layer, engine
        self.lru = LRUSlots(num_slots, store.num_experts)
        device, dtype = engine.device, store.dtype
        self.slots = torch.empty(num_slots, store.expert_numel, dtype=dtype, device=device)  # [N, 3IH]
        self._scratch: torch.Tensor | None = None  # [2, 3IH], allocated on first overflow
        self._scratch_free: list = [None, None]  # CUDA events: compute finished with each scratch buffer
        self._pending: dict[int, object] = {}  # slot -> ticket of a prefetch copy no forward has waited on yet
        self._prefetched: set[int] = set()  # experts prefetched since the last forward

    @property
    def num_slots(self) -> int:
        return self.lru.num_slots

    def clear(self, counters: Counters | None = None) -> None:
        self.lru.clear()
        self._pending.clear()
        if counters is not None:
            counters.prefetch_wasted += len(self._prefetched)
        self._prefetched.clear()

    def prefetch(self, experts: list[int], counters: Counters) -> None:
        """Copy the non-resident ``experts`` into slots now (LRU eviction; none are streamed) without waiting."""
        plan = self.lru.plan(experts)
        if plan.loads:
            self.engine.before_overwrite()
        arena = self.store.arenas[self.layer]
        for e, slot in plan.loads:
            before = counters.bytes_copied
            self._pending[slot] = self.engine.copy(self.slots[slot], arena[e], counters)
            counters.prefetch_bytes += counters.bytes_copied - before
            counters.prefetch_copies += 1
            self._prefetched.add(e)

    def fetch(self, needed: list[int], counters: Counters) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (expert, flat device weights [3IH]) for every needed expert; count demand, hits and copies."""
        arena = self.store.arenas[self.layer]
        plan = self.lru.plan(needed)
        if self._prefetched:  # wasted: prefetched, but not a hit of this forward (unneeded, or evicted meanwhile)
            counters.prefetch_wasted += len(self._prefetched - {e for e, _ in plan.hits})
            self._prefetched.clear()
        counters.demand += len(needed)
        counters.hits += len(plan.hits)
        counters.misses += plan.misses
        counters.streamed += len(plan.streamed)
        if plan.loads:
            self.engine.before_overwrite()
        tickets = [self.engine.copy(self.slots[slot], arena[e], counters) for e, slot in plan.loads]
        for e, slot in plan.hits:
            ticket = self._pending.pop(slot, None)  # a prefetched expert: its copy may still be in flight
            if ticket is not None:
                self.engine.wait(ticket, counters)
            yield e, self.slots[slot]
        for slot in (s for _, s in plan.loads):
            self._pending.pop(slot, None)  # overwritten: the old prefetch is moot (copies are ordered)
        for (e, slot), ticket in zip(plan.loads, tickets):
            self.engine.wait(ticket, counters)
            yield e, self.slots[slot]
        for i, e in enumerate(plan.streamed):
            buf = self._scratch_buffer(i % 2)
            self.engine.wait(self.engine.copy(buf, arena[e], counters, after=self._scratch_free[i % 2]), counters)
            yield e, buf
            # resumed: the compute reading `buf` is queued, so the copy after next may overwrite it once this fires
            self._scratch_free[i % 2] = self.engine.mark_compute()

    def _scratch_buffer(self, i: int) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(2, self.store.expert_numel, dtype=self.store.dtype, device=self.engine.device)
        return self._scratch[i]
