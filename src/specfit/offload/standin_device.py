"""The CUDA stand-in's second device: a device distinct from the host, on a CPU, so that a tensor on the wrong side
fails a CPU test the way it fails on CUDA.

Under ``SPECFIT_CUDA_STANDIN=1`` an enabled model's weights (all but the routed experts, which stay in the host
store) live on the ``standin`` device, torch's PrivateUse1 backend under that name. Its tensors (``DeviceTensor``)
hold their values in a CPU tensor (``raw``) and compute with the CPU's kernels, but report ``device='standin:0'``,
and every operation on them checks placement as CUDA does:

- an operation that mixes a device tensor with a host tensor of one or more dimensions raises torch's own message
  ("Expected all tensors to be on the same device ..."): host scalars (0-dimensional) are allowed, as CUDA allows
  CPU scalars, and so are host index tensors in indexing (``x[idx]``, ``x[idx] = v``), as CUDA moves them;
- moves are the copies: ``.to(device)``, ``.cpu()``, ``copy_`` between the sides;
- ``.numpy()`` on a device tensor raises (``Use Tensor.cpu() ...``), ``.tolist()`` and ``.item()`` read it;
- random draws on device tensors refuse a host generator (``generator(device)`` makes one for the device);
- ``set_sync_debug_mode("warn")`` (this module stands in for ``torch.cuda`` where a check calls it: ``cuda_calls``)
  warns "called a synchronizing CUDA operation" where CUDA's debug mode does: a device tensor read on the host
  (``.item()``, ``.tolist()``, ``.cpu()``, a blocking copy to a host tensor) and ops whose output size is read from
  the device (``nonzero``, ``masked_select``, ``unique``, ``equal``).

Nothing else changes: values, dtypes, shapes, strides and views are the CPU's. It costs a Python call per operation,
so only the stand-in's tests use it (a model enabled without the stand-in never meets it).
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch

NAME = "standin"
_state: dict = {}
_generators: dict[int, weakref.ref] = {}  # host generators standing in for device ones, by their C++ object
_HOST = torch.device("cpu")
# operations that move bytes between the sides: a device and a host tensor may meet there
_MOVES = frozenset({"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize",
                    "aten::lift_fresh"})
# the device's kernels for what reaches it with no device tensor among the arguments: factories given
# device="standin" (torch's composites build the rest on these; the ones that resize an empty result in place are
# listed whole, as a wrapper's shape is fixed when it is made)
_FACTORIES = ("empty.memory_format", "empty_strided", "arange", "arange.start", "arange.start_step", "linspace",
              "logspace", "randperm", "range.step", "eye", "eye.m", "tril_indices", "triu_indices", "scalar_tensor")
# ops that read the device on the host (CUDA's sync debug mode reports them); copies to the host are added by kind
_SYNCING = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
                      "aten::unique_consecutive", "aten::unique_dim", "aten::equal", "aten::is_nonzero"})
# indexing: host index tensors are allowed (CUDA moves them), the indexed tensor and the values must be on the device
_INDEXING = frozenset({"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"})


def register() -> torch.device:
    """Name torch's PrivateUse1 backend ``standin`` and give it its kernels (once per process); its device."""
    if "device" in _state:
        return _state["device"]
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME, backend_module=_Module(), hook=_Hook())
    aten = torch.library.Library("aten", "IMPL")
    aten.impl("copy_", _copy, "PrivateUse1")  # reached with the Python key excluded (torch.tensor(..., device=))
    for op in _FACTORIES:  # made on the host, wrapped (an op not listed raises torch's "Could not run" error)
        name, _, overload = op.partition(".")
        aten.impl(op, functools.partial(_factory, getattr(getattr(torch.ops.aten, name), overload or "default")),
                  "PrivateUse1")
    _state.update(device=torch.device(NAME, 0), libs=(aten,))
    from ..transfer import GENERATORS

    GENERATORS[NAME] = generator  # draws on the device take the stand-in's generators
    return _state["device"]


def cuda_calls(device):
    """What stands in for ``torch.cuda`` for a check on ``device``: this module on the stand-in's device (its
    ``synchronize``, ``set_sync_debug_mode``, ``get_device_name``), else ``torch.cuda``."""
    import sys

    return sys.modules[__name__] if is_device(device) else torch.cuda


def set_sync_debug_mode(mode) -> None:
    """As ``torch.cuda.set_sync_debug_mode``: "default" (0), "warn" (1) or "error" (2)."""
    names = {0: "default", 1: "warn", 2: "error"}
    mode = names.get(mode, mode)
    if mode not in names.values():
        raise RuntimeError(f"invalid value of debug_mode, expected one of 0, 1, 2, got {mode!r}")
    _state["debug"] = None if mode == "default" else mode


def get_sync_debug_mode() -> int:
    return {None: 0, "warn": 1, "error": 2}[_state.get("debug")]


def synchronize(device=None) -> None:
    """Work on the stand-in's device runs as it is issued (copies queued on the doubles' streams are run by their
    own waits)."""


def get_device_name(device=None) -> str:
    return "the CUDA stand-in (a CPU)"


def _sync_point(what) -> None:
    mode = _state.get("debug")
    if mode == "error":
        raise RuntimeError(f"called a synchronizing CUDA operation (the CUDA stand-in: {what})")
    if mode == "warn":
        warnings.warn(f"called a synchronizing CUDA operation (the CUDA stand-in: {what})", UserWarning, stacklevel=3)


def is_device(device) -> bool:
    """Whether ``device`` is the stand-in's device."""
    return device is not None and torch.device(device).type == NAME and "device" in _state


def raw(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding ``t``'s values (``t`` itself for a host tensor): what a double reads addresses from."""
    return t.raw if isinstance(t, DeviceTensor) else t


def generator(device) -> torch.Generator:
    """A generator for draws on ``device``: torch's own, or on the stand-in's device a host generator the stand-in
    accepts there (a plain host generator is refused, as CUDA refuses one)."""
    if not is_device(device):
        return torch.Generator(device=device)
    for key in [k for k, ref in _generators.items() if ref() is None]:
        del _generators[key]
    g = torch.Generator()
    _generators[g._cdata] = weakref.ref(g)  # dispatch hands the kernels a new Python object for the same generator
    return g


def _device_generator(g: torch.Generator) -> bool:
    ref = _generators.get(g._cdata)
    return ref is not None and ref() is not None


class _Module:
    """``torch.standin``: what torch asks of a device module."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return False  # not an accelerator to anything that looks for one (accelerate would empty its cache)

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def synchronize(self, device=None) -> None:
        pass


class _Hook(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return False

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class DeviceTensor(torch.Tensor):
    """A tensor on the stand-in's device: ``raw`` (a CPU tensor) holds its values."""

    raw: torch.Tensor

    @staticmethod
    def __new__(cls, raw: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, raw.shape, strides=raw.stride(),
                                                storage_offset=raw.storage_offset(), dtype=raw.dtype,
                                                device=_state["device"], requires_grad=raw.requires_grad)
        t.raw = raw
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"{self.raw!r} on {self.device}"

    def tolist(self):
        if _state.get("debug"):
            _sync_point("tolist")
        return self.raw.tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        f"tensor to host memory first.")

    def data_ptr(self) -> int:
        return self.raw.data_ptr()

    def untyped_storage(self):
        return self.raw.untyped_storage()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = _INFO.get(func)
        if info is None:
            info = _INFO[func] = _op_info(func)
        name, returns_self = info
        host = []  # host tensors of one or more dimensions among the arguments
        unwrapped = [_unwrap(a, host, name) for a in args]
        unwrapped_kw = {k: _unwrap(v, host, name) for k, v in kwargs.items()} if kwargs else kwargs
        if host and name not in _MOVES:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{_state['device']} and cpu! (the CUDA stand-in, in {func}: a host tensor of shape "
                               f"{tuple(host[0].shape)} meets a device tensor)")
        to = kwargs.get("device")
        if _state.get("debug") and (name in _SYNCING or _to_host(name, to, args, kwargs)):
            _sync_point(func)
        if to is not None:
            if name == "aten::_to_copy" and torch.device(to).type != NAME:
                return func(*unwrapped, **unwrapped_kw)  # to the host
            unwrapped_kw["device"] = _HOST
        out = _KERNELS.get(name, func)(*unwrapped, **unwrapped_kw)
        if returns_self:
            target = kwargs["out"] if "out" in kwargs else args[0]
            if type(target) is DeviceTensor and tuple(target.raw.shape) != tuple(target.shape):
                raise NotImplementedError(f"the CUDA stand-in: {func} resized a device tensor in place")
            return target
        return _wrap(out)


def _to_host(name: str, to, args, kwargs) -> bool:
    """A blocking copy from the device to the host (``.cpu()``, ``.to("cpu")``, ``host.copy_(device)``)."""
    if name == "aten::_to_copy":
        return to is not None and torch.device(to).type == "cpu"
    if name == "aten::copy_":
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return blocking and type(args[0]) is not DeviceTensor and type(args[1]) is DeviceTensor
    return False


def _histc(x, *args, **kwargs):
    """CUDA's ``histc`` takes integer tensors (transformers counts tokens per expert so), the CPU's floats only."""
    if x.is_floating_point():
        return torch.ops.aten.histc.default(x, *args, **kwargs)
    return torch.ops.aten.histc.default(x.double(), *args, **kwargs).to(x.dtype)


_KERNELS = {"aten::histc": _histc}  # kernels CUDA has and the CPU lacks


_INFO: dict = {}  # op -> (schema name, whether it writes its first argument or out= and returns it)
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def _op_info(func) -> tuple[str, bool]:
    returns = func._schema.returns
    writes = len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write
    return func._schema.name, func._schema.is_mutable and writes


def _unwrap(a, host: list, name: str):
    kind = type(a)
    if kind is DeviceTensor:
        return a.raw
    if kind in _PLAIN:
        return a
    if isinstance(a, torch.Tensor):
        if a.dim() > 0:
            host.append(a)
        return a
    if kind is list or kind is tuple:
        if name in _INDEXING:  # host index tensors are allowed in indexing (CUDA moves them)
            return kind(x.raw if type(x) is DeviceTensor else x for x in a)
        return kind(_unwrap(x, host, name) for x in a)
    if kind is torch.Generator and a.device.type == "cpu" and not _device_generator(a):
        raise RuntimeError(f"Expected a '{NAME}' device type for generator but found 'cpu' (the CUDA stand-in: a "
                           f"host generator drawing for device tensors)")
    return a


def _wrap(out):
    kind = type(out)
    if kind is torch.Tensor:
        return DeviceTensor(out)
    if kind is list or kind is tuple:
        return kind(_wrap(x) for x in out)
    if kind is not DeviceTensor and isinstance(out, torch.Tensor):
        return DeviceTensor(out)
    return out


def _factory(op, *args, **kwargs):
    """The device's kernel for a factory (``torch.empty(..., device="standin")``): made on the host, wrapped."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Generator) and not _device_generator(a):
            raise RuntimeError(f"Expected a '{NAME}' device type for generator but found '{a.device.type}'")
    if "device" in kwargs:
        kwargs["device"] = _HOST
    args = [raw(a) if isinstance(a, torch.Tensor) else a for a in args]
    return _wrap(op(*args, **kwargs))


def _copy(dst, src, non_blocking: bool = False):
    """``copy_`` reached with the Python key excluded (``torch.tensor(data, device="standin")``)."""
    raw(dst).copy_(raw(src))
    return dst
