"""Counting the calls that would block the host on CUDA, on any device (a CPU run included).

At batch 1 a GPU decode is launch- and sync-bound: every call that makes the host wait for the device drains the
compute stream, and the GPU idles until the next launch. On CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` reports
them; on a CPU there is nothing to report, so ``WouldBeSyncs`` counts the calls that *would* synchronize if the same
code ran on CUDA, by what they are:

- a device tensor read on the host: ``.item()`` / ``int()`` / ``bool()`` / ``float()`` (``aten._local_scalar_dense``),
  ``.tolist()``, ``.cpu()``, ``torch.equal`` and ``torch.allclose`` (a bool on the host);
- ops whose output size is data-dependent: ``nonzero`` (boolean-mask indexing calls it too), ``masked_select``,
  ``unique`` / ``unique_consecutive``, ``repeat_interleave`` with tensor repeats and no ``output_size``, ``bincount``,
  ``histc`` (its range is read when not given);
- indexing a tensor with a host array, a Python list or tuple of ints or a NumPy array (``x[[1, 3]]``,
  ``x[np.array([1, 3])] = y``): it becomes a pageable host tensor, copied to the device synchronously;
- ``torch.tensor(data, device=...)`` / ``torch.as_tensor(data, device=...)`` from host data: the same copy (not
  for empty data: a copy of no bytes is skipped);
- host waits: ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``, ``torch.cuda.Stream.synchronize``, and
  every wait SpecFit makes through ``specfit.transfer.host_wait`` (the copy engine's ``settle`` and ``drain``, the
  staging ring's rare wait). On a CPU run SpecFit reports there the waits the same code makes on CUDA (a forward's
  ``settle`` when it copied experts, every ``drain``), so a CPU count includes them.

Not counted: copies from pinned memory with ``non_blocking=True`` (``specfit.transfer``'s path), device-side
indexing with device tensors, ``torch.arange``/``torch.full`` on the device, ``.to("cpu")`` and ``.to(device)`` of a
host tensor, and a host *tensor* used as an index into a device tensor (all ambiguous on a CPU run, where host and
device are one: write ``.cpu()`` for a device-to-host read, ``Staging.to_device`` for host-to-device). On CUDA, the
GPU check adds what ``torch.cuda.set_sync_debug_mode("warn")`` reports (stream synchronizes among them, but no event
wait or device synchronize) to the host waits counted here, less the stream synchronizes both would count.

>>> import torch
>>> x = torch.arange(6)
>>> with WouldBeSyncs() as syncs:
...     _ = x[[0, 2]]          # host-array index: 1
...     _ = int(x.sum())       # host read: 1
...     _ = x[x > 3]           # boolean mask -> nonzero: 1
...     _ = x[1:3]             # a view: 0
>>> syncs.total, sorted(syncs.by_kind)
(3, ['host read', 'host-array index', 'nonzero'])
"""

from __future__ import annotations

import traceback
from collections import Counter

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .. import transfer

_HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu"}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
             torch.Tensor.index_put}
_FROM_HOST = {torch.tensor, torch.as_tensor}
_MASKED = {torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_, torch.ops.aten._index_put_impl_}
aten = torch.ops.aten
# ops that read a result on the host (a bool), or size their output from the data (a device -> host read of it)
_DATA_SIZED = {aten.equal: "host read", aten.allclose: "host read", aten.nonzero: "nonzero",
               aten.masked_select: "masked_select", aten._unique2: "unique", aten._unique: "unique",
               aten.unique_dim: "unique", aten.unique_consecutive: "unique", aten.bincount: "bincount",
               aten.histc: "histc"}
# host waits called directly (SpecFit's own go through transfer.host_wait, which counts them once)
_WAITS = ((torch.cuda, "synchronize", "device synchronize"),
          (torch.cuda.Event, "synchronize", "event synchronize"),
          (torch.cuda.Stream, "synchronize", "stream synchronize"))


def _is_host_index(index) -> bool:
    """A Python list of ints or a NumPy array (or a tuple holding one) used as an index: copied to the device on
    CUDA."""
    if isinstance(index, (list, np.ndarray)):
        return True
    return isinstance(index, tuple) and any(isinstance(i, (list, np.ndarray)) for i in index)


def _empty(data) -> bool:
    """Host data with no values (``torch.tensor([], device=...)``, as transformers' KV cache starts): a copy of no
    bytes, which CUDA skips."""
    try:
        return len(data) == 0
    except TypeError:  # a scalar
        return False


class _Functions(TorchFunctionMode):
    def __init__(self, owner: "WouldBeSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = None
        if func in _HOST_READS:
            kind = _HOST_READS[func]
        elif func in _INDEXING and len(args) > 1 and _is_host_index(args[1]):
            kind = "host-array index"
        elif func in _FROM_HOST and kwargs.get("device") is not None and args and \
                not isinstance(args[0], torch.Tensor) and not _empty(args[0]):
            kind = "tensor from host data"
        if kind is None:
            return func(*args, **kwargs)
        self.owner._count(kind)
        with self.owner._inner():  # what a counted call does internally is not counted again
            return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "WouldBeSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet is aten._local_scalar_dense:
            self.owner._count("host read")
        elif packet in _DATA_SIZED:
            self.owner._count(_DATA_SIZED[packet])
        elif packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor and \
                (kwargs or {}).get("output_size") is None:
            self.owner._count("repeat_interleave")  # tensor repeats: the output size is their sum, read on the host
        elif packet in _MASKED and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                       for i in (args[1] if len(args) > 1 else ()) or ()):
            self.owner._count("nonzero")  # a boolean-mask index: CUDA runs nonzero to size the result
        return func(*args, **(kwargs or {}))


class WouldBeSyncs:
    """Context manager: ``total`` would-be host syncs, ``by_kind`` per kind, ``where`` per call site (file:line of
    the nearest SpecFit frame) when ``sites=True``. ``reset()`` starts a new count; counting nests with nothing
    (one counter at a time)."""

    def __init__(self, sites: bool = False):
        self.sites = sites
        self.total = 0
        self.by_kind: Counter = Counter()
        self.where: Counter = Counter()
        self.waits = 0  # of total: host waits on events, streams or the device (debug mode reports the streams')
        self._depth = 0
        self._modes = (_Functions(self), _Dispatch(self))
        self._saved: list = []

    def reset(self) -> None:
        self.total = self.waits = 0
        self.by_kind.clear()
        self.where.clear()

    def _count(self, kind: str, wait: bool = False) -> None:
        if self._depth:
            return
        self.total += 1
        self.by_kind[kind] += 1
        self.waits += wait
        if self.sites:
            for frame in reversed(traceback.extract_stack()):
                if "specfit" in frame.filename and "syncs.py" not in frame.filename:
                    self.where[f"{frame.filename.rsplit('specfit', 1)[-1]}:{frame.lineno} {kind}"] += 1
                    break

    def _inner(self):
        owner = self

        class Inner:
            def __enter__(self):
                owner._depth += 1

            def __exit__(self, *exc):
                owner._depth -= 1

        return Inner()

    def _wait(self, what: str) -> None:
        self._count(what, wait=True)

    def _wrap_wait(self, original, kind: str):
        def counted(*args, **kwargs):
            if not transfer.in_host_wait():  # host_wait has counted it already
                self._count(kind, wait=True)
            return original(*args, **kwargs)

        return counted

    def __enter__(self) -> "WouldBeSyncs":
        for owner, name, kind in _WAITS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap_wait(original, kind))
        transfer.listen_host_waits(self._wait)
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        transfer.listen_host_waits(self._wait, stop=True)
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
