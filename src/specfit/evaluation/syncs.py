"""Counting the calls that would block the host on CUDA, on any device (a CPU run included).

At batch 1 a GPU decode is launch- and sync-bound: every call that makes the host wait for the device drains the
compute stream, and the GPU idles until the next launch. On CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` reports
them; on a CPU there is nothing to report, so ``WouldBeSyncs`` counts the calls that *would* synchronize if the same
code ran on CUDA, by what they are:

- a device tensor read on the host: ``.item()`` / ``int()`` / ``bool()`` / ``float()`` (``aten._local_scalar_dense``),
  ``.tolist()``, ``.cpu()``;
- ``nonzero`` (its output size is data-dependent; boolean-mask indexing calls it too);
- indexing a tensor with a Python list or tuple of ints (``x[[1, 3]]``, ``x[[1, 3]] = y``): the list becomes a pageable
  host tensor, copied to the device synchronously;
- ``torch.tensor(data, device=...)`` / ``torch.as_tensor(data, device=...)`` from host data: the same copy.

Not counted: copies from pinned memory with ``non_blocking=True`` (``specfit.transfer``'s path), device-side
indexing with device tensors, ``torch.arange``/``torch.full`` on the device, ``.to("cpu")`` (ambiguous on a CPU run:
write ``.cpu()`` for a device-to-host read) and CUDA event/stream synchronizes, which have no CPU counterpart (the
GPU check counts those with the real debug mode). A count is a lower bound of what CUDA would report.

>>> import torch
>>> x = torch.arange(6)
>>> with WouldBeSyncs() as syncs:
...     _ = x[[0, 2]]          # list index: 1
...     _ = int(x.sum())       # host read: 1
...     _ = x[x > 3]           # boolean mask -> nonzero: 1
...     _ = x[1:3]             # a view: 0
>>> syncs.total, sorted(syncs.by_kind)
(3, ['host read', 'list index', 'nonzero'])
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu"}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
             torch.Tensor.index_put}
_FROM_HOST = {torch.tensor, torch.as_tensor}
_MASKED = {torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_, torch.ops.aten._index_put_impl_}


def _is_host_index(index) -> bool:
    """A Python list of ints (or a tuple holding one) used as an index: copied to the device on CUDA."""
    if isinstance(index, list):
        return True
    return isinstance(index, tuple) and any(isinstance(i, list) for i in index)


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
            kind = "list index"
        elif func in _FROM_HOST and kwargs.get("device") is not None and args and \
                not isinstance(args[0], torch.Tensor):
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
        if packet is torch.ops.aten._local_scalar_dense:
            self.owner._count("host read")
        elif packet is torch.ops.aten.nonzero:
            self.owner._count("nonzero")
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
        self._depth = 0
        self._modes = (_Functions(self), _Dispatch(self))

    def reset(self) -> None:
        self.total = 0
        self.by_kind.clear()
        self.where.clear()

    def _count(self, kind: str) -> None:
        if self._depth:
            return
        self.total += 1
        self.by_kind[kind] += 1
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

    def __enter__(self) -> "WouldBeSyncs":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
