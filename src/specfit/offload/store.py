"""Host side of the offload: every routed expert lives in host memory, one contiguous arena per MoE layer.

Layout of one layer's arena ``[E, 3*I*H]``: row ``e`` is expert ``e`` flattened as ``gate_up [2I, H]`` (gate rows
first, then up rows, as in transformers' fused ``gate_up_proj``) followed by ``down [H, I]``; families with expert
biases (GPT-OSS) append ``gate_up_bias [2I]`` and ``down_bias [H]`` (``seam.layers.ExpertLayout``). One expert is one
row, so moving it to the device is one copy. That is the dense format; ``formats.py`` holds every stored format (a
block-wise FP8 expert is one uint8 row of e4m3 weights and float32 block scales), and the row's bytes are what a copy
moves (``expert_bytes``) and what the experts forward turns into weights (``compute_parts``).

On CUDA the arenas are pinned in place at their exact size with ``cudaHostRegister`` (torch's pinned allocator rounds
every block up to a power of two: Qwen3-30B-A3B's 48 arenas of 1.125 GiB would take 48 x 2 GiB = 96 GiB instead of
54 GiB).

A layer whose arena could not be pinned is ``layer_pinned(layer) == False``: its copies are synchronous (the host
blocks for each, and nothing overlaps them), and the copy engine counts them as ``pageable_copies``. The arenas are
unpinned only after every device copy still reading them has finished (``release`` and the finalizer synchronize).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ..seam import layers as hf_layers
from . import standin
from .formats import DenseFormat

class CudaHostPinning:
    """Page-locking host memory in place (``cudaHostRegister``), in one small seam so that a CPU test double can
    stand in (a pinning failure, copies still in flight at release)."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def register(self, ptr: int, nbytes: int) -> int:
        """Returns the cudaError (0: pinned). A failure leaves CUDA usable."""
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err != 0:
            _clear_cuda_error()  # the runtime keeps the error; the next launch would raise it otherwise
        return err

    def unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)

    def synchronize(self) -> None:
        """Wait for all work on every device: a copy in flight may still be reading the memory."""
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)


class ExpertStore:
    def __init__(self, num_layers: int, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 pin: bool | str = "auto", bias: bool = False, pinning: CudaHostPinning | None = None,
                 format=None):
        """``dtype``: the dtype experts compute in; ``format``: how they are stored (``formats``; default: dense,
        stored in ``dtype``). ``self.dtype`` is what the arenas and device slots hold (uint8 rows for FP8)."""
        if pin not in (True, False, "auto"):
            raise ValueError(f"pin must be True, False or 'auto', got {pin!r}")
        self._pinning = pinning or (standin.Pinning() if standin.enabled() else CudaHostPinning())
        self.layout = hf_layers.ExpertLayout(hidden, intermediate, bias)
        self.format = format or DenseFormat(self.layout, dtype, dtype)
        if self.format.layout != self.layout:
            raise ValueError(f"format {self.format.name} is for layout {self.format.layout}, the store's is "
                             f"{self.layout}")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.dtype, self.compute_dtype = self.format.arena_dtype, dtype
        self.expert_numel = self.format.row_numel
        self.arenas = [torch.empty(num_experts, self.expert_numel, dtype=self.dtype) for _ in range(num_layers)]
        self.pinned_bytes = 0
        self._registered: list[int] = []
        self._finalizer = None
        if pin is True or (pin == "auto" and self._pinning.available()):
            self._pin()

    # sizes ---------------------------------------------------------------------------------------------------
    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert as stored (what one copy moves; FP8: e4m3 weights and their scales)."""
        return self.expert_numel * self.arenas[0].element_size() if self.arenas else 0

    @property
    def weight_bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.arenas)

    @property
    def is_pinned(self) -> bool:
        return bool(self.arenas) and self.pinned_bytes == self.weight_bytes

    @property
    def rows_are_weights(self) -> bool:
        """A row is directly a weight in the compute dtype (no dequantize or upcast between copy and compute)."""
        return self.format.in_compute_dtype

    def layer_pinned(self, layer: int) -> bool:
        """Whether layer ``layer``'s arena is page-locked (arenas are pinned in layer order, up to a failure)."""
        return layer < len(self._registered)

    # views -----------------------------------------------------------------------------------------------------
    def split(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One flat expert row (host or device) -> (gate_up [2I, H], down [H, I]) in the compute dtype."""
        return self.parts(row)[:2]

    def parts(self, row: torch.Tensor):
        """One flat expert row -> (gate_up [2I, H], down [H, I], gate_up_bias [2I] | None, down_bias [H] | None) in
        the compute dtype (views when the row is stored in it)."""
        return tuple(None if p is None else p[0] for p in self.compute_parts(row[None]))

    def compute_parts(self, rows: torch.Tensor):
        """rows [n, numel] -> (gate_up [n, 2I, H], down [n, H, I], biases | None) in the compute dtype, as the
        experts forward multiplies them (views for dense rows in that dtype; FP8 rows dequantized)."""
        return self.format.compute_parts(rows)

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.arenas[layer][expert])

    def write_fused(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias=None,
                    down_bias=None) -> None:
        """Fill a layer from fused tensors: gate_up [E, 2I, H], down [E, H, I] (+ biases [E, 2I], [E, H])."""
        if not self.rows_are_weights:
            raise ValueError(f"write_fused takes dense weights; this store holds {self.format.name} experts (fill it "
                             f"with write_part, tensor by tensor as the checkpoint stores them)")
        for e in range(self.num_experts):
            views = self.parts(self.arenas[layer][e])
            for view, src in zip(views, (gate_up, down, gate_up_bias, down_bias)):
                if view is not None:
                    if src is None:
                        raise ValueError(f"layer {layer}: the store holds expert biases, none were given")
                    view.copy_(src[e].detach())

    def write_part(self, layer: int, expert: int, part: str, weight: torch.Tensor) -> None:
        """Fill one checkpoint tensor of one expert: ``gate_proj``/``up_proj`` [I, H], ``down_proj`` [H, I], or the
        fused ``gate_up_proj`` [2I, H] (the model's own gate/up order), ``gate_up_proj_bias`` [2I],
        ``down_proj_bias`` [H]; FP8 stores also take each one's ``..._scale_inv`` [rows/bn, cols/bk]."""
        targets = self.format.targets(self.arenas[layer][expert])
        target = targets.get(part)
        if target is None:
            raise ValueError(f"unknown expert part {part!r} for {self.format.name} layout {self.layout}; expected "
                             f"{', '.join(k for k, v in targets.items() if v is not None)}")
        if tuple(weight.shape) != tuple(target.shape):
            raise ValueError(f"layer {layer} expert {expert} {part}: shape {tuple(weight.shape)}, "
                             f"expected {tuple(target.shape)}")
        self.format.check_source(part, weight, f"layer {layer} expert {expert}")
        target.copy_(weight)

    def fused(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh contiguous copies in transformers' fused layout (gate_up [E, 2I, H], down [E, H, I])."""
        return self.tensors(layer)[:2]

    def tensors(self, layer: int):
        """Fresh copies of every part, stacked over experts, in the compute dtype: (gate_up [E, 2I, H], down
        [E, H, I], gate_up_bias [E, 2I] | None, down_bias [E, H] | None) (used by ``disable``; FP8 experts come
        back dequantized, as transformers loads them where it dequantizes)."""
        return tuple(None if part is None else part.clone(memory_format=torch.contiguous_format)
                     for part in self.read(layer))

    # the experts as the model's own parameters (state_dict, save_pretrained, load_state_dict) -----------------
    def read(self, layer: int):
        """THE arena -> tensor conversion: a layer's experts as true values in the compute dtype and the store's
        orientation, (gate_up [E, 2I, H], down [E, H, I], gate_up_bias [E, 2I] | None, down_bias [E, H] | None):
        what the plain model holds. Views of the arena (no copy) when the rows are stored in the compute dtype;
        otherwise converted by the stored format (bf16 rows of an fp32 model upcast exactly, FP8 rows
        dequantized as transformers does). Every reader (``tensors``, ``checkpoint_tensors``) goes through here."""
        return self.compute_parts(self.arenas[layer])

    def checkpoint_tensors(self, layer: int, transposed: bool = False) -> dict[str, torch.Tensor]:
        """A layer's experts under the names and shapes of the experts module's own parameters, in its order
        (``gate_up_proj``, ``gate_up_proj_bias``, ``down_proj``, ``down_proj_bias``): what ``state_dict()`` of the
        plain model holds for it. ``transposed``: the family stores ``x @ W`` (GPT-OSS, Llama-4: gate_up [E, H, 2I],
        down [E, I, H]). Views when ``read`` gives views: bit-identical values, no second copy."""
        return _named(self.read(layer), transposed)

    def write_checkpoint_tensors(self, layer: int, tensors: dict, transposed: bool = False) -> None:
        """Inverse of ``checkpoint_tensors``: copy the given parameters of a layer's experts into its arena (with the
        dtype cast ``load_state_dict`` makes). Every name, shape and value is checked before anything is written:
        rows stored narrower than the compute dtype (bf16 experts of an fp32 model) take only values they hold
        exactly, and quantized rows (FP8) are refused, naming ``specfit.disable``."""
        if not isinstance(self.format, DenseFormat):
            raise ValueError(f"layer {layer}: this store holds {self.format.name} experts as the checkpoint stores "
                             f"them, and load_state_dict cannot write dense values back into them; call "
                             f"specfit.disable(model), load the state dict, then enable again")
        expected = self.checkpoint_tensors(layer, transposed)
        stored = _named(self.layout.split_batch(self.arenas[layer]), transposed)  # views in the arena's dtype
        for name, t in tensors.items():
            if name not in expected:
                raise ValueError(f"layer {layer}: unknown expert parameter {name!r}; the experts hold "
                                 f"{', '.join(expected)}")
            if tuple(t.shape) != tuple(expected[name].shape):
                raise ValueError(f"layer {layer} experts {name}: shape {tuple(t.shape)}, expected "
                                 f"{tuple(expected[name].shape)}")
            want = t.detach().to(expected[name].dtype)
            if stored[name].dtype != want.dtype and not torch.equal(want.to(stored[name].dtype).to(want.dtype), want):
                raise ValueError(f"layer {layer} experts {name}: the store keeps these experts in "
                                 f"{stored[name].dtype} (as the checkpoint stores them) and the values given do not "
                                 f"fit it exactly; call specfit.disable(model) before loading them")
        with torch.no_grad():
            for name, t in tensors.items():
                stored[name].copy_(t.detach().to(expected[name].dtype))

    # pinning ---------------------------------------------------------------------------------------------------
    def _pin(self) -> None:
        if not self._pinning.available():
            warnings.warn(f"pin=True but CUDA is not available: {self.weight_bytes} bytes of experts stay in "
                          f"pageable memory", RuntimeWarning, stacklevel=3)
            return
        # created first, so arenas pinned before a failure are unpinned too
        if self._finalizer is None:
            self._finalizer = weakref.finalize(self, _unregister, self._pinning, self._registered, self.arenas)
        for arena in self.arenas:
            nbytes = arena.numel() * arena.element_size()
            err = self._pinning.register(arena.data_ptr(), nbytes)
            if err != 0:
                warnings.warn(
                    f"pinning the expert arenas failed (cudaError {err}) after {self.pinned_bytes} of "
                    f"{self.weight_bytes} bytes ({len(self._registered)} of {len(self.arenas)} layers): the rest "
                    f"stays in PAGEABLE memory, so its host-to-device copies are synchronous and overlap nothing "
                    f"(counted as stats pageable_copies). Usual causes: the container's memory limit (cgroup) or "
                    f"too little free host memory.", RuntimeWarning, stacklevel=3)
                return
            self._registered.append(arena.data_ptr())
            self.pinned_bytes += nbytes

    def release(self) -> None:
        """Unpin and drop the arenas (after every device copy still reading them has finished)."""
        if self._finalizer is not None:
            self._finalizer()  # runs once; drops its references to the arenas
        self._registered, self.arenas, self.pinned_bytes = [], [], 0

    def __repr__(self) -> str:
        return (f"ExpertStore(layers={len(self.arenas)}, experts={self.num_experts}, expert_bytes={self.expert_bytes},"
                f" weight_bytes={self.weight_bytes}, pinned_bytes={self.pinned_bytes})")


def _clear_cuda_error() -> None:
    """Consume the CUDA runtime's sticky last error (cudaGetLastError), which torch's cudart binding lacks."""
    import ctypes

    getter = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if getter is not None:
        getter()
        return
    try:
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "libcudart" in line)
        ctypes.CDLL(path).cudaGetLastError()
    except (OSError, StopIteration):
        warnings.warn("could not clear the CUDA error left by the failed pin; later CUDA calls may report it",
                      RuntimeWarning, stacklevel=4)


def _unregister(pinning: CudaHostPinning, ptrs: list[int], arenas) -> None:
    # `arenas` is passed only to keep the memory alive until it is unregistered
    if ptrs:
        pinning.synchronize()  # a copy still in flight (a prefetch at teardown) may be reading an arena
        for ptr in ptrs:
            pinning.unregister(ptr)
    ptrs.clear()


def _named(parts, transposed: bool) -> dict[str, torch.Tensor]:
    gate_up, down, gate_up_bias, down_bias = parts
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    named = {"gate_up_proj": gate_up, "gate_up_proj_bias": gate_up_bias, "down_proj": down, "down_proj_bias": down_bias}
    return {name: t for name, t in named.items() if t is not None}
