"""Device side of the offload: per MoE layer, N expert slots with a replacement policy, and the copies that fill them.

Bookkeeping (which expert sits in which slot, and which one a load evicts) is ``slots.SlotBook`` with a policy of
``policies.py``; this file only moves bytes and counts them.
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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from ..stats.counters import Counters
from ..transfer import host_wait
from .link import EmulatedLink
from .policies import make_policy
from .slots import FetchPlan, SlotBook
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
        self._epoch = None  # CUDA: a timing event every batch is measured from, so batches share one clock
        if streams is not None:
            # priorities order kernels, not DMA: the split into two streams is what keeps demand copies from
            # queueing behind prefetches; the higher priority only helps when both are runnable
            self.demand_stream = streams.new_stream(priority=-1)
            self.prefetch_stream = streams.new_stream(priority=0)
            self._epoch = streams.event(timing=True)
            self._epoch.record(streams.current())
            host_wait(self._epoch, "copy clock start")  # once, at enable: every batch's time is then read on it
        # (start, end, counters, prefetch) of batches whose time is not read yet
        self._timings: list[tuple[object, object, Counters, bool]] = []
        self._demand_spans: list[tuple[float, float]] = []  # recent demand batches (ms since the epoch)
        self._host_batches: list[Counters] = []  # CPU: counters that copies were charged to since the last settle

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
        per copy for ``wait`` (CUDA: the batch's end event for each; the emulated link: each copy's landing time).
        Demand copies go on the demand stream, ``prefetch`` ones on the prefetch stream."""
        if not pairs:
            return []
        t0 = time.perf_counter()
        counters.bytes_copied += sum(src.numel() * src.element_size() for _, src in pairs)
        if self.streams is None:
            tickets = [self._host_copy(dst, src, counters) for dst, src in pairs]
            self._host_batches.append(counters)
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
        with api.on(stream):  # one stream switch per batch
            for dst, src in pairs:
                api.copy(dst, src)
        end.record(stream)  # one event per batch: compute waits for the batch, not copy by copy
        self._timings.append((start, end, counters, prefetch))
        return [end] * len(pairs)

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

    def barrier(self) -> None:
        """Order each copy stream behind everything already queued on the other (after a failed batch, whose copies
        may be partly issued: a later copy into one of its slots, on either stream, must land after them)."""
        if self.streams is not None:
            self.demand_stream.wait_stream(self.prefetch_stream)
            self.prefetch_stream.wait_stream(self.demand_stream)

    def settle(self, counters: Counters | None = None) -> None:
        """Add the copy-path time of finished batches to the counters they were issued for; first wait for every
        batch issued for ``counters`` (a forward's own copies: its last layer cannot finish before they land). One
        host wait when the forward copied (a CPU run reports it too: the same code waits there on CUDA)."""
        if self.streams is None:
            if counters is not None and any(c is counters for c in self._host_batches):
                host_wait(None, "settle")
            self._host_batches.clear()
            return
        last = [end for _, end, target, _ in self._timings if target is counters]
        if last:
            host_wait(last[-1], "settle")  # one host wait: a forward's batches share the FIFO demand stream
        finished = [t[1].query() for t in self._timings]  # once each: an event may land between two queries
        done = [t for t, f in zip(self._timings, finished) if f]
        self._timings = [t for t, f in zip(self._timings, finished) if not f]
        # demand batches first: a prefetch batch counts only the time no demand batch was copying (both streams
        # share the link; summing both would count the shared time twice, above wall time)
        for start, end, target, prefetch in sorted(done, key=lambda t: t[3]):
            a, b = self._epoch.elapsed_time(start), self._epoch.elapsed_time(end)  # ms
            if not prefetch:
                self._demand_spans = self._demand_spans[-255:] + [(a, b)]
                target.copy_busy_seconds += (b - a) / 1e3
                continue
            shared = sum(max(0.0, min(b, d1) - max(a, d0)) for d0, d1 in self._demand_spans)
            target.copy_busy_seconds += max(0.0, b - a - shared) / 1e3

    def drain(self) -> None:
        """Wait for all device work (every copy in flight included) and count the time of every batch."""
        host_wait(self.streams, "drain")  # a CPU run: reported only
        self.settle()

    def close(self) -> None:
        """Wait for every copy in flight (before slots or arenas are freed)."""
        self.drain()


@dataclass
class Group:
    """Experts whose weights are ready together, in the order a forward computes them: the hits (resident), then
    the loads (copied into slots for this forward), then the late loads (copied over slots a prefetch was still
    filling: they land after it), then each streamed expert alone (copied through scratch)."""

    kind: str  # "hits" | "loads" | "late" | "streamed"
    experts: list[int]
    slots: list[int] | None  # their rows of LayerCache.slots; None: `weights` holds them
    weights: torch.Tensor | None = None  # [n, numel] the streamed expert's scratch buffer


@dataclass
class Fetch:
    """One forward's experts for one layer, between ``LayerCache.start`` and the end of ``LayerCache.ready``."""

    plan: FetchPlan
    load_tickets: list  # tickets of the loads' copies, in plan.loads order
    scratch_tickets: list  # tickets of the first two streamed experts' copies (issued with the loads)
    counters: Counters  # the forward's counters: copies and waits are charged to them
    late: frozenset = frozenset()  # slots of the loads that overwrite a prefetch still in flight

    def loads(self, late: bool) -> list[tuple[tuple[int, int], object]]:
        """((expert, slot), ticket) of the clean loads, or of the ``late`` ones, in plan.loads order."""
        return [(load, t) for load, t in zip(self.plan.loads, self.load_tickets) if (load[1] in self.late) == late]

    @property
    def groups(self) -> list[tuple[str, list[int], list[int] | None]]:
        """(kind, experts, slots) of each group ``ready`` will yield, known before any of them is ready."""
        p = self.plan
        out = []
        if p.hits:
            out.append(("hits", [e for e, _ in p.hits], [s for _, s in p.hits]))
        for kind in ("loads", "late"):
            loads = [load for load, _ in self.loads(kind == "late")]
            if loads:
                out.append((kind, [e for e, _ in loads], [s for _, s in loads]))
        out += [("streamed", [e], None) for e in p.streamed]
        return out


class LayerCache:
    def __init__(self, store: ExpertStore, layer: int, num_slots: int, engine: CopyEngine, policy: str = "lru"):
        self.store, self.layer, self.engine = store, layer, engine
        # the slot bookkeeping (named for its first policy; ``policy`` names any of policies.py, the runtime passes
        # OffloadConfig.cache_policy)
        self.lru = SlotBook(num_slots, store.num_experts, make_policy(policy, store.num_experts))
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
        """Copy the non-resident ``experts`` into slots now (evicting as the policy says; none are streamed: those
        it would not give a slot are not copied) without waiting, on the prefetch stream."""
        plan = self.lru.plan(experts, confirmed=False)
        if not plan.loads:
            return
        before = counters.bytes_copied
        with self._undo_on_failure(plan):
            self.engine.before_overwrite(prefetch=True)
            tickets = self._copy(list(plan.loads), counters, prefetch=True)
            self.lru.confirm(e for e, _ in plan.loads)
        for (e, slot), ticket in zip(plan.loads, tickets):
            self._pending[slot] = ticket  # after any earlier prefetch into the slot: one stream, in order
            self._prefetched.add(e)
        counters.prefetch_bytes += counters.bytes_copied - before
        counters.prefetch_copies += len(plan.loads)

    def start(self, needed: list[int], counters: Counters, host: int = 0, uses: list[int] | None = None) -> Fetch:
        """Plan one forward's experts for this layer, count them, and start their copies: the loads, and the first
        two streamed experts (into the scratch ring) right behind them, so the link never idles while the hits
        compute. A load into a slot that a prefetch is still filling goes last, in its own batch, after that
        prefetch (write after write), so it delays no other copy of the layer, and ``ready`` yields it as its own
        group, so it delays no other load's compute. (It may delay a later layer's copies on the FIFO demand stream
        only in principle: the next layer's routes reach the host after this layer's compute, the late load's
        included, has run.) ``needed``: the experts computed on the device; ``host``: how many more the layer
        computes on the host lane this forward (counted here, in demand; they take no slot); ``uses``: the tokens
        routed to each needed expert (None: one each), for the cache policy."""
        plan = self.lru.plan(needed, confirmed=False, uses=uses)
        with self._undo_on_failure(plan):
            if self._prefetched:  # wasted: prefetched, but not a hit of this forward (unneeded, or evicted meanwhile)
                counters.prefetch_wasted += len(self._prefetched - {e for e, _ in plan.hits})
                self._prefetched.clear()
            counters.demand += len(needed) + host
            counters.host_experts += host
            counters.hits += len(plan.hits)
            counters.misses += plan.misses
            counters.streamed += len(plan.streamed)
            if plan.loads:
                self.engine.before_overwrite()
            clean = [(e, s) for e, s in plan.loads if s not in self._pending]
            late = [(e, s) for e, s in plan.loads if s in self._pending]
            tickets = dict(zip(clean, self._copy(clean, counters)))
            scratch = [self._stream_copy(j, e, counters) for j, e in enumerate(plan.streamed[:2])]
            tickets.update(zip(late, self._copy(late, counters, after=[self._pending.pop(s) for _, s in late])))
            self.lru.confirm(e for e, _ in plan.loads)
        return Fetch(plan, [tickets[load] for load in plan.loads], scratch, counters,
                     frozenset(s for _, s in late))

    def ready(self, fetch: Fetch) -> Iterator[Group]:
        """Yield the groups of ``fetch`` as they become ready to compute: the hits (after any prefetch still filling
        their slots), the loads (after their copies), the late loads (after theirs: the compute stream is FIFO, so
        waiting for them with the other loads would hold those back), then each streamed expert (its scratch copy
        landed; the copy two places later reuses its buffer once the compute reading it is queued)."""
        plan, counters = fetch.plan, fetch.counters
        if plan.hits:  # a prefetched expert's copy may still be in flight
            self._wait_all([self._pending.pop(slot, None) for _, slot in plan.hits], counters)
            yield Group("hits", [e for e, _ in plan.hits], [s for _, s in plan.hits])
        for kind in ("loads", "late"):
            loads = fetch.loads(kind == "late")
            if loads:
                self._wait_all([t for _, t in loads], counters)
                yield Group(kind, [e for (e, _), _ in loads], [s for (_, s), _ in loads])
        tickets = list(fetch.scratch_tickets)
        for i, e in enumerate(plan.streamed):
            self.engine.wait(tickets[i], counters)
            yield Group("streamed", [e], None, self._scratch[i % 2][None])
            # resumed: the compute reading this buffer is queued, so the copy two places later may overwrite it
            self._scratch_free[i % 2] = self.engine.mark_compute()
            if i + 2 < len(plan.streamed):
                tickets.append(self._stream_copy(i + 2, plan.streamed[i + 2], counters))

    def fetch_groups(self, needed: list[int], counters: Counters) -> Iterator[tuple[list[int], torch.Tensor]]:
        """(experts, device weights [n, numel]) group by group (``start`` + ``ready``; the slots gathered)."""
        for group in self.ready(self.start(needed, counters)):
            yield group.experts, group.weights if group.weights is not None else self.gather(group.slots)

    def fetch(self, needed: list[int], counters: Counters) -> Iterator[tuple[int, torch.Tensor]]:
        """(expert, flat device weights [numel]) one by one, each its slot's (or scratch buffer's) view, group by
        group as ``ready`` releases them."""
        for group in self.ready(self.start(needed, counters)):
            if group.weights is not None:
                yield group.experts[0], group.weights[0]
            else:
                yield from ((e, self.slots[slot]) for e, slot in zip(group.experts, group.slots))

    def gather(self, slots: list[int], index: torch.Tensor | None = None) -> torch.Tensor:
        """[n, numel] weights of the given slots: a view for one slot or a run of consecutive ones, else a copy
        through ``index`` (the slots as a device tensor, sent without a host sync; made here when not given)."""
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return self.slots[first:first + len(slots)]
        if index is None:
            index = torch.as_tensor(slots).to(self.slots.device, non_blocking=True)
        return self.slots.index_select(0, index)

    def _wait_all(self, tickets: list, counters: Counters) -> None:
        """Wait once for each distinct ticket (CUDA: a batch's end event stands for all its copies; the emulated
        link: the latest landing time stands for the earlier ones)."""
        tickets = [t for t in tickets if t is not None]
        if not tickets:
            return
        if isinstance(tickets[0], float):
            self.engine.wait(max(tickets), counters)
            return
        for ticket in {id(t): t for t in tickets}.values():
            self.engine.wait(ticket, counters)

    def _copy(self, loads: list[tuple[int, int]], counters: Counters, after=(), prefetch: bool = False) -> list:
        arena = self.store.arenas[self.layer]
        return self.engine.copy_batch([(self.slots[slot], arena[e]) for e, slot in loads], counters,
                                      prefetch=prefetch, pinned=self.pinned, after=after)

    def _stream_copy(self, i: int, expert: int, counters: Counters):
        buf = self._scratch_buffer(i % 2)
        ticket, = self.engine.copy_batch([(buf, self.store.arenas[self.layer][expert])], counters,
                                         pinned=self.pinned, after=(self._scratch_free[i % 2],))
        return ticket

    @contextmanager
    def _undo_on_failure(self, plan: FetchPlan):
        """Whatever fails between the plan and its copies (an interrupt, an OOM, a failed copy), no slot stays marked
        as holding an expert it may not hold: the plan's loads are forgotten (the next forward copies them again), and
        the copy streams are ordered behind what was already issued. (An interrupt that lands before this block is
        entered, or inside the plan itself, is covered by the LRU: loads count only once confirmed.)"""
        try:
            yield
        except BaseException:
            self.lru.forget([e for e, _ in plan.loads])
            for _, slot in plan.loads:
                self._pending.pop(slot, None)
            self.engine.barrier()
            raise

    def _scratch_buffer(self, i: int) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(2, self.store.expert_numel, dtype=self.store.dtype, device=self.engine.device)
            self.engine.adopt(self._scratch)
            # fresh memory may be what compute still queued was reading (freed, reused on the compute stream): the
            # first copies into it wait for that compute
            self._scratch_free = [self.engine.mark_compute()] * 2
        return self._scratch[i]
