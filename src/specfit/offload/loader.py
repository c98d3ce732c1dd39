"""The streaming half of ``specfit.from_pretrained``: a hub-layout sharded safetensors checkpoint goes straight into
the expert store (routed experts, host memory) and the compute device (everything else), without materialising the
model twice.

The model skeleton is built on the meta device; each shard is opened, its expert tensors are copied into the
per-layer arenas and every other tensor goes to its module on the compute device; then the shard is closed, so at
most one shard is mapped at a time. Peak host memory is about the expert bytes plus one shard.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from .. import seam
from .store import ExpertStore

# hub layouts of routed experts, matched on keys after transformers' renamings (seam.checkpoint_renamer):
# one tensor per expert (Qwen, DeepSeek, GLM, ...: gate_proj/up_proj/down_proj; Mixtral, PhiMoE: w1/w3/w2),
# fused 3-D tensors (GPT-OSS bf16, Llama-4: gate_up_proj/down_proj [+ biases]), Granite's input/output_linear
_PER_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^(.+)\.experts\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)$")
_GRANITE = re.compile(r"^(.+)\.(input_linear|output_linear)\.weight$")
_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "input_linear": "gate_up_proj",
         "output_linear": "down_proj"}
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
    quantized = seam.quantization_method(config)
    if quantized is not None:
        raise ValueError(f"{path_or_id}: the checkpoint is quantized ({quantized!r}, e.g. GPT-OSS's MXFP4 experts); "
                         f"SpecFit's streaming loader reads unquantized (bf16/fp16/fp32) checkpoints only. Use a bf16 "
                         f"release, or load with transformers (dequantising) and call specfit.enable(model, ...)")
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = seam.moe_layers(model)
    if check is not None:
        check(model)
    folder = resolve_checkpoint(path_or_id, revision)
    first = layers[0]
    num_experts = first.num_experts
    for moe in layers:
        seam.release_expert_tensors(moe)  # the store takes their place
    store = ExpertStore(len(layers), num_experts, first.hidden, first.intermediate, dtype, pin=pin,
                        bias=first.layout.bias)
    paths = {name: module for name, module in model.named_modules()}
    block_index = {}  # MoE block path -> (index among MoE layers, MoELayer)
    for i, moe in enumerate(layers):
        block_index[next(n for n, m in paths.items() if m is moe.block)] = (i, moe)
    rename = seam.checkpoint_renamer(model)

    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    known |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    seen = set()
    for shard in shard_files(folder):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(_QUANTIZED_SUFFIXES):
                    raise ValueError(f"{shard.name}: {key!r} is a quantized tensor (MXFP4 blocks/scales, FP8 scales, "
                                     f"...); SpecFit's streaming loader reads unquantized checkpoints only")
                if seam.ignored_checkpoint_key(model, key):
                    continue
                name = rename(key)
                expert = _expert_tensor(name, block_index)
                if expert is None:
                    _load_tensor(model, known, name, f.get_tensor(key), device, dtype, shard)
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
    paths_of = {i: path for path, (i, _) in block_index.items()}
    for i, moe in enumerate(layers):
        for e in range(num_experts):
            for part in parts:
                fused = part in ("gate_proj", "up_proj") and (i, e, "gate_up_proj") in seen
                if (i, e, part) not in seen and not fused:
                    raise KeyError(f"checkpoint {folder} is missing expert weight "
                                   f"'{paths_of[i]}.experts.{e}.{part}.weight' (or a fused tensor holding it)")
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
            if pattern is _PER_EXPERT:
                return i, moe, int(m[2]), _PART.get(m[3], m[3])
            return i, moe, None, _PART.get(m[2], m[2])
    return None


def _load_tensor(model, known: set, key: str, tensor: torch.Tensor, device, dtype, shard: Path) -> None:
    if key not in known:
        raise ValueError(f"{shard.name}: unexpected weight {key!r} for {type(model).__name__}")
    if tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if device.type == "cpu":
        tensor = tensor.clone()  # detach from the shard's memory map, which is closed after this shard
    set_module_tensor_to_device(model, key, device, value=tensor)
