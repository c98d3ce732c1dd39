"""Small host <-> device transfers that do not stop the host.

On CUDA, a Python list made into a device tensor (``torch.tensor(values, device=cuda)``, or a list used as an index)
is copied from pageable memory, and that copy blocks the host until the compute stream has drained: at batch 1 the
GPU then idles until the next launch. The decoding loop moves many small index lists (which rows, which slots, which
tree positions), so:

- ``Staging.to_device`` writes values into a pinned host buffer and sends them with one ``non_blocking`` copy,
  queued on the compute stream before the kernels that read them: the host goes on at once. Several arrays share one
  transfer (``to_device(a, b, c)``).
- ``to_host`` brings several device tensors to the host in one transfer: one sync instead of one per tensor.
- ``host_wait`` is the one way SpecFit blocks the host on device work (an event, a stream, the device): each wait is
  reported to the listening sync counters (``specfit.evaluation.syncs``), and a CPU run reports there the waits the
  same code makes on CUDA (``host_wait(None, ...)``), so every wait is counted on any device.

On a CPU "device" both are plain tensor/array conversions. The bottom layer: imports nothing of SpecFit's.
"""

from __future__ import annotations

import numpy as np
import torch

_RING = 8  # pinned buffers in rotation: one is rewritten only after its copy has run (checked by its event)
_CAPACITY = 4096  # int64 values per buffer to start with (32 KiB): grown when a prefill needs more


class CudaCopies:
    """The CUDA calls the staging ring makes, in one small seam, so that a CPU test double (a fake stream whose
    copies run only when the test lets them, tests/test_transfer.py) can stand in for them."""

    def __init__(self, device: torch.device):
        self.device = device

    def pinned(self, n: int) -> torch.Tensor:
        """A pinned host buffer of ``n`` int64 values."""
        return torch.empty(n, dtype=torch.int64, pin_memory=True)

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        """A device copy of ``src``, queued on the current stream (from pinned memory the host goes on at once)."""
        return src.to(self.device, non_blocking=True)

    def event(self):
        return torch.cuda.Event()


DOUBLES: dict = {}  # device type -> factory(device) of the CUDA calls' doubles (the CUDA stand-in registers its own)
GENERATORS: dict = {}  # device type -> factory(device) of a generator for draws there (the CUDA stand-in's own)


def device_generator(device) -> torch.Generator:
    """A random generator for draws on ``device``: torch's own for it (or the CUDA stand-in's for its device)."""
    make = GENERATORS.get(torch.device(device).type)
    return make(device) if make is not None else torch.Generator(device=device)


class Staging:
    """Pinned staging buffers for host -> device transfers of int64 values, on one device.

    A ring of ``_RING`` buffers: each transfer takes the next one, and a buffer is rewritten only after the copy out
    of it has run (its event, recorded after that copy, has fired; the host waits for it only when the ring came
    round first). ``cuda``: the CUDA calls it makes (``CudaCopies``; a test double in the tests)."""

    def __init__(self, device, cuda: CudaCopies | None = None):
        self.device = torch.device(device)
        double = DOUBLES.get(self.device.type)  # the CUDA stand-in's device: its doubles, as a runtime passes them
        if cuda is None and double is not None:
            cuda = double(self.device)
        self.pinned = self.device.type == "cuda" or cuda is not None  # (a CPU "device" given doubles: the stand-in)
        self._buffers: list[torch.Tensor | None] = [None] * _RING  # pinned int64 [capacity]
        self._events: list = [None] * _RING  # CUDA events: the copy out of each buffer has run
        self._next = 0
        self._cuda = cuda if cuda is not None else CudaCopies(self.device)  # makes no CUDA call until used
        if self.pinned:  # allocated up front: a decode allocates no pinned memory (unless a transfer outgrows them)
            self._buffers = [self._cuda.pinned(_CAPACITY) for _ in range(_RING)]

    def to_device(self, *arrays) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """int64 device tensors holding ``arrays`` (sequences of ints, or integer/bool NumPy arrays; shapes kept), in
        one transfer. Returns one tensor for one array, else a tuple."""
        host = [np.asarray(a, dtype=np.int64) for a in arrays]
        if not self.pinned:
            out = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in host)
            return out[0] if len(out) == 1 else out
        sizes = [a.size for a in host]
        total = max(1, sum(sizes))
        i = self._next
        self._next = (i + 1) % _RING
        event = self._events[i]
        if event is not None and not event.query():
            host_wait(event, "staging ring wait")  # rare: the ring came round before this buffer's copy ran
        buf = self._buffers[i]
        if buf is None or buf.numel() < total:
            buf = self._buffers[i] = self._cuda.pinned(max(total, 2 * buf.numel() if buf is not None else 0))
        view = buf.numpy()
        start = 0
        for a, n in zip(host, sizes):
            view[start:start + n] = a.reshape(-1)
            start += n
        flat = self._cuda.copy(buf[:total])  # one copy, ordered on the current stream
        if event is None:
            event = self._events[i] = self._cuda.event()
        event.record()
        out, start = [], 0
        for a, n in zip(host, sizes):
            out.append(flat[start:start + n].view(a.shape))
            start += n
        return out[0] if len(out) == 1 else tuple(out)


_listeners: list = []  # callables taking the wait's name: the sync counters now counting
_waiting = [0]  # > 0 while host_wait's own synchronize runs (a counter that also wraps torch's waits skips it)


def host_wait(waitable, what: str) -> None:
    """Block the host until ``waitable`` (anything with ``synchronize()``: a CUDA event or stream, the copy engine's
    streams) is done, and report the wait ``what`` to the listening counters. ``waitable`` None: a CPU run has
    nothing to wait for where CUDA would wait; only reported."""
    for listener in list(_listeners):
        listener(what)
    if waitable is None:
        return
    _waiting[0] += 1
    try:
        waitable.synchronize()
    finally:
        _waiting[0] -= 1


def in_host_wait() -> bool:
    return _waiting[0] > 0


def listen_host_waits(listener, stop: bool = False) -> None:
    """Start (or ``stop``) calling ``listener(what)`` at every ``host_wait``."""
    if stop:
        _listeners.remove(listener)
    else:
        _listeners.append(listener)


def to_host(*tensors: torch.Tensor, pack: bool = False) -> list[np.ndarray]:
    """NumPy copies of device tensors, moved in one transfer (one host sync). Each keeps its shape and dtype
    (NumPy dtypes only: cast bfloat16 on the device first). ``pack``: packed as on a device even on the CPU (the
    CUDA stand-in)."""
    if not tensors:
        return []
    if tensors[0].device.type == "cpu" and not pack:  # one read, as on a device (the would-be-sync counter sees one)
        first = tensors[0].detach().cpu()
        return [first.numpy()] + [t.detach().numpy() for t in tensors[1:]]
    # pack as bytes, widest items first so every NumPy view stays aligned
    order = sorted(range(len(tensors)), key=lambda j: -tensors[j].element_size())
    parts = [tensors[j].detach().contiguous().reshape(-1).view(torch.uint8) for j in order]
    packed = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
    out: list[np.ndarray | None] = [None] * len(tensors)
    start = 0
    for j, part in zip(order, parts):
        t = tensors[j]
        n = part.numel()
        dtype = torch.empty((), dtype=t.dtype).numpy().dtype
        out[j] = packed[start:start + n].view(dtype).reshape(tuple(t.shape))
        start += n
    return out


__all__ = ["Staging", "CudaCopies", "device_generator", "host_wait", "in_host_wait", "listen_host_waits", "to_host"]
