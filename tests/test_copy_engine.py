"""The copy engine's CUDA ordering, run on a CPU with fake streams and events.

``FakeDevice`` stands in for ``cache.CudaStreams`` (and ``FakePinning`` for ``store.CudaHostPinning``): every copy,
event record and wait is queued on its stream and runs only when the fake device is run, one queued operation at a
time, the stream chosen at random among those whose next operation may run (a wait runs once its event has fired).
Compute is modelled by the tests as reads queued on the compute stream that check the slot holds the expert they
expect. So a missing ordering step (read after write, write after read, write after write) shows as a wrong read for
some schedule; a copy that depends on work that never runs (a stalled stream) shows as a deadlock.
"""

import gc
import random
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from specfit.offload.cache import CopyEngine, LayerCache
from specfit.offload.config import OffloadConfig
from specfit.offload.runtime import SpecFitRuntime
from specfit.offload.store import ExpertStore
from specfit.stats import Counters

COPY_MS = 1.0  # fake time one copy occupies the link


class Deadlock(AssertionError):
    pass


class FakeMarker:
    def __init__(self):
        self.done, self.time = False, 0.0


class FakeEvent:
    def __init__(self, device, timing):
        self.device, self.timing, self.marker = device, timing, None

    def record(self, stream=None):
        stream = stream or self.device.current()
        self.marker = FakeMarker()
        stream.queue.append(("mark", self.marker))

    def query(self):
        return self.marker is None or self.marker.done

    def synchronize(self):
        self.device.run(until=self.query)
        self.device.now = max(self.device.now, self.marker.time if self.marker else 0.0)

    def elapsed_time(self, end):
        assert self.timing and end.timing and self.marker.done and end.marker.done
        return end.marker.time - self.marker.time


class TimedQueue(list):
    """A stream's queue that remembers the host's time when each operation was queued: work cannot start on the
    device before the host issued it (the host's time moves on when it waits for an event)."""

    def __init__(self, device):
        super().__init__()
        self.device, self.issued = device, []

    def append(self, op):
        super().append(op)
        self.issued.append(self.device.now)

    def pop(self, i=-1):
        self.issued.pop(i)
        return super().pop(i)


class FakeStream:
    def __init__(self, device, name):
        self.device, self.name, self.queue, self.clock = device, name, TimedQueue(device), 0.0
        self.tied: list[tuple[int, int]] = []  # (start, end) byte ranges of buffers tied to this stream

    def wait_event(self, event):
        if event.marker is not None:  # waiting on an event never recorded is a no-op, as in CUDA
            self.queue.append(("wait", event.marker))

    def wait_stream(self, other):
        event = FakeEvent(self.device, False)
        event.record(other)
        self.wait_event(event)

    def query(self):
        return not self.queue

    def synchronize(self):
        self.device.run(until=self.query)

    def runnable(self):
        return bool(self.queue) and (self.queue[0][0] != "wait" or self.queue[0][1].done)

    def step(self):
        self.clock = max(self.clock, self.queue.issued[0])
        op = self.queue.pop(0)
        if op[0] == "wait":
            self.clock = max(self.clock, op[1].time)
        elif op[0] == "mark":
            op[1].done, op[1].time = True, self.clock
        elif op[0] == "copy":  # one host-to-device link: copies of all streams take turns on it
            op[1].copy_(op[2])
            self.clock = self.device.link_free = max(self.clock, self.device.link_free) + COPY_MS
            self.device.copies_done.append((self.name, op[3]))
            self.device.history.append(("copy", op[1].data_ptr()))
        else:  # "call": compute, queued by a test
            op[1]()
            self.device.history.append(("call", getattr(op[1], "__name__", "")))


class FakeDevice:
    """The ``CudaStreams`` interface over fake streams; ``stalled`` streams never run."""

    def __init__(self, seed=0):
        self.rng = random.Random(seed)
        self.compute = FakeStream(self, "compute")
        self._current = self.compute
        self.streams = [self.compute]
        self.stalled: set[str] = set()
        self.timing_events = self.plain_events = 0
        self.copies_done: list[tuple[str, str]] = []  # (stream, tag) in the order they ran
        self.history: list[tuple[str, object]] = []  # ("copy", destination pointer) / ("call", name), in run order
        self.now = 0.0  # the host's time: what the events it has waited for have shown it
        self.link_free = 0.0  # when the link finishes the copy it is on

    # the CudaStreams interface
    def new_stream(self, priority):
        stream = FakeStream(self, "demand" if priority < 0 else "prefetch")
        self.streams.append(stream)
        return stream

    def current(self):
        return self._current

    def event(self, timing=False):
        if timing:
            self.timing_events += 1
        else:
            self.plain_events += 1
        return FakeEvent(self, timing)

    @contextmanager
    def on(self, stream):
        saved, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = saved

    def copy(self, dst, src):
        stream = self._current
        start = dst.data_ptr()
        if not any(a <= start and start + dst.numel() * dst.element_size() <= b for a, b in stream.tied):
            raise AssertionError(f"a copy on the {stream.name} stream writes a buffer not tied to that stream: "
                                 f"freed early, its memory could be reused while the copy is in flight")
        stream.queue.append(("copy", dst, src, self.tag))

    def tie(self, tensor, stream):
        base = tensor.untyped_storage().data_ptr()
        stream.tied.append((base, base + tensor.untyped_storage().nbytes()))

    def synchronize(self):
        self.run()

    # for tests
    tag = ""

    def compute_call(self, fn):
        self.compute.queue.append(("call", fn))

    def pending_copies(self):
        return [op for s in self.streams for op in s.queue if op[0] == "copy"]

    def run(self, until=None, steps=None):
        """Run queued work in a random order allowed by the waits until ``until()`` holds (or ``steps`` ops ran, or
        nothing is left); a condition that can no longer come true is a deadlock."""
        n = 0
        while until is None or not until():
            if steps is not None and n >= steps:
                return
            ready = [s for s in self.streams if s.name not in self.stalled and s.runnable()]
            if not ready:
                if until is None and not any(s.queue for s in self.streams if s.name not in self.stalled):
                    self.now = max([self.now, self.link_free] + [s.clock for s in self.streams])  # time passed
                    return
                raise Deadlock(f"nothing can run; queued: {[(s.name, len(s.queue)) for s in self.streams]}")
            self.rng.choice(ready).step()
            n += 1


class FakePinning:
    """``CudaHostPinning`` on the CPU: ``fail_after`` registrations succeed, then they fail; unregistering memory that
    a queued copy still reads is an error."""

    def __init__(self, device: FakeDevice, fail_after=None):
        self.device, self.fail_after, self.registered = device, fail_after, {}

    def available(self):
        return True

    def register(self, ptr, nbytes):
        if self.fail_after is not None and len(self.registered) >= self.fail_after:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = nbytes
        return 0

    def unregister(self, ptr):
        end = ptr + self.registered.pop(ptr)
        reading = [op for op in self.device.pending_copies() if ptr <= op[2].data_ptr() < end]
        assert not reading, f"unregistered host memory that {len(reading)} queued copies still read"

    def synchronize(self):
        self.device.synchronize()


E, LAYERS, NUMEL = 12, 3, 8


def make_store(device=None, fail_after=None, layers=LAYERS):
    pinning = FakePinning(device or FakeDevice(), fail_after)
    store = ExpertStore(layers, E, 2, 2, torch.float32, pin=True, pinning=pinning)  # expert_numel = 3*2*2 = 12
    for layer, arena in enumerate(store.arenas):
        arena.copy_(torch.arange(E, dtype=torch.float32)[:, None] + 100 * layer)  # row e holds e + 100 * layer
    return store


def expert_of(buf: torch.Tensor, layer: int) -> int:
    values = buf - 100 * layer
    assert torch.all(values == values[0]), "a slot holds a mix of two experts"
    return int(values[0])


def run_forward(cache: LayerCache, needed, counters, device: FakeDevice, log: list):
    """Consume a layer's fetch like the experts function does, queueing one checking read per yielded expert."""
    seen = []
    for e, buf in cache.fetch(needed, counters):
        seen.append(e)

        def read(e=e, buf=buf, layer=cache.layer):
            log.append((layer, e, expert_of(buf, layer)))

        device.compute_call(read)
    assert sorted(seen) == sorted(needed)


def run_groups(cache: LayerCache, needed, counters, device: FakeDevice, log: list):
    """Consume a layer's experts as the experts function does (``start``, then ``ready`` group by group), queueing
    one checking read per expert of each group: of its slot, or of the streamed expert's scratch buffer."""
    seen = []
    fetch = cache.start(needed, counters)
    for group in cache.ready(fetch):
        bufs = [group.weights[0]] if group.weights is not None else [cache.slots[s] for s in group.slots]
        for e, buf in zip(group.experts, bufs):
            seen.append(e)

            def read(e=e, buf=buf, layer=cache.layer):
                log.append((layer, e, expert_of(buf, layer)))

            device.compute_call(read)
    assert sorted(seen) == sorted(needed)


CONSUMERS = {"fetch": run_forward, "groups": run_groups}


def caches(device, slots, store=None):
    store = store or make_store(device)
    engine = CopyEngine(torch.device("cpu"), streams=device)
    return store, engine, [LayerCache(store, i, slots, engine) for i in range(len(store.arenas))]


# --- stream ordering ----------------------------------------------------------------------------------------------
def test_demand_copies_do_not_queue_behind_prefetches():
    """Prefetches for every layer are queued; the next forward's layer-0 misses must land (and be computed on) with
    the prefetch stream stalled: they depend on no prefetch copy."""
    device = FakeDevice()
    store, engine, layers = caches(device, slots=8)
    total = Counters()
    for cache in layers:
        cache.prefetch([0, 1, 2, 3], total)
    assert len(device.pending_copies()) == 4 * LAYERS and total.prefetch_copies == 4 * LAYERS
    device.stalled.add("prefetch")
    log = []
    run_forward(layers[0], [5, 6, 7], Counters(), device, log)
    device.run(until=device.compute.query)  # raises Deadlock if a demand copy waits for a prefetch
    assert sorted(log) == [(0, e, e) for e in (5, 6, 7)]
    assert len(device.pending_copies()) == 4 * LAYERS  # every prefetch copy is still queued
    device.stalled.clear()
    device.run()
    assert {s for s, _ in device.copies_done[:3]} == {"demand"}


def test_a_single_copy_queue_would_deadlock_the_check():
    """The check above can fail: with demand copies on the prefetch stream, the stalled prefetches block them."""
    device = FakeDevice()
    store, engine, layers = caches(device, slots=8)
    engine.demand_stream = engine.prefetch_stream  # one FIFO queue for both, as before the split
    for cache in layers:
        cache.prefetch([0, 1, 2, 3], Counters())
    device.stalled.add("prefetch")
    run_forward(layers[0], [5, 6, 7], Counters(), device, [])
    with pytest.raises(Deadlock):
        device.run(until=device.compute.query)
    device.stalled.clear()
    device.run()  # leave nothing queued for the arenas' finalizer


@pytest.mark.parametrize("seed", range(20))
def test_a_demand_copy_into_a_slot_being_prefetched_lands_after_it(seed):
    device = FakeDevice(seed)
    store, engine, layers = caches(device, slots=2)
    cache = layers[0]
    cache.prefetch([0, 1], Counters())  # both slots: prefetches queued, not run
    log = []
    run_forward(cache, [4, 5], Counters(), device, log)  # evicts both prefetched experts, same slots
    device.run()
    assert sorted(log) == [(0, 4, 4), (0, 5, 5)]
    assert sorted(expert_of(cache.slots[s], 0) for s in range(2)) == [4, 5]  # no late prefetch overwrote them


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_every_read_sees_its_expert(seed, consumer):
    """Forwards, prefetches and clears at random, with the fake device run part way at random points: every read
    (hits, loads, prefetched hits, streamed experts) sees exactly the expert it asked for, whether the forward
    consumes the layer expert by expert (``fetch``) or group by group as the experts function does (``groups``)."""
    rng = random.Random(1000 + seed)
    device = FakeDevice(seed)
    store, engine, layers = caches(device, slots=rng.choice([1, 2, 3, 5]))
    log, reads = [], 0
    for _ in range(60):
        action = rng.random()
        layer = rng.randrange(LAYERS)
        if action < 0.6:
            needed = rng.sample(range(E), rng.randint(1, 7))
            CONSUMERS[consumer](layers[layer], needed, Counters(), device, log)
            reads += len(needed)
        elif action < 0.9:
            layers[layer].prefetch(rng.sample(range(E), rng.randint(1, layers[layer].num_slots)), Counters())
        else:
            layers[layer].clear(Counters())
        device.run(steps=rng.randint(0, 6))
    device.run()
    assert len(log) == reads > 100
    assert all(want == got for _, want, got in log)


def test_mutation_dropping_the_write_after_write_wait_is_caught():
    """Without the demand stream waiting for a pending prefetch into the slot it overwrites, some schedule lets the
    late prefetch clobber the demand copy: the checks above can fail."""
    caught = 0
    for seed in range(20):
        device = FakeDevice(seed)
        store, engine, layers = caches(device, slots=2)
        cache = layers[0]
        cache.prefetch([0, 1], Counters())
        cache._pending.clear()  # the mutation: forget the prefetch tickets
        run_forward(cache, [4, 5], Counters(), device, [])
        device.run()
        caught += sorted(expert_of(cache.slots[s], 0) for s in range(2)) != [4, 5]
    assert caught > 0


class _NoWait(dict):
    """The mutation of a hit not waiting for its prefetch: the pending ticket is never handed out."""

    def pop(self, key, default=None):
        return None


def test_mutation_hits_not_waiting_for_their_prefetch_is_caught():
    """Mutant (issue 24, 4): in the groups path, hits do not wait for a prefetch still in flight. Some schedule then
    reads a slot before its prefetched expert has landed."""
    caught = 0
    for seed in range(20):
        device = FakeDevice(seed)
        store, engine, layers = caches(device, slots=2)
        cache = layers[0]
        cache.prefetch([3, 4], Counters())
        log = []
        cache._pending = _NoWait(cache._pending)
        run_groups(cache, [3, 4], Counters(), device, log)  # both are hits of the prefetch
        try:
            device.run()
        except AssertionError:  # a read found a slot not yet written (a mix of old bytes)
            caught += 1
            for stream in device.streams:  # drop what is left, so the arenas' finalizer has nothing to wait for
                del stream.queue[:]
                stream.queue.issued.clear()
            continue
        caught += any(want != got for _, want, got in log)
    assert caught > 0


def test_hits_wait_for_their_prefetch_in_the_groups_path():
    for seed in range(20):
        device = FakeDevice(seed)
        store, engine, layers = caches(device, slots=2)
        cache = layers[0]
        cache.prefetch([3, 4], Counters())
        log = []
        run_groups(cache, [3, 4], Counters(), device, log)
        device.run()
        assert sorted(log) == [(0, 3, 3), (0, 4, 4)]


def scratch_copies_before_compute(seed, drop_first_use_wait=False) -> bool:
    """Whether a copy into the scratch ring ran before compute queued ahead of the ring's first use (that compute
    may still read the memory the ring was just given). The forward has no load, so no slot overwrite orders the
    copies after compute: only the ring's own first-use wait does."""
    device = FakeDevice(seed)
    store, engine, layers = caches(device, slots=1)
    cache = layers[0]
    run_groups(cache, [1], Counters(), device, [])  # expert 1 resident
    device.run()

    def earlier_compute():
        pass

    device.compute_call(earlier_compute)
    if drop_first_use_wait:  # the mutation: the fresh ring waits for nothing
        original = engine.mark_compute
        engine.mark_compute = lambda: None
        cache._scratch_buffer(0)
        engine.mark_compute = original
    run_groups(cache, [1, 2, 3, 4], Counters(), device, [])  # 1 hit, 3 streamed through the ring
    device.run()
    base = cache._scratch.data_ptr()
    span = cache._scratch.numel() * cache._scratch.element_size()
    first_compute = device.history.index(("call", "earlier_compute"))
    scratch = [i for i, (kind, ptr) in enumerate(device.history) if kind == "copy" and base <= ptr < base + span]
    return len(scratch) == 3 and scratch[0] < first_compute


def test_the_scratch_ring_first_use_waits_for_compute_queued_before_it():
    assert not any(scratch_copies_before_compute(seed) for seed in range(20))
    assert any(scratch_copies_before_compute(seed, drop_first_use_wait=True) for seed in range(20))


def test_a_load_over_a_slot_still_being_prefetched_does_not_hold_back_the_others():
    """Slot 0 is being prefetched (stalled); a forward loads one expert into free slot 1 and one over slot 0: the
    first lands and is computed on with the prefetch stream still stalled; the second lands after the prefetch."""
    device = FakeDevice()
    store, engine, layers = caches(device, slots=2)
    cache = layers[0]
    cache.prefetch([0], Counters())
    device.stalled.add("prefetch")
    fetch = cache.start([5, 6], Counters())  # 5 -> free slot 1; 6 evicts the prefetched 0 from slot 0
    assert dict(fetch.plan.loads) == {5: 1, 6: 0}
    device.run(until=lambda: len(device.copies_done) == 1)  # raises Deadlock if the clean load waits too
    assert device.copies_done == [("demand", "")] and expert_of(cache.slots[1], 0) == 5
    device.stalled.clear()
    log = []
    for group in cache.ready(fetch):
        for e, s in zip(group.experts, group.slots):
            device.compute_call(lambda e=e, s=s: log.append((e, expert_of(cache.slots[s], 0))))
    device.run()
    assert sorted(log) == [(5, 5), (6, 6)]


def late_load_compute(seed=0) -> list:
    """Slot 0 is being prefetched (stalled). A forward loads 5 into free slot 1 and 6 over slot 0 (a late load),
    queueing each group's compute as the experts function does; the device then runs with the prefetch stream still
    stalled. Returns the reads that ran (layer, expert, expert found in its slot) and the group kinds."""
    device = FakeDevice(seed)
    store, engine, layers = caches(device, slots=2)
    cache = layers[0]
    cache.prefetch([0], Counters())
    device.stalled.add("prefetch")
    fetch = cache.start([5, 6], Counters())
    assert dict(fetch.plan.loads) == {5: 1, 6: 0}
    log, kinds = [], []
    for group in cache.ready(fetch):
        kinds.append(group.kind)
        for e, slot in zip(group.experts, group.slots):
            device.compute_call(lambda e=e, slot=slot: log.append((e, expert_of(cache.slots[slot], 0))))
    device.run(until=lambda: log)  # raises Deadlock if the clean load's compute waits for the prefetch
    early = list(log)
    device.stalled.clear()
    device.run()
    assert sorted(log) == [(5, 5), (6, 6)] and expert_of(cache.slots[0], 0) == 6  # the late load landed last
    return early, kinds, [k for k, _, _ in fetch.groups]


@pytest.mark.parametrize("seed", range(5))
def test_a_late_load_does_not_hold_back_the_clean_loads_compute(seed):
    """Issue 29, 4: the late load is its own group, waited for after the clean loads' compute is queued (the
    compute stream is FIFO: one wait for every load ticket held the clean load's compute behind the prefetch)."""
    early, kinds, planned = late_load_compute(seed)
    assert early == [(5, 5)]
    assert kinds == planned == ["loads", "late"]


# --- failures -----------------------------------------------------------------------------------------------------
class Interrupt(BaseException):
    pass


def failing_copies(engine, after: int):
    """Make the engine's copies raise once ``after`` of them have run (as an interrupt mid-batch would)."""
    original, done = engine.copy_batch, [0]

    def copy_batch(pairs, counters, **kw):
        for i, pair in enumerate(pairs):
            if done[0] >= after:
                raise Interrupt()
            original([pair], counters, **kw)
            done[0] += 1
        return [None] * len(pairs)

    engine.copy_batch = copy_batch
    return original


@pytest.mark.parametrize("after", range(4))
def test_no_slot_stays_marked_with_an_expert_its_copy_did_not_bring(after):
    store = make_store(layers=1)
    engine = CopyEngine(torch.device("cpu"))
    cache = LayerCache(store, 0, 3, engine)
    original = failing_copies(engine, after)
    with pytest.raises(Interrupt):
        list(cache.fetch([4, 5, 6, 7], Counters()))  # 3 loads, 1 streamed
    engine.copy_batch = original
    for expert, slot in cache.lru.resident.items():
        assert expert_of(cache.slots[slot], 0) == expert, f"slot {slot} marked as expert {expert}"
    got = {e: expert_of(w, 0) for e, w in cache.fetch([4, 5, 6], Counters())}
    assert got == {4: 4, 5: 5, 6: 6}


def test_a_failed_prefetch_leaves_no_slot_marked_wrongly():
    store = make_store(layers=1)
    engine = CopyEngine(torch.device("cpu"))
    cache = LayerCache(store, 0, 3, engine)
    original = failing_copies(engine, 1)
    with pytest.raises(Interrupt):
        cache.prefetch([7, 8, 9], Counters())
    engine.copy_batch = original
    for expert, slot in cache.lru.resident.items():
        assert expert_of(cache.slots[slot], 0) == expert
    assert {e: expert_of(w, 0) for e, w in cache.fetch([7, 8, 9], Counters())} == {7: 7, 8: 8, 9: 9}


# --- teardown -----------------------------------------------------------------------------------------------------
def test_slot_and_scratch_buffers_are_tied_to_both_copy_streams():
    device = FakeDevice()
    store, engine, layers = caches(device, slots=2)
    run_forward(layers[0], [1, 2, 3, 4, 5], Counters(), device, [])  # 2 loads, 3 streamed through scratch
    layers[1].prefetch([7, 8], Counters())
    device.run()
    for cache in layers[:1]:
        for buf in (cache.slots, cache._scratch):
            base = buf.untyped_storage().data_ptr()
            assert all(any(a == base for a, _ in s.tied) for s in (engine.demand_stream, engine.prefetch_stream))
    untied = torch.empty(store.expert_numel)
    with pytest.raises(AssertionError, match="not tied"):  # the fake does check
        engine.copy_batch([(untied, store.arenas[0][0])], Counters())


def test_release_waits_for_copies_still_reading_the_arenas():
    device = FakeDevice()
    store, engine, layers = caches(device, slots=4)
    layers[2].prefetch([3, 4, 5], Counters())
    assert len(device.pending_copies()) == 3  # in flight at teardown
    store.release()  # FakePinning.unregister fails if a queued copy still reads an arena
    assert not device.pending_copies()
    assert [expert_of(layers[2].slots[s], 2) for s in range(3)] == [3, 4, 5]


def test_the_arena_finalizer_waits_for_copies_too():
    device = FakeDevice()
    store = make_store(device)
    pinning = store._pinning
    engine = CopyEngine(torch.device("cpu"), streams=device)
    dst = torch.empty(store.expert_numel)
    engine.adopt(dst)
    engine.copy_batch([(dst, store.arenas[1][6])], Counters())
    del store
    gc.collect()  # the finalizer unregisters: it must synchronize first
    assert not pinning.registered and not device.pending_copies() and expert_of(dst, 1) == 6


# --- counting -----------------------------------------------------------------------------------------------------
def test_a_pinning_failure_is_counted_on_every_pageable_copy():
    device = FakeDevice()
    with pytest.warns(RuntimeWarning, match="PAGEABLE.*pageable_copies"):
        store = make_store(device, fail_after=1)  # layer 0 pinned, layers 1 and 2 not
    assert [store.layer_pinned(i) for i in range(LAYERS)] == [True, False, False] and not store.is_pinned
    engine = CopyEngine(torch.device("cpu"), streams=device)
    rt = SpecFitRuntime(store, OffloadConfig(cache_slots=4), "cpu", engine=engine)
    rt.begin_forward()
    for layer in rt.layers:
        run_forward(layer.cache, [0, 1, 2], rt.forward_counters, device, [])
    rt.end_forward()
    c = rt.stats.last_forward
    assert c.misses == 9 and c.pageable_copies == 6  # layers 1 and 2
    rt.prefetch(np.eye(LAYERS, E, k=5, dtype=bool))  # one expert per layer
    assert rt.stats.total.pageable_copies == 6 + 2
    assert "pageable_copies=8" in repr(rt)


def test_copy_time_is_counted_where_the_copies_were_issued():
    """A forward's copies are timed in that forward (the last forward's too); prefetch bytes and time both go to the
    total, before the generate() call's figures are read: bytes / time is one bandwidth everywhere."""
    device = FakeDevice()
    store = make_store(device)
    rt = SpecFitRuntime(store, OffloadConfig(cache_slots=4), "cpu", engine=CopyEngine("cpu", streams=device))
    assert rt.stats.settle == rt.engine.drain
    expert_bytes = store.expert_bytes
    scope = rt.stats.begin_generate()
    forward = [[0, 1, 2], [0, 1], [3]]  # layer 0 needs these in three forwards: 3 misses, 0, then 1
    for i, needed in enumerate(forward):
        rt.begin_forward()
        for layer in rt.layers:
            run_forward(layer.cache, needed, rt.forward_counters, device, [])
        rt.end_forward()  # no device run in between: end_forward itself waits for this forward's copies
        c = rt.stats.last_forward
        assert c.copy_busy_seconds == pytest.approx(c.misses * COPY_MS / 1e3)
        assert c.bytes_copied == c.misses * expert_bytes
        if i == 0:
            rt.prefetch(np.eye(LAYERS, E, k=8, dtype=bool))  # expert 8 of each layer; no forward uses them
            device.run()  # they land while the host drafts: no demand copy shares the link with them
    scope.end(new_tokens=2)
    g = rt.stats.last_generate
    assert g.prefetch_copies == LAYERS and g.misses == (0 + 1) * LAYERS
    assert g.bytes_copied == (g.misses + g.prefetch_copies) * expert_bytes
    assert g.copy_busy_seconds == pytest.approx((g.misses + g.prefetch_copies) * COPY_MS / 1e3)
    assert g.copy_bandwidth == pytest.approx(expert_bytes / (COPY_MS / 1e3))
    assert rt.stats.last_prefill.copy_busy_seconds == pytest.approx(3 * LAYERS * COPY_MS / 1e3)
    assert not engine_pending(rt.engine)


def test_overlapping_demand_and_prefetch_copies_count_the_link_time_once():
    """Demand and prefetch copies in flight together share the one link: summing both batches' spans would count
    the shared time twice (copy time above the wall time, bandwidth below the link's). The total is the union."""
    device = FakeDevice(3)
    store = make_store(device)
    rt = SpecFitRuntime(store, OffloadConfig(cache_slots=4), "cpu", engine=CopyEngine("cpu", streams=device))
    rt.prefetch(np.eye(LAYERS, E, k=8, dtype=bool) | np.eye(LAYERS, E, k=9, dtype=bool))  # 2 per layer, in flight
    rt.begin_forward()
    for layer in rt.layers:
        run_forward(layer.cache, [0, 1], rt.forward_counters, device, [])  # 2 misses per layer
    rt.end_forward()
    rt.engine.drain()
    t = rt.stats.total
    assert t.copies == 4 * LAYERS
    assert t.copy_busy_seconds == pytest.approx(4 * LAYERS * COPY_MS / 1e3)  # the link was busy this long, once
    assert t.copy_bandwidth == pytest.approx(store.expert_bytes / (COPY_MS / 1e3))


def engine_pending(engine):
    return engine._timings


def test_one_timing_event_pair_per_batch_of_copies():
    """One event pair per batch and no event per copy: compute waits for the batch's end (one wait_event)."""
    device = FakeDevice()
    store, engine, layers = caches(device, slots=6)
    epoch = device.timing_events  # the engine's one clock origin
    run_forward(layers[0], [0, 1, 2, 3, 4], Counters(), device, [])  # 5 loads: one batch
    assert epoch == 1 and device.timing_events == epoch + 2 and device.plain_events == 0
    layers[1].prefetch([0, 1, 2], Counters())
    assert device.timing_events == epoch + 4


def test_decode_clock_starts_after_the_prefill_has_run():
    from specfit.stats import Stats

    settled = []
    stats = Stats(settle=lambda: settled.append(__import__("time").perf_counter()))
    scope = stats.begin_generate()
    stats.forward_done(Counters(forwards=1))  # the prefill's forward
    assert len(settled) == 1 and scope.t_prefill >= settled[0]
    stats.forward_done(Counters(forwards=1))  # later forwards: no wait
    assert len(settled) == 1
    scope.prefill_done()  # the loop, after the prefill's lm_head: waits again and restarts the clock
    assert len(settled) == 2 and scope.t_prefill >= settled[1]
    scope.end(new_tokens=1, autoregressive=True)
    assert len(settled) == 3 and stats.last_prefill.forwards == 1 and stats.last_generate.forwards == 1
