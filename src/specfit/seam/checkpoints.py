"""Checkpoints as transformers reads and writes them: its key renamings and ignored keys, the quantization a
checkpoint declares, and ``save_pretrained`` with the experts outside the parameters (streamed from the host store).
"""

from __future__ import annotations

import re

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, apply_renamings

__all__ = ["checkpoint_renamer", "ignored_checkpoint_key", "quantization_method", "clear_checkpoint",
           "save_pretrained_streaming"]

def checkpoint_renamer(model):
    """key -> key: transformers' own renamings of hub checkpoint keys for this model (``conversion_mapping``: e.g.
    Mixtral's ``block_sparse_moe`` -> ``mlp``, PhiMoE's ``block_sparse_moe.gate`` -> ``mlp.router``, Granite's
    ``router.layer`` -> ``router``); the converters that fuse per-expert tensors are not applied (the loader reads
    experts itself)."""
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return lambda key: apply_renamings(key, renamings)


def ignored_checkpoint_key(model, key: str) -> bool:
    """Keys transformers drops on load (``_keys_to_ignore_on_load_unexpected``: DeepSeek-V3 / GLM / Ernie / Qwen3-Next
    multi-token-prediction layers)."""
    return any(re.search(p, key) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])


def quantization_method(config) -> str | None:
    """The checkpoint's quantization (``config.quantization_config.quant_method``: "mxfp4", "fp8", ...), if any."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    return str(q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", q))


def save_pretrained_streaming(model, save_directory, rest: dict, expert_groups: list, *,
                              save_original_format: bool = True, **kwargs) -> None:
    """``model.save_pretrained`` for a model whose routed experts live in a host store, not in its parameters.

    transformers writes the config, the generation config and ``rest`` (every other weight, with its own
    tied-weight, renaming and sharding rules; ``kwargs`` pass through to it). Then each of ``expert_groups`` (a
    callable returning a dict state-dict key -> tensor, views of the store) is read, converted to the checkpoint's
    format as transformers converts a whole state dict (``revert_weight_conversion``: Qwen3-MoE's fused
    ``gate_up_proj`` back to per-expert ``gate_proj``/``up_proj``), copied, written as its own shard and dropped
    before the next is read: the extra memory is one group, never a second copy of the experts. Every shard is then
    numbered ``model-0000k-of-0000n.safetensors`` and one index maps every key, so plain ``from_pretrained`` reads
    the folder as any sharded checkpoint."""
    import json
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    folder = os.fspath(save_directory)
    clear_checkpoint(folder)
    type(model).save_pretrained(model, folder, state_dict=rest, save_original_format=save_original_format,
                                **kwargs)

    index_path = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(folder, SAFE_WEIGHTS_NAME), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), SAFE_WEIGHTS_NAME)
    files = sorted(set(weight_map.values()))
    total_size = sum(_stored_bytes(os.path.join(folder, name)) for name in files)
    temporary = []
    for j, read in enumerate(expert_groups):
        state = read()  # views of the store
        if save_original_format:
            state = revert_weight_conversion(model, state)
        state = {k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format) for k, v in state.items()}
        temporary.append(f"specfit-experts-{j:05d}.safetensors.partial")
        save_file(state, os.path.join(folder, temporary[-1]), metadata={"format": "pt"})
        total_size += sum(t.numel() * t.element_size() for t in state.values())
        weight_map.update(dict.fromkeys(state, temporary[-1]))
        del state
    n = len(files) + len(temporary)
    final = {old: f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k, old in enumerate(files + temporary)}
    for old, new in final.items():
        os.replace(os.path.join(folder, old), os.path.join(folder, new))
    index = {"metadata": {"total_size": total_size},
             "weight_map": {key: final[file] for key, file in sorted(weight_map.items())}}
    with open(index_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def clear_checkpoint(save_directory) -> None:
    """Remove the weights of a checkpoint saved in ``save_directory`` before (one file, or shards and their index),
    so that saving again replaces it whatever its sharding was."""
    import os

    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

    folder = os.fspath(save_directory)
    os.makedirs(folder, exist_ok=True)
    ours = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|" + re.escape(SAFE_WEIGHTS_INDEX_NAME))
    for name in os.listdir(folder):
        if ours.fullmatch(name):
            os.remove(os.path.join(folder, name))


def _stored_bytes(path) -> int:
    """Bytes of the tensors in a safetensors file (its header gives each one's byte range)."""
    import json
    import struct

    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
