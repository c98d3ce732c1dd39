"""Device side of the offload: per MoE layer, N expert slots with LRU eviction, and the copies that fill them.

Bookkeeping (which expert sits in which slot) is ``lru.LRUSlots``; this file only moves bytes and counts them.
``LayerCache.fetch`` is a generator: it yields resident experts first, then each loaded expert as its copy lands,
then experts streamed through a two-buffer scratch ring when the layer needs more experts than it has slots.

What overlaps what, on CUDA. The experts function learns a layer's routes with one host sync, which drains the
compute stream, and only then asks for the layer's experts; so a layer's demand copies never overlap the compute of
earlier layers. They are issued together, as one batch on the *demand* copy stream, before any of the layer's
expert compute is enqueued: the hit experts' compute (and the compute of each loaded expert as soon as its own copy
has landed: compute waits per expert, on that expert's event) runs while the remaining misses copy. At decode (one
token) that compute is microseconds, so a layer's misses are essentially exposed. Prefetch copies (issued between
forwards, while the drafter runs) go on a second, *prefetch* stream: they start once the compute queued before them
has run (it may still read the slots they overwrite), then overlap drafting and the next forward; a forward's demand
copies are never queued behind them (they share the link instead; a demand copy waits for a prefetch only when it
overwrites the slot that prefetch is still filling, and compute only when it reads the expert a prefetch brings).

On a CPU "device" a copy is a memcpy; an optional emulated link (``link.py``) makes each copy cost a set time, one
copy after the other (one queue for demand and prefetch copies alike).
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from ..stats import Counters
from .link import EmulatedLink
from .lru import LRUSlots
from .store import ExpertStore


class CudaStreams:
    """The CUDA primitives the copy engine uses, in one small seam, so that a CPU test double (fake streams and
    events that queue work and run it in any order the recorded waits allow) can stand in for them."""

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self, priority: int):
        return torch.cuda.Stream(self.device, priority=priority)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # on the current stream: async from pinned memory

    def tie(self, tensor: torch.Tensor, stream) -> None:
        """Do not reuse ``tensor``'s memory, once it is freed, before the work queued on ``stream`` then is done."""
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class CopyEngine:
    """How bytes move host -> device for every layer: two CUDA copy streams (demand, prefetch), a memcpy, or an
    emulated link.

    Counted per batch of copies (see ``stats.Counters``): ``bytes_copied``; ``copy_busy_seconds``, the time the copy
    path spent on them (CUDA: one pair of timing events per batch, read by ``settle``); ``copy_wait_seconds``, host
    time blocked by them; ``pageable_copies``, CUDA copies from memory that is not pinned (synchronous: no overlap).
    """

    def __init__(self, device: torch.device, link: EmulatedLink | None = None, streams: CudaStreams | None = None):
        self.device = torch.device(device)
        self.link = link
        if streams is None and self.device.type == "cuda":
            streams = CudaStreams(self.device)
        if streams is not None and link is not None:
            raise ValueError("an emulated link is for CPU studies; with device streams the copies are real")
        self.streams = streams
        self.demand_stream = self.prefetch_stream = None
        if streams is not None:
            # priorities order kernels, not DMA: the split into two streams is what keeps demand copies from
            # queueing behind prefetches; the higher priority only helps when both are runnable
            self.demand_stream = streams.new_stream(priority=-1)
            self.prefetch_stream = streams.new_stream(priority=0)
        self._timings: list[tuple[object, object, Counters]] = []  # (start, end, counters) of unread batches

    @property
    def on_device(self) -> bool:
        return self.streams is not None

    def adopt(self, buffer: torch.Tensor) -> None:
        """Tie a device buffer that copies write to both copy streams: freed while a copy into it is still in flight
        (a model dropped mid-prefetch), its memory is not handed to a new tensor before that copy has landed."""
        if self.streams is not None:
            for stream in (self.demand_stream, self.prefetch_stream):
                self.streams.tie(buffer, stream)

    def copy_batch(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], counters: Counters, *,
                   prefetch: bool = False, pinned: bool = True, after=()) -> list:
        """Start the copies ``pairs`` [(dst, src)] in order, after every event in ``after`` (CUDA); return one ticket
        per copy for ``wait``. Demand copies go on the demand stream, ``prefetch`` ones on the prefetch stream."""
        if not pairs:
            return []
        t0 = time.perf_counter()
        counters.bytes_copied += sum(src.numel() * src.element_size() for _, src in pairs)
        if self.streams is None:
            tickets = [self._host_copy(dst, src, counters) for dst, src in pairs]
        else:
            tickets = self._device_copies(pairs, counters, prefetch, after)
            if not pinned:
                counters.pageable_copies += len(pairs)
        counters.copy_wait_seconds += time.perf_counter() - t0
        return tickets

    def _host_copy(self, dst: torch.Tensor, src: torch.Tensor, counters: Counters):
        t0 = time.perf_counter()
        dst.copy_(src)
        if self.link is None:
            counters.copy_busy_seconds += time.perf_counter() - t0
            return None
        nbytes = src.numel() * src.element_size()
        counters.copy_busy_seconds += self.link.config.copy_time(nbytes)
        return self.link.issue(nbytes)

    def _device_copies(self, pairs, counters: Counters, prefetch: bool, after) -> list:
        api = self.streams
        stream = self.prefetch_stream if prefetch else self.demand_stream
        for event in after:
            if event is not None:
                stream.wait_event(event)
        start, end = api.event(timing=True), api.event(timing=True)
        start.record(stream)
        tickets = []
        with api.on(stream):  # one stream switch per batch
            for i, (dst, src) in enumerate(pairs):
                api.copy(dst, src)
                ready = end if i == len(pairs) - 1 else api.event()  # the last copy's event is the batch's end
                ready.record(stream)
                tickets.append(ready)
        self._timings.append((start, end, counters))
        return tickets

    def wait(self, ticket, counters: Counters) -> None:
        """Compute that reads a copy's destination waits until it has landed (CUDA: the compute stream waits on the
        copy's event, the host does not block; CPU: the host sleeps until the emulated link delivers)."""
        if ticket is None:
            return
        if self.streams is not None:
            self.streams.current().wait_event(ticket)
        else:
            counters.copy_wait_seconds += self.link.wait(ticket)

    def mark_compute(self):
        """An event on the compute stream marking the work queued so far (CUDA), else None."""
        if self.streams is None:
            return None
        event = self.streams.event()
        event.record(self.streams.current())
        return event

    def before_overwrite(self, prefetch: bool = False) -> None:
        """Slots about to be overwritten may still be read by compute already queued: make the next copies on the
        demand (or prefetch) stream wait for it."""
        if self.streams is not None:
            stream = self.prefetch_stream if prefetch else self.demand_stream
            stream.wait_stream(self.streams.current())

    def settle(self, counters: Counters | None = None) -> None:
        """Add the copy-path time of finished batches to the counters they were issued for; first wait for every
        batch issued for ``counters`` (a forward's own copies: its last layer cannot finish before they land)."""
        pending = []
        for start, end, target in self._timings:
            if target is counters:
                end.synchronize()
            if end.query():
                target.copy_busy_seconds += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end, target))
        self._timings = pending

    def drain(self) -> None:
        """Wait for all device work (every copy in flight included) and count the time of every batch."""
        if self.streams is not None:
            self.streams.synchronize()
            self.settle()

    def close(self) -> None:
        """Wait for every copy in flight (before slots or arenas are freed)."""
        self.drain()


class LayerCache:
    def __init__(self, store: ExpertStore, layer: int, num_slots: int, engine: CopyEngine):
        self.store, self.layer, self.engine = store, layer, engine
        self.lru = LRUSlots(num_slots, store.num_experts)
        self.pinned = store.layer_pinned(layer)
        device, dtype = engine.device, store.dtype
        self.slots = torch.empty(num_slots, store.expert_numel, dtype=dtype, device=device)  # [N, 3IH]
        engine.adopt(self.slots)
        self._scratch: torch.Tensor | None = None  # [2, 3IH], allocated on first overflow
        self._scratch_free: list = [None, None]  # CUDA events: compute finished with each scratch buffer
        # slot -> ticket of a prefetch copy into it that no demand copy or hit has waited on yet; kept across
        # clear(): a later demand copy into the slot must still land after it
        self._pending: dict[int, object] = {}
        self._prefetched: set[int] = set()  # experts prefetched since the last forward

    @property
    def num_slots(self) -> int:
        return self.lru.num_slots

    def clear(self, counters: Counters | None = None) -> None:
        self.lru.clear()
        if counters is not None:
            counters.prefetch_wasted += len(self._prefetched)
        self._prefetched.clear()

    def prefetch(self, experts: list[int], counters: Counters) -> None:
        """Copy the non-resident ``experts`` into slots now (LRU eviction; none are streamed) without waiting, on
        the prefetch stream."""
        plan = self.lru.plan(experts)
        if not plan.loads:
            return
        self.engine.before_overwrite(prefetch=True)
        arena = self.store.arenas[self.layer]
        before = counters.bytes_copied
        tickets = self.engine.copy_batch([(self.slots[slot], arena[e]) for e, slot in plan.loads], counters,
                                         prefetch=True, pinned=self.pinned)
        for (e, slot), ticket in zip(plan.loads, tickets):
            self._pending[slot] = ticket  # after any earlier prefetch into the slot: one stream, in order
            self._prefetched.add(e)
        counters.prefetch_bytes += counters.bytes_copied - before
        counters.prefetch_copies += len(plan.loads)

    def fetch(self, needed: list[int], counters: Counters) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (expert, flat device weights [numel]) for every needed expert, one by one: each view is yielded
        once its own copy has landed (``fetch_groups`` batches them). Counts demand, hits and copies."""
        plan, tickets = self._start(needed, counters)
        for e, slot in plan.hits:
            self._wait_prefetch(slot, counters)
            yield e, self.slots[slot]
        for (e, slot), ticket in zip(plan.loads, tickets):
            self.engine.wait(ticket, counters)
            yield e, self.slots[slot]
        for e, buf in self._stream(plan.streamed, counters):
            yield e, buf

    def fetch_groups(self, needed: list[int], counters: Counters) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Yield (experts, device weights [n, numel]) in up to three kinds of group, so compute runs a few batched
        calls per group instead of a few per expert: the resident experts first (their compute overlaps the
        misses' copies), then every loaded expert once all loads have landed, then each streamed expert alone
        (through the two-buffer scratch ring). The weights are gathered after the waits (on CUDA: queued on the
        compute stream behind them). Counts demand, hits and copies."""
        plan, tickets = self._start(needed, counters)
        if plan.hits:
            for _, slot in plan.hits:
                self._wait_prefetch(slot, counters)
            yield [e for e, _ in plan.hits], self._gather([slot for _, slot in plan.hits])
        if plan.loads:
            for ticket in tickets:
                self.engine.wait(ticket, counters)
            yield [e for e, _ in plan.loads], self._gather([slot for _, slot in plan.loads])
        for e, buf in self._stream(plan.streamed, counters):
            yield [e], buf[None]

    def _start(self, needed: list[int], counters: Counters):
        """Plan one forward's experts, count them, and start the loads' copies; returns (plan, load tickets)."""
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
        # a load overwriting a slot that a prefetch is still filling must land after it (write after write)
        overwritten = [self._pending.pop(slot) for _, slot in plan.loads if slot in self._pending]
        tickets = self.engine.copy_batch([(self.slots[slot], arena[e]) for e, slot in plan.loads], counters,
                                         pinned=self.pinned, after=overwritten)
        return plan, tickets

    def _wait_prefetch(self, slot: int, counters: Counters) -> None:
        ticket = self._pending.pop(slot, None)  # a prefetched expert: its copy may still be in flight
        if ticket is not None:
            self.engine.wait(ticket, counters)

    def _stream(self, experts, counters: Counters) -> Iterator[tuple[int, torch.Tensor]]:
        arena = self.store.arenas[self.layer]
        for i, e in enumerate(experts):
            buf = self._scratch_buffer(i % 2)
            ticket, = self.engine.copy_batch([(buf, arena[e])], counters, pinned=self.pinned,
                                             after=(self._scratch_free[i % 2],))
            self.engine.wait(ticket, counters)
            yield e, buf
            # resumed: the compute reading `buf` is queued, so the copy after next may overwrite it once this fires
            self._scratch_free[i % 2] = self.engine.mark_compute()

    def _gather(self, slots: list[int]) -> torch.Tensor:
        """[n, numel] weights of the given slots: a view for one slot or a run of consecutive ones, else a copy."""
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return self.slots[first:first + len(slots)]
        return self.slots.index_select(0, torch.tensor(slots, device=self.slots.device))

    def _scratch_buffer(self, i: int) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(2, self.store.expert_numel, dtype=self.store.dtype, device=self.engine.device)
            self.engine.adopt(self._scratch)
        return self._scratch[i]
