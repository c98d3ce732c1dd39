"""Stored expert formats: how one routed expert sits in a host arena row, how a checkpoint tensor is written into that
row, and how the experts forward turns rows into weights it can multiply with. One registry, keyed by the
checkpoint's ``quantization_config.quant_method`` (None: unquantized); the next format (int4 GPTQ/AWQ) is one more
class and one more entry in ``FORMATS``. Every other quantization is refused up front, by name.

A format's row is what a copy moves: ``row_numel`` elements of ``arena_dtype`` (``expert_bytes`` bytes), the same
bytes in host memory and in a device slot. ``host_path``: the host lane can compute the format's experts on the host
CPU, from the arena rows as stored (``offload/cold.py``); a format without one is always copied.

- ``DenseFormat``: ``gate_up [2I, H]``, ``down [H, I]`` (+ biases) in the checkpoint's float dtype
  (``seam.layers.ExpertLayout``); computed in the model's dtype (an exact upcast where the checkpoint is narrower,
  e.g. bf16 weights in an fp32 model: the bytes stay as stored, as transformers' own fp32 load of them is exact).
- ``BlockFP8Format``: transformers' block-wise FP8 (``quant_method="fp8"``, ``weight_block_size=[bn, bk]``): e4m3
  ``gate_up [2I, H]`` and ``down [H, I]`` bytes, then their float32 ``weight_scale_inv`` per block ``[2I/bn, H/bk]``
  and ``[H/bn, I/bk]``, all in one uint8 row. Computed as transformers computes an FP8 checkpoint where it
  dequantizes it (CPUs, GPUs below compute capability 8.9, or ``quantization_config.dequantize=true``):
  ``(fp8.float() * scale).to(dtype)`` per block (``Fp8Dequantize``), then the family's dense expert math; on any
  device, on the device, per use (GPUs from compute capability 8.9, where transformers would run its FP8 kernels,
  too: SpecFit then computes the model transformers' ``dequantize=true`` load computes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..seam import checkpoints, layers as hf_layers

@dataclass(frozen=True)
class DenseFormat:
    """Unquantized experts, stored in ``stored_dtype`` and computed in ``compute_dtype``."""

    layout: hf_layers.ExpertLayout
    stored_dtype: torch.dtype
    compute_dtype: torch.dtype
    name = "dense"
    suffixes = ()  # checkpoint key suffixes beside ``.weight`` this format reads
    host_path = True  # the host lane computes it from the arena row as stored (an upcast where narrower)

    def __post_init__(self):
        if self.compute_dtype.itemsize == 1:  # e.g. transformers' FP8Experts, loaded where it runs FP8 kernels
            raise ValueError(f"the experts are {self.compute_dtype} parameters (transformers' FP8 kernels' layout): "
                             f"SpecFit reads FP8 experts from the checkpoint itself and dequantizes them on the device "
                             f"per use, on any GPU: specfit.from_pretrained(path, cache_slots=...)")

    @property
    def arena_dtype(self) -> torch.dtype:
        return self.stored_dtype

    @property
    def row_numel(self) -> int:
        return self.layout.numel

    @property
    def expert_bytes(self) -> int:
        return self.row_numel * self.stored_dtype.itemsize

    @property
    def in_compute_dtype(self) -> bool:
        """Rows are usable as weights as they are (the grouped CUDA path multiplies slot views directly)."""
        return self.stored_dtype == self.compute_dtype

    def targets(self, row: torch.Tensor) -> dict:
        """Checkpoint part name -> the view of ``row`` it fills."""
        gate_up, down, gate_up_bias, down_bias = self.layout.split(row)
        i = self.layout.intermediate
        return {"gate_proj": gate_up[:i], "up_proj": gate_up[i:], "gate_up_proj": gate_up, "down_proj": down,
                "gate_up_proj_bias": gate_up_bias, "down_proj_bias": down_bias}

    def check_source(self, part: str, tensor: torch.Tensor, where: str) -> None:
        if self.stored_dtype != self.compute_dtype and tensor.dtype != self.stored_dtype:
            raise ValueError(f"{where}: {part} is stored as {tensor.dtype}, but the checkpoint's config.json says "
                             f"its dtype is {self.stored_dtype} (the arenas keep the experts in that dtype); set "
                             f"config.json's \"dtype\" to the dtype its tensors have")

    def compute_parts(self, rows: torch.Tensor):
        """rows [n, numel] -> (gate_up [n, 2I, H], down [n, H, I], biases | None) in the compute dtype."""
        parts = self.layout.split_batch(rows)
        if self.in_compute_dtype:
            return parts
        return tuple(None if p is None else p.to(self.compute_dtype) for p in parts)


@dataclass(frozen=True)
class BlockFP8Format:
    """Block-wise e4m3 experts with float32 per-block ``weight_scale_inv``, one uint8 row per expert."""

    layout: hf_layers.ExpertLayout
    block: tuple[int, int]  # (rows, columns) of one scale block: ``weight_block_size``
    compute_dtype: torch.dtype
    name = "fp8"
    suffixes = ("weight_scale_inv",)
    arena_dtype = torch.uint8
    host_path = True  # the host lane dequantizes the row per use, as the device does

    def __post_init__(self):
        if self.layout.bias:
            raise ValueError("block-wise FP8 experts with biases are not supported (transformers' FP8Experts has "
                             "none either)")
        bn, bk = self.block
        h, i = self.layout.hidden, self.layout.intermediate
        for name, (rows, cols) in {"gate_proj/up_proj": (i, h), "down_proj": (h, i)}.items():
            if rows % bn or cols % bk:
                raise ValueError(f"weight_block_size {list(self.block)} does not tile the experts' {name} "
                                 f"[{rows}, {cols}]; transformers dequantizes only whole blocks")

    # row layout: gate_up fp8 [2I*H] | down fp8 [H*I] | gate_up scales f32 [2I/bn * H/bk] | down scales f32
    @property
    def _shapes(self):
        h, i = self.layout.hidden, self.layout.intermediate
        bn, bk = self.block
        return (2 * i, h), (h, i), (2 * i // bn, h // bk), (h // bn, i // bk)

    @property
    def row_numel(self) -> int:
        gu, dn, sgu, sdn = self._shapes
        return gu[0] * gu[1] + dn[0] * dn[1] + 4 * (sgu[0] * sgu[1] + sdn[0] * sdn[1])

    @property
    def expert_bytes(self) -> int:
        return self.row_numel

    in_compute_dtype = False

    def _split(self, rows: torch.Tensor):
        """rows [n, row bytes] (uint8) -> (gate_up e4m3 [n, 2I, H], down e4m3 [n, H, I], gate_up scales f32
        [n, 2I/bn, H/bk], down scales f32 [n, H/bn, I/bk]) views."""
        n, out, at = rows.shape[0], [], 0
        for k, shape in enumerate(self._shapes):
            size = shape[0] * shape[1] * (1 if k < 2 else 4)
            raw = rows[:, at:at + size]
            at += size
            out.append(raw.view(torch.float8_e4m3fn if k < 2 else torch.float32).view(n, *shape))
        return out

    def targets(self, row: torch.Tensor) -> dict:
        gate_up, down, s_gate_up, s_down = (t[0] for t in self._split(row[None]))
        i, si = self.layout.intermediate, self._shapes[2][0] // 2
        return {"gate_proj": gate_up[:i], "up_proj": gate_up[i:], "gate_up_proj": gate_up, "down_proj": down,
                "gate_proj_scale_inv": s_gate_up[:si], "up_proj_scale_inv": s_gate_up[si:],
                "gate_up_proj_scale_inv": s_gate_up, "down_proj_scale_inv": s_down}

    def check_source(self, part: str, tensor: torch.Tensor, where: str) -> None:
        want = (torch.float8_e4m3fn,) if not part.endswith("scale_inv") else (torch.float32, torch.bfloat16,
                                                                                 torch.float16)
        if tensor.dtype not in want:
            raise ValueError(f"{where}: {part} is {tensor.dtype}; a block-wise FP8 checkpoint stores expert weights "
                             f"as float8_e4m3fn and their weight_scale_inv as a float ({', '.join(map(str, want))})")

    def compute_parts(self, rows: torch.Tensor):
        """rows [n, row bytes] -> (gate_up [n, 2I, H], down [n, H, I], None, None) dequantized as transformers does."""
        gate_up, down, s_gate_up, s_down = self._split(rows)
        return (dequantize(gate_up, s_gate_up, self.compute_dtype), dequantize(down, s_down, self.compute_dtype),
                None, None)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
               two_pass: bool | None = None) -> torch.Tensor:
    """e4m3 weight [..., R, C] with per-block scales [..., R/bn, C/bk] -> [..., R, C] in ``dtype``: the product in
    float32, then one rounding, exactly as transformers' ``Fp8Dequantize`` does at load (``(w.float() * s).to(dtype)``).

    ``two_pass`` (the default on CUDA, where the experts forward dequantizes every expert it computes, per use): two
    kernels and no float32 temporary, 7 bytes of memory traffic per weight in bf16 instead of 19: e4m3 widens exactly
    to any float dtype (3 mantissa bits, exponents 2^-9..2^8), and ``torch.mul`` computes a ``dtype`` x float32 product
    in float32 and rounds it once into its ``dtype`` output. The same values bit for bit; on a CPU, whose mixed-dtype
    multiply goes through temporaries of its own, the plain formula is as fast or faster (measured on the embedded
    model's experts), so it is the default there.

    >>> w = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).to(torch.float8_e4m3fn)
    >>> dequantize(w, torch.tensor([[0.5], [2.0]]), torch.float32).tolist()
    [[0.5, 1.0], [6.0, 8.0]]
    """
    *lead, rows, cols = weight.shape
    sr, sc = scale_inv.shape[-2:]
    s = scale_inv.float().reshape(-1, sr, 1, sc, 1)
    if weight.device.type == "cuda" if two_pass is None else two_pass:
        q = weight.to(dtype).reshape(-1, sr, rows // sr, sc, cols // sc)  # exact
        return torch.mul(q, s, out=torch.empty_like(q)).reshape(*lead, rows, cols)
    q = weight.float().reshape(-1, sr, rows // sr, sc, cols // sc)
    return (q * s).to(dtype).reshape(*lead, rows, cols)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float weight -> (e4m3 [R, C], float32 weight_scale_inv [R/bn, C/bk]): each block scaled so its largest
    magnitude maps to e4m3's largest finite value (448), the layout of the hub's block-wise FP8 checkpoints."""
    rows, cols = weight.shape
    bn, bk = block
    if rows % bn or cols % bk:
        raise ValueError(f"block {list(block)} does not tile a [{rows}, {cols}] weight")
    blocks = weight.float().reshape(rows // bn, bn, cols // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale


def host_path_formats() -> list[str]:
    """Names of the stored formats whose experts the host lane computes (``host_path``)."""
    return [f.name for f in (DenseFormat, BlockFP8Format) if f.host_path]


# --- the registry --------------------------------------------------------------------------------------------------
def _dense(layout, stored, quantization, compute_dtype):
    stored = _as_dtype(stored) or compute_dtype
    narrower = stored.is_floating_point and stored.itemsize < compute_dtype.itemsize
    return DenseFormat(layout, stored if narrower else compute_dtype, compute_dtype)


def _block_fp8(layout, stored, q, compute_dtype):
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints (e.g. [128, 128]), got "
                         f"{block!r}: SpecFit reads block-wise FP8 checkpoints only")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme={q['activation_scheme']!r}: SpecFit reads FP8 "
                         f"checkpoints with dynamic activation scales only")
    fmt = q.get("scale_fmt") or "float"
    if fmt != "float":
        raise ValueError(f"quantization_config.scale_fmt={fmt!r}: SpecFit reads float32 FP8 scales only")
    return BlockFP8Format(layout, tuple(block), compute_dtype)


# quant_method -> (layout, checkpoint dtype, quantization_config dict, compute dtype) -> format
FORMATS = {None: _dense, "fp8": _block_fp8}


def stored_format(config, layout: hf_layers.ExpertLayout, compute_dtype: torch.dtype, stored_dtype=None,
                  where: str = "the checkpoint"):
    """The stored expert format of a checkpoint with ``config`` (``stored_dtype``: its ``config.json`` dtype, read
    before a model is built from it); other quantizations are refused, named."""
    method = checkpoints.quantization_method(config)
    if method not in FORMATS:
        raise ValueError(f"{where}: the checkpoint is quantized ({method!r}, e.g. GPT-OSS's MXFP4 experts); SpecFit's "
                         f"streaming loader reads "
                         f"unquantized (bf16/fp16/fp32) and block-wise FP8 (quant_method 'fp8') checkpoints. Use one "
                         f"of those releases, or load with transformers (dequantising) and call specfit.enable(model,"
                         f" ...)")
    return FORMATS[method](layout, stored_dtype, _quantization_dict(config), compute_dtype)


def _as_dtype(dtype):
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _quantization_dict(config) -> dict:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return {}
    return dict(q) if isinstance(q, dict) else q.to_dict()
