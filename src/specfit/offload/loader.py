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

_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_PARTS = ("gate_proj", "up_proj", "down_proj")


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub repo id, downloaded (config, tokenizer and safetensors only)."""
    path = Path(path_or_id)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint folder (with config.json and *.safetensors)")
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
                   pin: bool | str = "auto") -> tuple[torch.nn.Module, ExpertStore, torch.device]:
    """Stream a checkpoint: routed experts into a new ``ExpertStore``, everything else onto ``device``; returns
    ``(model, store, device)``, the model without expert parameters, ready for ``enable(..., store=store)``."""
    folder = resolve_checkpoint(path_or_id, revision)
    config = AutoConfig.from_pretrained(folder)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = seam.moe_layers(model)
    first = layers[0]
    num_experts = first.num_experts
    for moe in layers:
        del moe.experts.gate_up_proj, moe.experts.down_proj  # the store takes their place
    store = ExpertStore(len(layers), num_experts, first.hidden, first.intermediate, dtype, pin=pin)
    moe_index = {moe.layer: i for i, moe in enumerate(layers)}

    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    known |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    seen = set()
    for shard in shard_files(folder):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for key in f.keys():
                m = _EXPERT_KEY.match(key)
                if m is not None:
                    layer, expert, part = int(m[1]), int(m[2]), m[3]
                    if layer not in moe_index or expert >= num_experts:
                        raise ValueError(f"{shard.name}: {key} does not fit the model (MoE layers "
                                         f"{sorted(moe_index)}, {num_experts} experts)")
                    store.write_part(moe_index[layer], expert, part, f.get_tensor(key))
                    seen.add((layer, expert, part))
                else:
                    _load_tensor(model, known, key, f.get_tensor(key), device, dtype, shard)
    for moe in layers:
        for e in range(num_experts):
            for part in _PARTS:
                if (moe.layer, e, part) not in seen:
                    raise KeyError(f"checkpoint {folder} is missing expert weight "
                                   f"'model.layers.{moe.layer}.mlp.experts.{e}.{part}.weight'")
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


def _load_tensor(model, known: set, key: str, tensor: torch.Tensor, device, dtype, shard: Path) -> None:
    if key not in known:
        raise ValueError(f"{shard.name}: unexpected weight {key!r} for {type(model).__name__}")
    if tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if device.type == "cpu":
        tensor = tensor.clone()  # detach from the shard's memory map, which is closed after this shard
    set_module_tensor_to_device(model, key, device, value=tensor)
