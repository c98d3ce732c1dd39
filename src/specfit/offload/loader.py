"""The streaming half of ``specfit.from_pretrained``: a hub-layout sharded safetensors checkpoint goes straight into
the expert store (routed experts, host memory) and the compute device (everything else), without materialising the
model twice.

The model skeleton is built on the meta device; each shard is opened, its expert tensors are copied into the
per-layer arenas and every other tensor goes to its module on the compute device; then the shard is closed, so at
most one shard is mapped at a time. Peak host memory is about the expert bytes plus one shard.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from ..seam import checkpoints, layers as hf_layers
from .formats import BlockFP8Format, dequantize, stored_format
from .store import ExpertStore

# hub layouts of routed experts, matched on keys after transformers' renamings (checkpoints.checkpoint_renamer):
# one tensor per expert (Qwen, DeepSeek, GLM, ...: gate_proj/up_proj/down_proj; Mixtral, PhiMoE: w1/w3/w2),
# fused 3-D tensors (GPT-OSS bf16, Llama-4: gate_up_proj/down_proj [+ biases]), Granite's input/output_linear
# (block-wise FP8 checkpoints add a `weight_scale_inv` beside each weight, or a `_scale_inv` beside each fused one)
_PER_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight(_scale_inv)?$")
_FUSED = re.compile(r"^(.+)\.experts\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)(_scale_inv)?$")
_GRANITE = re.compile(r"^(.+)\.(input_linear|output_linear)\.weight(_scale_inv)?$")
_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "input_linear": "gate_up_proj",
         "output_linear": "down_proj"}
_FUSED_OF = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "gate_proj_scale_inv": "gate_up_proj_scale_inv",
             "up_proj_scale_inv": "gate_up_proj_scale_inv"}
log = logging.getLogger("specfit")
_QUANTIZED_SUFFIXES = ("_blocks", "_scales", "weight_scale_inv", ".qweight", ".scales")


def _local_folder(path_or_id) -> Path | None:
    """The checkpoint folder when ``path_or_id`` names one on disk; None for a hub repo id."""
    path = Path(path_or_id)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint folder (with config.json and *.safetensors)")
    return None


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub repo id, downloaded (config, tokenizer and safetensors only)."""
    path = _local_folder(path_or_id)
    if path is not None:
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_id), revision=revision,
                                  allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{folder} has neither model.safetensors.index.json nor model.safetensors")


def load_offloaded(path_or_id, *, dtype: torch.dtype | None = None, device=None, revision: str | None = None,
                   pin: bool | str = "auto", check=None) -> tuple[torch.nn.Module, ExpertStore, torch.device]:
    """Stream a checkpoint: routed experts into a new ``ExpertStore``, everything else onto ``device``; returns
    ``(model, store, device)``, the model without expert parameters, ready for ``enable(..., store=store)``.

    ``check(model)``, if given, sees the model built from ``config.json`` alone (weights on the meta device) before
    any weight is read or downloaded and the host arenas are allocated: settings that depend on the model (slots
    against its experts) fail in seconds, not after the whole checkpoint has streamed."""
    local = _local_folder(path_or_id)
    config = AutoConfig.from_pretrained(local if local is not None else str(path_or_id), revision=revision)
    stored_dtype = getattr(config, "dtype", None)  # the checkpoint's (from_config below sets the model's)
    dtype = dtype or stored_dtype or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = hf_layers.moe_layers(model)
    fmt = stored_format(config, layers[0].layout, dtype, stored_dtype, where=str(path_or_id))
    if isinstance(fmt, BlockFP8Format):
        note = _fp8_device_note(device, dtype, path_or_id)
        if note is not None:
            log.info(note)
        if layers[0].transposed:
            raise ValueError(f"{path_or_id}: block-wise FP8 experts of a transposed family "
                             f"({type(layers[0].experts).__name__}) are not supported")
        vars(model.config).pop("quantization_config", None)  # as transformers' dequantized model: a plain config
    if check is not None:
        check(model)
    folder = resolve_checkpoint(path_or_id, revision)
    first = layers[0]
    num_experts = first.num_experts
    for moe in layers:
        hf_layers.release_expert_tensors(moe)  # the store takes their place
    store = ExpertStore(len(layers), num_experts, first.hidden, first.intermediate, dtype, pin=pin,
                        bias=first.layout.bias, format=fmt)
    paths = {name: module for name, module in model.named_modules()}
    block_index = {}  # MoE block path -> (index among MoE layers, MoELayer)
    for i, moe in enumerate(layers):
        block_index[next(n for n, m in paths.items() if m is moe.block)] = (i, moe)
    rename = checkpoints.checkpoint_renamer(model)

    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    known |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    seen = set()
    halves = {}  # non-expert FP8 linears: weight key -> {"weight": e4m3, "scale": float} until both are read
    for shard in shard_files(folder):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(_QUANTIZED_SUFFIXES) and not key.endswith(fmt.suffixes):
                    raise ValueError(f"{shard.name}: {key!r} is a quantized tensor (MXFP4 blocks/scales, FP8 scales, "
                                     f"...); SpecFit's streaming loader reads unquantized checkpoints only")
                if checkpoints.ignored_checkpoint_key(model, key):
                    continue
                name = rename(key)
                expert = _expert_tensor(name, block_index)
                if expert is None:
                    tensor = f.get_tensor(key)
                    if fmt.suffixes and (name.endswith(".weight_scale_inv") or tensor.dtype == torch.float8_e4m3fn):
                        _fp8_half(model, known, halves, name, tensor.clone(), device, dtype, shard)
                    else:
                        _load_tensor(model, known, name, tensor, device, dtype, shard)
                    del tensor
                    continue
                i, moe, e, part = expert
                tensor = f.get_tensor(key)
                if e is None:  # fused over experts: [E, ...] in the model's orientation
                    if moe.transposed and tensor.dim() == 3:
                        tensor = tensor.transpose(1, 2)
                    if tensor.shape[0] != num_experts:
                        raise ValueError(f"{shard.name}: {key} holds {tensor.shape[0]} experts, the model has "
                                         f"{num_experts}")
                    for j in range(num_experts):
                        store.write_part(i, j, part, tensor[j])
                        seen.add((i, j, part))
                else:
                    if e >= num_experts:
                        raise ValueError(f"{shard.name}: {key} does not fit the model ({num_experts} experts)")
                    store.write_part(i, e, part, tensor)
                    seen.add((i, e, part))
                del tensor  # it maps the shard: keep no reference past the shard's close
    parts = ("gate_proj", "up_proj", "down_proj")
    if first.layout.bias:
        parts += ("gate_up_proj_bias", "down_proj_bias")
    parts += tuple(f"{p}_scale_inv" for p in parts if fmt.suffixes)
    paths_of = {i: path for path, (i, _) in block_index.items()}
    for i, moe in enumerate(layers):
        for e in range(num_experts):
            for part in parts:
                fused = part in _FUSED_OF and (i, e, _FUSED_OF[part]) in seen
                if (i, e, part) not in seen and not fused:
                    raise KeyError(f"checkpoint {folder} is missing expert weight "
                                   f"'{paths_of[i]}.experts.{e}.{_key_of(part)}' (or a fused tensor holding it)")
    if halves:
        key, half = next(iter(halves.items()))
        raise KeyError(f"checkpoint {folder} has {key!r} without its "
                       f"{'weight_scale_inv' if 'weight' in half else 'FP8 weight'} (block-wise FP8 needs both)")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta"]
    if missing:
        raise KeyError(f"checkpoint {folder} is missing weight(s): {', '.join(missing[:5])}"
                       + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.to(device)  # buffers (rotary inv_freq); parameters are already there, experts are not parameters
    model.eval()
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model, store, device


def _expert_tensor(name: str, block_index: dict):
    """(MoE index, MoELayer, expert or None for all, store part) if ``name`` is a routed-expert tensor, else None."""
    for pattern in (_PER_EXPERT, _FUSED, _GRANITE):
        m = pattern.match(name)
        if m is not None and m[1] in block_index:
            i, moe = block_index[m[1]]
            scale = m[m.lastindex] if m.lastindex and m[m.lastindex] == "_scale_inv" else ""
            if pattern is _PER_EXPERT:
                return i, moe, int(m[2]), _PART.get(m[3], m[3]) + scale
            return i, moe, None, _PART.get(m[2], m[2]) + scale
    return None


def _key_of(part: str) -> str:
    """A store part's checkpoint key suffix: ``gate_proj`` -> ``gate_proj.weight``, ``gate_proj_scale_inv`` ->
    ``gate_proj.weight_scale_inv`` (biases are keys of their own)."""
    if part.endswith("_bias"):
        return part
    if part.endswith("_scale_inv"):
        return part[: -len("_scale_inv")] + ".weight_scale_inv"
    return part + ".weight"


def _fp8_device_note(device: torch.device, dtype: torch.dtype, where) -> str | None:
    """FP8 experts are computed as transformers computes a block-wise FP8 checkpoint where it dequantizes it (a CPU, a
    GPU below compute capability 8.9, or ``quantization_config.dequantize=true``): ``(fp8.float() * scale).to(dtype)``
    per block, on the device, then the dense math. Where transformers would run its FP8 kernels instead (compute
    capability >= 8.9: H100, H200, L40S, RTX 4090/5090; they also quantize the activations), SpecFit computes the same
    dequantized model, so its output equals transformers' with ``dequantize=true``; the note saying so (logged at
    info), or None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return (f"{where}: block-wise FP8 experts on {device} (compute capability {major}.{minor}) are dequantized on the "
            f"device per use and computed in {dtype}, as transformers computes the checkpoint with "
            f"quantization_config.dequantize=true (not with its FP8 kernels, which also quantize activations)")


def _fp8_half(model, known: set, halves: dict, name: str, tensor: torch.Tensor, device, dtype, shard: Path) -> None:
    """One half of a non-expert FP8 linear (its e4m3 ``weight`` or its ``weight_scale_inv``); once both are read
    the weight is dequantized into ``dtype`` as transformers does at load, and loaded."""
    scale = name.endswith(".weight_scale_inv")
    key = name[: -len("_scale_inv")] if scale else name
    half = halves.setdefault(key, {})
    half["scale" if scale else "weight"] = tensor
    if len(half) == 2:
        del halves[key]
        w, s = half["weight"], half["scale"]
        if w.shape[-2] % s.shape[-2] or w.shape[-1] % s.shape[-1]:
            raise ValueError(f"{shard.name}: {key}_scale_inv has shape {tuple(s.shape)}, which does not tile "
                             f"{key} {tuple(w.shape)} in whole blocks")
        _load_tensor(model, known, key, dequantize(w, s, dtype), device, dtype, shard)


def _load_tensor(model, known: set, key: str, tensor: torch.Tensor, device, dtype, shard: Path) -> None:
    if key not in known:
        raise ValueError(f"{shard.name}: unexpected weight {key!r} for {type(model).__name__}")
    if tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if device.type == "cpu":
        tensor = tensor.clone()  # detach from the shard's memory map, which is closed after this shard
    set_module_tensor_to_device(model, key, device, value=tensor)
