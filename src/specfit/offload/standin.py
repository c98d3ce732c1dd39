"""A CPU stand-in for the CUDA runtime, so that the code only a GPU would run is run by every CPU test run.

With ``SPECFIT_CUDA_STANDIN=1`` in the environment, a runtime on a CPU device takes the CUDA runtime's flow
(``runtime.cuda`` is True): ``cold="auto"`` is the default, the real host lane (``host_compute.ThreadedLane``, its
worker thread) computes host experts, the link and the lane are measured once at ``enable``, the copy engine runs on
two copy streams with timing events, index lists go through the pinned staging ring, calibrate probes the real link
and the real lane. Only the CUDA calls themselves are doubles, at the seams the code already has:

- ``Streams`` (``cache.CudaStreams``) and ``Copies`` (``transfer.CudaCopies``): streams and events that keep CUDA's
  ordering rules. Work on the compute stream runs at once (a CPU computes eagerly); a copy on another stream is
  *queued* and runs only when something waits for it: an event or stream the compute stream waits on, a host
  synchronize. So compute that reads a slot without waiting for its copy reads the old bytes, as on a GPU, and a test
  sees it. A copy into a buffer not tied to its stream (``record_stream``), ``elapsed_time`` on events not both
  recorded with timing, and a wait that can never be met (a deadlock) raise.
- ``HostCopies`` (``host_compute.HostCopies``): the lane's pinned result buffers and their copy to the device.
- ``Pinning`` (``store.CudaHostPinning``): arenas "registered" in place; ``LEDGER`` records every register and
  release, so a test sees each arena released exactly once.

Nothing here is faster or slower than a CPU: times are the CPU's own (``time.perf_counter``).
"""

from __future__ import annotations

import os
import time
import weakref
from contextlib import contextmanager

import torch

from ..transfer import DOUBLES
from . import standin_device
from .standin_device import raw

ENV = "SPECFIT_CUDA_STANDIN"
LEDGER: list[tuple[str, int, int]] = []  # ("register" | "release", pointer, bytes), in order


def enabled() -> bool:
    """Whether the stand-in is on (``SPECFIT_CUDA_STANDIN=1``)."""
    return os.environ.get(ENV) == "1"


def active(device) -> bool:
    """Whether a runtime on ``device`` takes the CUDA flow on the stand-in: a CPU device (or the stand-in's own) with
    the stand-in on."""
    return enabled() and torch.device(device).type in ("cpu", standin_device.NAME)


def place(model, device) -> torch.device:
    """The device an enabled model computes on: ``device``, or with the stand-in on, for a CPU device, the stand-in's
    device (``standin_device``: distinct from the host, as a GPU is), where ``model``'s weights are moved."""
    if not active(device):
        return torch.device(device)
    target = standin_device.register()
    DOUBLES.setdefault(target.type, lambda on: Copies(Streams(), on))  # a staging ring made there: CUDA's flow
    model.to(target)
    return target


def unplace(model, device) -> None:
    """``disable``: a model the stand-in placed goes back to the host, where it was."""
    if standin_device.is_device(device):
        model.to("cpu")


class Marker:
    __slots__ = ("done", "time")

    def __init__(self):
        self.done, self.time = False, 0.0


class Event:
    """A CUDA event: ``record`` queues a marker on a stream; it fires when the stream's work before it has run."""

    def __init__(self, streams: "Streams", timing: bool = False):
        self.streams, self.timing, self.marker, self.stream = streams, timing, None, None

    def record(self, stream=None):
        self.stream = stream or self.streams.current()
        self.marker = Marker()
        self.stream.push(("mark", self.marker))

    def query(self) -> bool:
        return self.marker is None or self.marker.done  # never recorded: done, as in CUDA

    def synchronize(self) -> None:
        if self.marker is not None:
            self.stream.run_until(self.marker)

    def elapsed_time(self, end: "Event") -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_time needs two events created with enable_timing=True")
        if self.marker is None or end.marker is None or not (self.marker.done and end.marker.done):
            raise RuntimeError("elapsed_time on an event not recorded, or not yet completed (CUDA raises here)")
        return (end.marker.time - self.marker.time) * 1e3


class Stream:
    """A stream's queue. The compute stream runs its work as it is pushed; a copy stream when something waits."""

    def __init__(self, streams: "Streams", name: str, eager: bool = False):
        self.streams, self.name, self.eager = streams, name, eager
        self.queue: list[tuple] = []
        self.tied: list[tuple[int, int]] = []  # byte ranges of buffers tied to this stream (record_stream)
        self._running = False

    def push(self, op) -> None:
        self.queue.append(op)
        if self.eager:
            self.run()

    def wait_event(self, event: Event) -> None:
        if event.marker is not None:  # an event never recorded: no wait, as in CUDA
            self.push(("wait", event.marker, event.stream))

    def wait_stream(self, other: "Stream") -> None:
        event = Event(self.streams)
        event.record(other)
        self.wait_event(event)

    def query(self) -> bool:
        return not self.queue

    def synchronize(self) -> None:
        self.run()

    def run(self) -> None:
        while self.queue:
            self._step()

    def run_until(self, marker: Marker) -> None:
        while not marker.done:
            if not self.queue:
                raise AssertionError(f"deadlock: a wait on the {self.name} stream for a marker it never reaches")
            self._step()

    def _step(self) -> None:
        if self._running:
            raise AssertionError(f"deadlock: the {self.name} stream waits, through other streams, on itself")
        self._running = True
        try:
            op = self.queue.pop(0)
            if op[0] == "wait":
                op[2].run_until(op[1])
            elif op[0] == "mark":
                op[1].done, op[1].time = True, time.perf_counter()
            else:  # ("copy", dst, src): reads its source when it runs, as a DMA does
                op[1].copy_(op[2])
                self.streams.copies_run += 1
        finally:
            self._running = False


class Streams:
    """``cache.CudaStreams`` on the CPU (see the module's docstring)."""

    def __init__(self):
        self.compute = Stream(self, "compute", eager=True)
        self._current = self.compute
        self.created: list[Stream] = [self.compute]
        self.copies_run = 0

    def new_stream(self, priority: int = 0) -> Stream:
        stream = Stream(self, "demand" if priority < 0 else f"stream {len(self.created)}")
        self.created.append(stream)
        return stream

    def current(self) -> Stream:
        return self._current

    def event(self, timing: bool = False) -> Event:
        return Event(self, timing)

    @contextmanager
    def on(self, stream: Stream):
        saved, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = saved

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self._current
        start = raw(dst).data_ptr()
        end = start + dst.numel() * dst.element_size()
        if stream is not self.compute and not any(a <= start and end <= b for a, b in stream.tied):
            raise AssertionError(f"a copy on the {stream.name} stream writes a buffer not tied to that stream: freed "
                                 f"early, its memory could be reused while the copy is in flight")
        stream.push(("copy", dst, src))

    def tie(self, tensor: torch.Tensor, stream: Stream) -> None:
        storage = raw(tensor).untyped_storage()
        stream.tied.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    def synchronize(self) -> None:
        for stream in self.created:
            stream.run()


class Copies:
    """``transfer.CudaCopies`` on the CPU: the staging ring's host buffers, its copy to the device (on the compute
    stream: at once)."""

    def __init__(self, streams: Streams, device: torch.device):
        self.streams, self.device = streams, device
        self.pinned_buffers = 0

    def pinned(self, n: int) -> torch.Tensor:
        self.pinned_buffers += 1
        return torch.empty(n, dtype=torch.int64)

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        return src.to(self.device, copy=True)

    def event(self):
        streams = self.streams

        class _Event(Event):
            def record(self, stream=None):
                super().record(stream or streams.current())

        return _Event(streams)


class HostCopies:
    """``host_compute.HostCopies`` on the CPU: the lane's result buffer, and its copy to the "device"."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device
        self.buffers = self.copies = 0
        self._pinned: dict[int, weakref.ref] = {}  # storage pointer -> the buffer made there, while it lives

    def pinned_like(self, t: torch.Tensor) -> torch.Tensor:
        self.buffers += 1
        buffer = torch.empty(t.shape, dtype=t.dtype)
        self._pinned = {p: r for p, r in self._pinned.items() if r() is not None}
        self._pinned[buffer.untyped_storage().data_ptr()] = weakref.ref(buffer)
        return buffer

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Made by ``pinned_like`` (a CPU cannot page-lock: the double keeps the books), or registered by a store
        and not released since."""
        ptr = raw(t).untyped_storage().data_ptr()
        made = self._pinned.get(ptr)
        if made is not None and made() is not None:
            return True
        registered: dict[int, int] = {}
        for kind, start, n in LEDGER:
            if kind == "register":
                registered[start] = n
            else:
                registered.pop(start, None)
        return any(start <= ptr < start + n for start, n in registered.items())

    def to_device(self, pinned: torch.Tensor) -> torch.Tensor:
        self.copies += 1
        return pinned.to(self.device, copy=True)


class Pinning:
    """``store.CudaHostPinning`` on the CPU: registering succeeds and is recorded in ``LEDGER``, as is unregistering
    (an unknown or twice-released pointer raises)."""

    def __init__(self):
        self.registered: dict[int, int] = {}

    def available(self) -> bool:
        return True

    def register(self, ptr: int, nbytes: int) -> int:
        self.registered[ptr] = nbytes
        LEDGER.append(("register", ptr, nbytes))
        return 0

    def unregister(self, ptr: int) -> None:
        if ptr not in self.registered:
            raise AssertionError(f"unregistering {ptr:#x}, which is not registered")
        LEDGER.append(("release", ptr, self.registered.pop(ptr)))

    def synchronize(self) -> None:
        pass


class StandIn:
    """The doubles one runtime uses."""

    def __init__(self, device: torch.device):
        self.streams = Streams()
        self.copies = Copies(self.streams, device)
        self.host_copies = HostCopies(device)


def for_device(device) -> StandIn | None:
    """A fresh set of doubles for a runtime on ``device``, or None where it takes its own flow."""
    return StandIn(torch.device(device)) if active(device) else None
